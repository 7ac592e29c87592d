"""sparse-v1 costs bounded by its tensor: each payload is parsed once per pull (at load; the
check and the apply reuse that parse), and a parse keeps a small, fixed fraction of the tensor
(about 25 bytes per segment, and segments hold at least min(n, 2^16) elements).
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import zstandard

from weightsync import Publisher, pull
from weightsync.codecs import sparse_v1 as codec_sparse

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

# An upstream-style chain: no side anchors, nothing pruned, so a pull replays every delta.
NO_ANCHORS = dict(anchor_fraction=0, anchor_max_deltas=0, prune=False)


def one_change_per_segment(n: int, seg: int) -> bytes:
    """A width-1 payload changing the first element of every segment by +1, from the spec."""
    nseg = -(-n // seg)
    z = zstandard.ZstdCompressor(level=1, write_content_size=True)
    frames = [z.compress(b"\0"), z.compress(b"\0"), z.compress(b"\0")]  # gap 0; sign +; no large value
    entry = struct.pack("<IIB3x", 1, 0, 1) + struct.pack("<3I", *map(len, frames))
    head = b"WSSP" + bytes([1, 1, 0, 0]) + struct.pack("<QII", n, seg, nseg)
    return head + entry * nseg + b"".join(frames) * nseg


def test_a_sparse_parse_keeps_a_small_fraction_of_its_tensor():
    n = 1 << 26  # a 64 MiB tensor in 1024 segments of the spec's smallest size
    payload = one_change_per_segment(n, codec_sparse.MIN_SEG_ELEMENTS)
    tracemalloc.start()
    try:
        parsed = codec_sparse.parse(payload, n, "t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed.nsegments == 1024 and parsed.changed_elements() == 1024
    assert peak < n // 1024, f"a parse of a {n}-byte tensor allocated {peak} bytes"


def test_a_pull_parses_each_sparse_payload_once(fast_tmp_path, monkeypatch):
    from weightsync.puller import apply as apply_mod

    rng = np.random.default_rng(10)
    root = str(fast_tmp_path)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    tensors = random_tensors(rng, {"big": ("uint16", (400, 500)), "small": ("float32", (64,)), "b": ("int16", (300,))})
    write_hf_checkpoint(seed, tensors)
    pub = Publisher(source, encoding="sparse-v1", workers=1, **NO_ANCHORS)
    pub.seed_snapshot(tensors, version=0)
    payloads = 0
    for v in range(1, 4):
        tensors = mutate(tensors, rng, 0.05)
        pub.publish(v, tensors, full=False)
        payloads += len(tensors)
    pub.close()
    monkeypatch.setattr(apply_mod, "SPLIT_MIN_NBYTES", 0)  # "big" is split across the workers too
    calls: list[str] = []
    parse = codec_sparse.parse

    def counting(payload, nbytes, tensor, **kw):
        calls.append(tensor)
        return parse(payload, nbytes, tensor, **kw)

    monkeypatch.setattr(codec_sparse, "parse", counting)
    pull(local, seed, source, 3, workers=3)
    assert_checkpoint_is(local, tensor_bytes(tensors))
    assert len(calls) == payloads, f"{len(calls)} parses of {payloads} payloads"
