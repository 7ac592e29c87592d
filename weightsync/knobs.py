"""Every tunable of the core, each with its environment override.

Read once per call site through ``knobs.get(...)`` so tests can monkeypatch the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import InvalidKnobError


@dataclass(frozen=True)
class Knob:
    env: str
    default: float
    help: str

    def get(self) -> float:
        raw = os.environ.get(self.env)
        if raw is None or raw == "":
            return self.default
        try:
            return float(raw)
        except ValueError:
            raise InvalidKnobError(self.env, raw, f"a number ({self.help})") from None


APPLY_WORKERS = Knob("WEIGHTSYNC_APPLY_WORKERS", 0, "threads applying deltas; 0 = one per core, at most 32")
PUBLISH_WORKERS = Knob("WEIGHTSYNC_PUBLISH_WORKERS", 0, "threads encoding deltas; 0 = one per core, at most 32")
PAYLOADS_PER_PASS = Knob(
    "WEIGHTSYNC_PAYLOADS_PER_PASS", 8,
    "payloads of one tensor a worker holds open at once while applying a chain (bounds descriptors and zstd decompressors)",
)
CHUNK_NBYTES = Knob("WEIGHTSYNC_CHUNK_NBYTES", 2 << 20, "bytes a worker decompresses/applies at a time")
LOCK_TIMEOUT_S = Knob("WEIGHTSYNC_LOCK_TIMEOUT_S", 600, "seconds a pull waits for the per-host lock")
LOCK_LOG_EVERY_S = Knob("WEIGHTSYNC_LOCK_LOG_EVERY_S", 10, "seconds between 'still waiting for the lock' lines")
MAX_HEADER_NBYTES = Knob("WEIGHTSYNC_MAX_HEADER_NBYTES", 100 << 20, "largest safetensors header accepted")
MAX_INDEX_NBYTES = Knob("WEIGHTSYNC_MAX_INDEX_NBYTES", 64 << 20, "largest index json accepted")
FULL_SHARD_NBYTES = Knob("WEIGHTSYNC_FULL_SHARD_NBYTES", 4 << 30, "bytes per shard of a full version")
DELTA_SHARD_NBYTES = Knob("WEIGHTSYNC_DELTA_SHARD_NBYTES", 2 << 30, "payload bytes per shard of a delta version")
ZSTD_LEVEL = Knob("WEIGHTSYNC_ZSTD_LEVEL", 1, "zstd level of delta payloads")
FULL_ABOVE_CHANGED_FRACTION = Knob(
    "WEIGHTSYNC_FULL_ABOVE_CHANGED_FRACTION", 0.5, "publish a full version when more than this fraction of elements changed"
)
FALLBACK_FRACTION = Knob("WEIGHTSYNC_FALLBACK_FRACTION", 0.5, "publish a full version when delta > this x full")
ANCHOR_FRACTION = Knob(
    "WEIGHTSYNC_ANCHOR_FRACTION", 1.0,
    "write a side anchor once the deltas since the last anchor exceed this x the full size (0: never by size)",
)
ANCHOR_MAX_DELTAS = Knob(
    "WEIGHTSYNC_ANCHOR_MAX_DELTAS", 64, "write a side anchor after this many deltas since the last one (0: no limit)"
)
SPARSE2_CLASS_MIN_SAVING = Knob(
    "WEIGHTSYNC_SPARSE2_CLASS_MIN_SAVING", 1 / 8192,
    "sparse-v2: bytes per segment element a class must save to be kept (each costs the puller a pass; "
    "larger: fewer classes, faster pull, more bytes)",
)
SPARSE2_BITSTREAM = Knob(
    "WEIGHTSYNC_SPARSE2_BITSTREAM", 3,
    "sparse-v2: the bitstream the publisher writes: 3 (range coded, needs the compiled coder; 2 where it is "
    "missing) or 2 (magnitude classes, Rice coded, numpy only)",
)
# encoding="auto" (publisher/encoding_choice.py): the link a puller has, what sparse-v2 costs it, the sample
LINK_BYTES_PER_S = Knob(
    "WEIGHTSYNC_LINK_BYTES_PER_S", 0,
    "encoding auto: bytes per second one puller gets from the source dir (its share of the link); 0: not declared",
)
SPARSE2_PASS_NS = Knob(
    "WEIGHTSYNC_SPARSE2_PASS_NS", 1.9,
    "encoding auto: puller CPU ns per element and pass of a sparse-v2 segment with several classes (one core)",
)
SPARSE2_CODED_NS = Knob(
    "WEIGHTSYNC_SPARSE2_CODED_NS", 5.6,
    "encoding auto: puller CPU ns per element of a range-coded (bitstream 3) sparse-v2 segment with changes (one core)",
)
SPARSE2_CHANGE_NS = Knob(
    "WEIGHTSYNC_SPARSE2_CHANGE_NS", 17,
    "encoding auto: puller CPU ns per changed element that sparse-v2 costs beyond sparse-v1 (one core)",
)
AUTO_SAMPLE_FRACTION = Knob(
    "WEIGHTSYNC_AUTO_SAMPLE_FRACTION", 1 / 64,
    "encoding auto: share of the 2^20-element windows encoded both ways to estimate the sizes (0 < f <= 1)",
)
KEEP_VERSIONS = Knob("WEIGHTSYNC_KEEP_VERSIONS", 8, "newest versions the publisher's pruning never removes")


def workers(knob: Knob, requested: int | None = None) -> int:
    n = int(requested if requested else knob.get())
    if n <= 0:
        n = min(32, os.cpu_count() or 1)
    return max(1, n)
