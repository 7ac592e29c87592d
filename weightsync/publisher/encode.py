"""Encode scheduling: turn one version's jobs into payloads and digests, parallel over tensors.

Largest tensors start first so no big one starts last; a large ``sparse-v1`` tensor is split
into segment ranges encoded by several workers and joined into the payload one encode would
give. Only a tensor that changed is hashed: the others keep the digest their snapshot entry
carries. A version already known to be full is not encoded at all (a full version stores the
bytes, not a delta, and no digests).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import msgspec
import numpy as np

from .. import progress
from ..codecs import Codec, SegmentedCodec, get_codec
from ..format.checksum import new_hasher
from ..format.safetensors_io import DTYPE_NBYTES
from .snapshot import EncodeJob

SPLIT_MIN_NBYTES = 64 << 20  # smallest tensor a sparse-v1 publish may encode on several workers


class PreparedTensor(msgspec.Struct):
    name: str
    dtype: str
    shape: tuple[int, ...]
    new: np.ndarray  # uint8 view of the new bytes
    payload: bytes | None  # compressed delta; None when the tensor did not change (or was not encoded)
    digest: str  # of the new bytes; "" when not computed (unchanged and never hashed, or not encoded)
    changed_bytes: int
    changed_elements: int
    nbytes: int
    nelements: int


class PreparedVersion(msgspec.Struct):
    version: int
    rank: int
    tensors: list[PreparedTensor]
    delta_nbytes: int  # payload bytes of the changed tensors
    full_nbytes: int  # bytes of every tensor this rank owns
    changed_bytes: int
    changed_elements: int
    total_elements: int
    encode_s: float
    encoded: bool = True  # False: prepared for a full version only (no payloads, no change counts)
    encoding: str = ""  # the delta encoding of the payloads ("" when not encoded)
    encoding_reason: str = ""  # why the publisher chose it (encoding "auto"), else ""


class Encoder:
    """Encodes with a codec chosen per version, and one checksum, on a shared thread pool."""

    def __init__(self, encoding: str, checksum: str, level: int, workers: int, pool: ThreadPoolExecutor):
        """``encoding``: what ``prepare`` uses when it is not told ("auto" has no codec: the
        publisher names one per version)."""
        self.encoding = encoding
        self.checksum = checksum
        self.level = level
        self.workers = workers
        self.pool = pool

    def prepare(
        self, version: int, rank: int, jobs: list[EncodeJob], *, encode: bool = True, encoding: str | None = None,
        encoding_reason: str = "",
    ) -> PreparedVersion:
        t0 = time.perf_counter()
        name = encoding or self.encoding
        if encode:
            tensors = self._encode(jobs, get_codec(name))
            self._hash_changed(tensors)
        else:
            tensors = [_unencoded(j) for j in jobs]
        return PreparedVersion(
            version=version,
            rank=rank,
            tensors=tensors,
            delta_nbytes=sum(len(t.payload) for t in tensors if t.payload is not None),
            full_nbytes=sum(t.nbytes for t in tensors),
            changed_bytes=sum(t.changed_bytes for t in tensors),
            changed_elements=sum(t.changed_elements for t in tensors),
            total_elements=sum(t.nelements for t in tensors),
            encode_s=time.perf_counter() - t0,
            encoded=encode,
            encoding=name if encode else "",
            encoding_reason=encoding_reason if encode else "",
        )

    def _encode(self, jobs: list[EncodeJob], codec: Codec) -> list[PreparedTensor]:
        plan = self._split_plan(jobs, codec)
        parted = cast(SegmentedCodec, codec)  # used only when plan is non-empty: a codec with parts

        def encode_whole(job: EncodeJob) -> PreparedTensor:
            t = _unencoded(job)
            if job.name in plan or job.untouched:  # parts are encoded by other units
                return t
            enc = codec.encode(job.snap.buf, job.new, DTYPE_NBYTES[job.dtype], self.level, job.name)
            if enc is not None:
                t.payload, t.changed_bytes, t.changed_elements = enc
            return t

        def run_unit(unit):
            job, seg_range = unit
            if seg_range is None:
                return encode_whole(job)
            return parted.encode_part(job.snap.buf, job.new, DTYPE_NBYTES[job.dtype], self.level, job.name, seg_range)

        order = sorted(jobs, key=lambda j: -j.new.nbytes)
        units = [(j, r) for j in order if j.name in plan for r in plan[j.name]] + [(j, None) for j in order]
        bar = progress.stage("publish: encode", sum(j.new.nbytes for j in jobs))

        def run_unit_counted(unit):
            job, seg_range = unit
            out = run_unit(unit)
            if seg_range is not None:  # a part: its share of the tensor's segments (the shares sum exactly)
                nseg = plan[job.name][-1][1]
                bar.advance(job.new.nbytes * seg_range[1] // nseg - job.new.nbytes * seg_range[0] // nseg)
            elif job.name not in plan:
                bar.advance(job.new.nbytes)
            return out

        results = list(self.pool.map(run_unit_counted, units))
        parts: dict[str, list] = {}
        by_name: dict[str, PreparedTensor] = {}
        for (job, seg_range), r in zip(units, results):
            if seg_range is None:
                by_name[job.name] = r
            else:
                parts.setdefault(job.name, []).append(r)
        for name, ps in parts.items():
            t = by_name[name]
            enc = parted.join(ps, t.nbytes, DTYPE_NBYTES[t.dtype])
            if enc is not None:
                t.payload, t.changed_bytes, t.changed_elements = enc
        return [by_name[j.name] for j in jobs]

    def _hash_changed(self, tensors: list[PreparedTensor]) -> None:
        def digest(t: PreparedTensor) -> None:
            h = new_hasher(self.checksum)
            h.update(t.new)
            t.digest = h.hexdigest()

        changed = sorted((t for t in tensors if t.payload is not None), key=lambda t: -t.nbytes)
        list(self.pool.map(digest, changed))

    def _split_plan(self, jobs: list[EncodeJob], codec: Codec) -> dict[str, list[tuple[int, int]]]:
        """name -> segment ranges for the tensors worth encoding on several workers: larger
        than SPLIT_MIN_NBYTES and than half a worker's fair share (one embedding would
        otherwise keep one worker busy while the others idle). Needs a codec with parts."""
        if self.workers <= 1 or not hasattr(codec, "encode_part"):
            return {}
        parted = cast(SegmentedCodec, codec)
        total = sum(j.new.nbytes for j in jobs)
        limit = max(SPLIT_MIN_NBYTES, total // (2 * self.workers))
        plan = {}
        for job in jobs:
            if job.untouched or job.new.nbytes <= limit:
                continue
            nseg = parted.segment_count(job.new.nbytes, DTYPE_NBYTES[job.dtype])
            nparts = min(nseg, self.workers, -(-job.new.nbytes // (limit // 2)))
            if nparts >= 2:
                bounds = [nseg * i // nparts for i in range(nparts + 1)]
                plan[job.name] = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        return plan


def _unencoded(job: EncodeJob) -> PreparedTensor:
    itemsize = DTYPE_NBYTES[job.dtype]
    return PreparedTensor(
        job.name, job.dtype, job.shape, job.new, None, job.snap.digest or "", 0, 0, job.new.nbytes,
        job.new.nbytes // itemsize,
    )


__all__ = ["Encoder", "PreparedTensor", "PreparedVersion", "SPLIT_MIN_NBYTES"]
