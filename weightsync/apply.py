"""Apply a chain of deltas to the local checkpoint in place, through mmap, parallel over
tensors, and verify every tensor.

Order: load and check every delta of the chain (headers, names against the index, digests,
frame sizes) -> check each tensor against the local checkpoint (exists, byte length) -> clear
the marker -> apply -> verify -> flush pages to disk -> (caller) write the marker.

Folding: each tensor's pending payloads are applied back to back (all xor: in one pass, chunk
by chunk) and verified once, against the digest of the newest version that touched it. Strict
mode (used after a reseed) verifies after every version so a failure names its version.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Callable, Iterable, cast

import msgspec
import numpy as np

from .checksum import is_well_formed_digest, new_hasher
from .codecs import apply_xor_chain, get_codec
from .errors import (
    ChecksumMismatchError,
    LocalTensorMismatchError,
    MalformedHeaderError,
    PayloadBoundError,
    ShardMismatchError,
    SourceNotReadyError,
)
from .layout import checked_inside, checked_join
from .manifest import VersionIndex, checkpoint_weight_files
from .safetensors_io import DTYPE_NBYTES, TensorEntry, local_tensor_table, read_header

log = logging.getLogger(__name__)


class DeltaTensor(msgspec.Struct):
    name: str
    payload: memoryview  # into the shard's read-only mmap
    digest: str


class LoadedDelta(msgspec.Struct):
    index: VersionIndex
    tensors: dict[str, DeltaTensor]
    nbytes: int


class VerifyFailed(Exception):
    """Digests did not match after a folded apply (the local state or the artifact is bad)."""

    def __init__(self, mismatches: list[tuple[str, str, str]], version: int, checksum_format: str):
        super().__init__(f"{len(mismatches)} mismatches")
        self.mismatches = mismatches
        self.version = version
        self.checksum_format = checksum_format


class _Maps:
    """Open read/write mmaps of the local files; closed (and flushed) together."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[BinaryIO, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._open:
                fh = open(path, "r+b")
                mm = mmap.mmap(fh.fileno(), 0)
                try:
                    mm.madvise(mmap.MADV_WILLNEED)
                except (AttributeError, OSError, ValueError):
                    pass
                self._open[path] = (fh, mm)
            return self._open[path][1]

    def flush(self) -> None:
        for fh, mm in self._open.values():
            mm.flush()
            os.fsync(fh.fileno())

    def paths(self) -> list[str]:
        return list(self._open)

    def close(self) -> None:
        for fh, mm in self._open.values():
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive (an exception in flight); the GC closes it later
            fh.close()
        self._open.clear()


def load_delta(index: VersionIndex, keep: list) -> LoadedDelta:
    """Open the shards the index names (never a listing) and check them without decompressing."""
    # A checksum whose package is missing must fail here, before the marker is cleared.
    new_hasher(index.checksum_format or "")
    tensors: dict[str, DeltaTensor] = {}
    nbytes = 0
    codec = get_codec(index.delta_encoding or "")
    for fname, expected in sorted(index.shards().items()):
        path = checked_join(index.path, fname, f"v{index.version} index")
        if os.path.lexists(path):
            checked_inside(index.path, path, f"v{index.version} shard")
        try:
            hdr = read_header(path, check_dtype_sizes=True)
        except FileNotFoundError:
            raise SourceNotReadyError(
                f"v{index.version}: the index names shard {fname}, which is not in {index.path}. "
                "The shared filesystem may not show it yet; retry later."
            ) from None
        actual = set(hdr.tensors)
        if actual != expected:
            raise ShardMismatchError(path, expected - actual, actual - expected)
        fh = open(path, "rb")
        keep.append(fh)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if hdr.file_nbytes else b""
        keep.append(mm)
        view = memoryview(mm)
        for name, entry in hdr.tensors.items():
            if entry.dtype != "U8" or len(entry.shape) != 1:
                raise MalformedHeaderError(path, f"delta tensor {name!r} must be 1-D U8, got {entry.dtype} {list(entry.shape)}")
            want = hdr.metadata.get(name)
            if not is_well_formed_digest(index.checksum_format or "", want):
                raise MalformedHeaderError(
                    path, f"__metadata__ has no well-formed {index.checksum_format} digest for {name!r} (got {want!r})"
                )
            payload = view[entry.offset : entry.offset + entry.nbytes]
            check_structure = getattr(codec, "check_structure", None)
            if check_structure is not None:
                try:
                    check_structure(payload, name)
                except PayloadBoundError as e:
                    e.args = (f"v{index.version}: {e.args[0]}",)
                    raise
            tensors[name] = DeltaTensor(name, payload, cast(str, want))  # well-formed: a str
            nbytes += entry.nbytes
    return LoadedDelta(index, tensors, nbytes)


def reference_table(seed_dir: str) -> dict[str, tuple[str, TensorEntry]]:
    """The seed dir's tensors (headers only); empty when it cannot be read."""
    try:
        return local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir))
    except (OSError, MalformedHeaderError):
        return {}


def local_table(local_checkpoint_dir: str) -> dict[str, tuple[str, TensorEntry]]:
    try:
        files = checkpoint_weight_files(local_checkpoint_dir)
        return local_tensor_table(local_checkpoint_dir, files)
    except (FileNotFoundError, MalformedHeaderError) as e:
        raise LocalTensorMismatchError("<checkpoint>", f"the local checkpoint is unreadable: {e}") from None


def check_against_local(
    deltas: Iterable[LoadedDelta],
    table: dict[str, tuple[str, TensorEntry]],
    seed_dir: str,
) -> None:
    """Every changed tensor exists locally and its payload fits the local byte length.

    When a payload does not fit, the seed dir's headers decide who is wrong: dtype and shape
    never change between versions, so a local length that differs from the model's is local
    damage (reseed), and a payload that does not fit the model's length is a bad artifact.
    They are read only then, so a healthy pull reads no seed-dir header.
    """
    reference: dict[str, tuple[str, TensorEntry]] | None = None
    for d in deltas:
        codec = get_codec(d.index.delta_encoding or "")
        for name, t in d.tensors.items():
            if name not in table:
                raise LocalTensorMismatchError(name, f"v{d.index.version} changes it, but the local checkpoint has no such tensor")
            entry = table[name][1]
            try:
                codec.check(t.payload, entry.nbytes, DTYPE_NBYTES[entry.dtype], name)
            except PayloadBoundError as e:
                if reference is None:
                    reference = reference_table(seed_dir)
                ref = reference.get(name)
                if ref is not None and ref[1].nbytes != entry.nbytes:
                    raise LocalTensorMismatchError(
                        name, f"the local tensor holds {entry.nbytes} bytes, the engine's own model {ref[1].nbytes}"
                    ) from None
                e.args = (f"v{d.index.version}: {e.args[0]}",)
                raise


class _Job(msgspec.Struct):
    name: str
    path: str
    entry: TensorEntry
    steps: list  # [(codec name, payload)]
    digest: str
    checksum_format: str
    version: int


def _jobs(deltas: list[LoadedDelta], table) -> list[_Job]:
    jobs: dict[str, _Job] = {}
    for d in deltas:
        for name, t in d.tensors.items():
            path, entry = table[name]
            job = jobs.get(name)
            if job is None:
                job = jobs[name] = _Job(name, path, entry, [], t.digest, d.index.checksum_format or "", d.index.version)
            job.steps.append((d.index.delta_encoding, t.payload))
            job.digest, job.checksum_format, job.version = t.digest, d.index.checksum_format or "", d.index.version
    return sorted(jobs.values(), key=lambda j: -j.entry.nbytes)


def _run_job(job: _Job, maps: _Maps, chunk_nbytes: int) -> tuple[str, str, str] | None:
    mm = maps.get(job.path)
    region = np.ndarray((job.entry.nbytes,), dtype=np.uint8, buffer=mm, offset=job.entry.offset)
    try:
        hasher = new_hasher(job.checksum_format)
        encodings = {enc for enc, _ in job.steps}
        if encodings == {"xor"}:
            apply_xor_chain(region, [p for _, p in job.steps], job.name, chunk_nbytes, hasher)
        elif len(encodings) == 1 and next(iter(encodings)) in _SEGMENTED:
            # segment-major: every version's changes to a segment, then hash it while cached
            # (sparse-v2: each version against the bytes the previous one left in the segment)
            _segmented(next(iter(encodings)))[0](region, [p for _, p in job.steps], job.name, chunk_nbytes, hasher)
        else:
            # a mixed chain: each payload whole, in order, each against the previous one's bytes
            itemsize = DTYPE_NBYTES[job.entry.dtype]
            for enc, payload in job.steps:
                get_codec(enc).apply(region, payload, itemsize, job.name, chunk_nbytes)
            _hash_in_chunks(hasher, region, chunk_nbytes)
        actual = hasher.hexdigest()
    finally:
        del region
    return None if actual == job.digest else (job.name, job.digest, actual)


# A sparse-v1 or sparse-v2 tensor larger than this and than its fair share of the work is cut
# into runs of segments applied by several workers (one large embedding would otherwise keep
# one worker busy while the rest idle), then hashed in one pass.
SPLIT_MIN_NBYTES = 64 << 20
_SEGMENTED = ("sparse-v1", "sparse-v2")


def _segmented(encoding: str):
    """(chain apply, shared segment count) of a segmented encoding."""
    if encoding == "sparse-v1":
        from .codec_sparse import apply_sparse_chain, shared_segment_count

        return apply_sparse_chain, shared_segment_count
    from .codec_sparse2 import apply_sparse2_chain, shared_segment_count as shared2

    return apply_sparse2_chain, shared2


def _split_plan(jobs: list[_Job], workers: int) -> dict[str, list[tuple[int, int]]]:
    """name -> segment ranges, for the tensors worth splitting across workers."""
    if workers <= 1:
        return {}
    total = sum(j.entry.nbytes for j in jobs)
    limit = max(SPLIT_MIN_NBYTES, total // (2 * workers))
    plan: dict[str, list[tuple[int, int]]] = {}
    for job in jobs:
        encodings = {enc for enc, _ in job.steps}
        if job.entry.nbytes <= limit or len(encodings) != 1 or next(iter(encodings)) not in _SEGMENTED:
            continue
        nseg = _segmented(next(iter(encodings)))[1]([p for _, p in job.steps], job.entry.nbytes, job.name)
        if not nseg or nseg < 2:
            continue
        parts = min(nseg, workers, -(-job.entry.nbytes // (limit // 2)))
        bounds = [nseg * i // parts for i in range(parts + 1)]
        plan[job.name] = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    return plan


def _apply_part(job: _Job, maps: _Maps, chunk_nbytes: int, seg_range: tuple[int, int]) -> None:
    apply_chain_fn = _segmented(job.steps[0][0])[0]
    mm = maps.get(job.path)
    region = np.ndarray((job.entry.nbytes,), dtype=np.uint8, buffer=mm, offset=job.entry.offset)
    try:
        apply_chain_fn(region, [p for _, p in job.steps], job.name, chunk_nbytes, None, seg_range=seg_range)
    finally:
        del region


def _verify_job(job: _Job, maps: _Maps, chunk_nbytes: int) -> tuple[str, str, str] | None:
    mm = maps.get(job.path)
    region = np.ndarray((job.entry.nbytes,), dtype=np.uint8, buffer=mm, offset=job.entry.offset)
    try:
        hasher = new_hasher(job.checksum_format)
        _hash_in_chunks(hasher, region, chunk_nbytes)
        actual = hasher.hexdigest()
    finally:
        del region
    return None if actual == job.digest else (job.name, job.digest, actual)


def _run_jobs(pool: ThreadPoolExecutor, jobs: list[_Job], maps: _Maps, chunk_nbytes: int, workers: int, progress) -> list:
    """Every job applied and verified; large sparse-v1/v2 tensors in parts, hashed afterwards."""
    plan = _split_plan(jobs, workers)
    units: list[tuple[_Job, tuple[int, int] | None]] = [(j, r) for j in jobs if j.name in plan for r in plan[j.name]]
    units += [(j, None) for j in jobs if j.name not in plan]
    done = 0
    results = []

    def run_unit(unit):
        job, seg_range = unit
        if seg_range is None:
            return _run_job(job, maps, chunk_nbytes)
        _apply_part(job, maps, chunk_nbytes, seg_range)
        return _PART_DONE

    for r in pool.map(run_unit, units):
        if r is _PART_DONE:
            continue
        results.append(r)
        done += 1
        if progress is not None:
            progress(done, len(jobs))
    split = [j for j in jobs if j.name in plan]
    for r in pool.map(lambda j: _verify_job(j, maps, chunk_nbytes), split):
        results.append(r)
        done += 1
        if progress is not None:
            progress(done, len(jobs))
    return results


_PART_DONE = object()


def _hash_in_chunks(hasher, region: np.ndarray, chunk_nbytes: int) -> None:
    for pos in range(0, region.nbytes, chunk_nbytes):
        hasher.update(region[pos : pos + chunk_nbytes])


def apply_chain(
    local_checkpoint_dir: str,
    deltas: list[LoadedDelta],
    table,
    *,
    workers: int,
    chunk_nbytes: int,
    strict: bool,
    flush: bool = True,
    progress: "Callable[[int, int], None] | None" = None,
) -> list[str]:
    """Apply the loaded deltas in place and verify; the caller has cleared the marker.

    Returns the local files written. With ``flush=False`` their pages are left for the caller
    to fsync (deferred durability): the marker must not be written before that.
    """
    maps = _Maps()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-apply") as pool:
            groups = [[d] for d in deltas] if strict else [deltas]
            for group in groups:
                jobs = _jobs(group, table)
                results = _run_jobs(pool, jobs, maps, chunk_nbytes, workers, progress)
                bad = [r for r in results if r is not None]
                if bad:
                    last = group[-1].index
                    if strict:
                        raise ChecksumMismatchError(last.version, bad, last.checksum_format or "")
                    versions = {j.name: j.version for j in jobs}
                    raise VerifyFailed(bad, max(versions[n] for n, _, _ in bad), last.checksum_format or "")
        if flush:
            maps.flush()
        return maps.paths()
    finally:
        maps.close()


def fsync_files(paths: list[str]) -> None:
    """Write back pages dirtied through (closed) mmaps: fsync covers them on Linux."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def close_all(keep: list) -> None:
    for obj in reversed(keep):
        try:
            obj.close()
        except (BufferError, OSError):
            pass
    keep.clear()
