"""Apply a chain of deltas to the local checkpoint in place, through mmap, parallel over
tensors, and verify every tensor.

Order: load and check every delta of the chain (headers, names against the index, digests,
frame sizes) -> check each tensor against the local checkpoint (exists, byte length) -> clear
the marker -> apply -> verify -> flush pages to disk -> (caller) write the marker.

Folding: each tensor's pending payloads are applied back to back (all xor: chunk by chunk, a
few payloads per pass) and verified once, against the digest of the newest version that
touched it: that digest covers the tensor's complete final bytes, whatever the encodings. The
per-version mode (a diagnostic after a replay that still fails) verifies after every version
so the failure names its version.

Bounded resources: a loaded chain holds no open file. Each payload is proven at load, its
structure kept (``Codec.check_structure``) and its shard closed; while applying, a worker applies
a tensor's chain ``PAYLOADS_PER_PASS`` payloads per pass (one zstd decompressor each), and the
workers share at most workers x that many shard descriptors (the least recently used closed
first), so descriptors and decompressors do not grow with the chain. Shards are read with
pread, never mapped (``_open_shard``): one cut short under the pull is a typed error.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, cast

import msgspec
import numpy as np

from .. import knobs
from .. import progress as progress_report
from ..codecs import ChainCodec, apply_xor_chain, get_codec
from ..errors import (
    ChecksumMismatchError,
    LocalTensorMismatchError,
    MalformedHeaderError,
    PayloadBoundError,
    ShardMismatchError,
    ShardShrunkError,
    SourceNotReadyError,
)
from ..format.checksum import is_well_formed_digest, require_checksum, tensor_hasher
from ..format.layout import checked_inside, checked_join
from ..format.manifest import VersionIndex, checkpoint_weight_files
from ..format.safetensors_io import DTYPE_NBYTES, RangeStream, TensorEntry, local_tensor_table, read_header, read_range

log = logging.getLogger(__name__)


class PayloadRef(msgspec.Struct, frozen=True):
    """Where one payload lives; the shard is reopened (and checked to be the same file) on use."""

    path: str
    offset: int  # absolute, in the shard file
    nbytes: int
    file_id: tuple[int, int, int]  # (st_dev, st_ino, st_size) at load


class DeltaTensor(msgspec.Struct):
    name: str
    ref: PayloadRef
    digest: str
    structure: object  # what the codec's check_structure returned: handed back to check_fit and apply


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
    """Writable mmaps of the local files (one descriptor each, however long the chain); flushed
    and closed together."""

    def __init__(self) -> None:
        self._open: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._open:
                with open(path, "r+b") as fh:
                    mm = mmap.mmap(fh.fileno(), 0)  # holds its own duplicate of the descriptor
                try:
                    mm.madvise(mmap.MADV_WILLNEED)
                except (AttributeError, OSError, ValueError):
                    pass
                self._open[path] = mm
            return self._open[path]

    def flush(self) -> None:
        for mm in self._open.values():
            mm.flush()
        fsync_files(self.paths())

    def paths(self) -> list[str]:
        return list(self._open)

    def close(self) -> None:
        for mm in self._open.values():
            _close_map(mm)
        self._open.clear()


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive (an exception in flight); the GC closes it later


def _descriptor_limit() -> int:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if soft > 0 else 1 << 20  # RLIM_INFINITY is -1


def _open_shard(path: str, file_id: tuple[int, int, int] | None = None) -> int:
    """A read-only descriptor of a shard. With ``file_id``, the file must still be the one
    checked at load (published versions are immutable; a pruned or replaced shard is 'not
    ready', and the next pull reseeds).

    Shards of the source dir are read with pread (``safetensors_io.read_range``), never mapped:
    a shard truncated under a map kills the process with SIGBUS (no Python handler can resume
    the faulting load), a short pread is a typed ``ShardShrunkError``. Only the local
    checkpoint, a host-local file this process owns, is mapped."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SourceNotReadyError(
            f"shard {path} disappeared while the pull was applying it (pruned meanwhile?); retry the pull"
        ) from None
    st = os.fstat(fd)
    if file_id is not None and (st.st_dev, st.st_ino, st.st_size) != file_id:
        os.close(fd)
        raise SourceNotReadyError(f"shard {path} changed since the pull checked it; retry the pull")
    return fd


def read_payload(fd: int, ref: "PayloadRef") -> memoryview:
    """One payload's bytes, copied from its shard (see ``_open_shard``)."""
    return memoryview(read_range(fd, ref.offset, ref.nbytes, ref.path))


class _ShardMaps:
    """Read-only descriptors of delta shards, shared by the workers, so every tensor of a chain
    reuses each version's descriptor. At most ``capacity`` stay open: 2 x workers x
    ``per_pass``, and never more than a quarter of the process's descriptor limit; only those in
    use (a worker holds at most ``per_pass``) may exceed it. When full, the most recently used
    idle one is closed: tensors walk the chain in the same order, and for such a cyclic walk
    longer than the cache that keeps most of it open, where closing the least recently used
    would miss always. Payloads are copied out with pread (``payloads``): an xor pass streams
    them (``RangeStream``, bounded memory), other codecs hold at most ``per_pass`` payloads per
    worker."""

    def __init__(self, per_pass: int, workers: int) -> None:
        self.per_pass = per_pass
        self.capacity = max(per_pass, min(2 * per_pass * max(1, workers), _descriptor_limit() // 4))
        self._maps: OrderedDict[str, list] = OrderedDict()  # path -> [map, users], oldest use first
        self._lock = threading.Lock()

    def _acquire(self, ref: PayloadRef) -> int:
        with self._lock:
            entry = self._maps.get(ref.path)
            if entry is None:
                idle = [p for p, (_, users) in reversed(self._maps.items()) if users == 0]
                for path in idle[: max(0, len(self._maps) + 1 - self.capacity)]:
                    os.close(self._maps.pop(path)[0])
                entry = self._maps[ref.path] = [_open_shard(ref.path, ref.file_id), 0]
            entry[1] += 1
            self._maps.move_to_end(ref.path)
            return entry[0]

    def _release(self, path: str) -> None:
        with self._lock:
            self._maps[path][1] -= 1

    @contextlib.contextmanager
    def payloads(self, refs: list[PayloadRef], stream: bool = False) -> Iterator[list]:
        """Up to ``per_pass`` payloads, copied into memory, or with ``stream`` as ``RangeStream``
        readers (what ``ExactReader`` takes: xor never holds a payload whole); their
        descriptors stay cached."""
        assert len(refs) <= self.per_pass
        out: list = []
        held: list[str] = []
        try:
            for ref in refs:
                fd = self._acquire(ref)
                held.append(ref.path)
                out.append(RangeStream(fd, ref.offset, ref.nbytes, ref.path) if stream else read_payload(fd, ref))
            yield out
        finally:
            for path in held:
                self._release(path)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._maps.values():
                os.close(fd)
            self._maps.clear()


def load_delta(index: VersionIndex) -> LoadedDelta:
    """Check the shards the index names (never a listing) without decompressing; keep each
    payload's place and structure, and close every shard again."""
    # A checksum whose package is missing must fail here, before the marker is cleared.
    require_checksum(index.checksum_format or "")
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
        fd = _open_shard(path)
        try:
            st = os.fstat(fd)
            if st.st_size < hdr.file_nbytes:
                raise ShardShrunkError(path, hdr.file_nbytes, st.st_size)
            if st.st_size != hdr.file_nbytes:
                raise SourceNotReadyError(f"shard {path} changed since its header was read; retry the pull")
            file_id = (st.st_dev, st.st_ino, st.st_size)
            for name, entry in hdr.tensors.items():
                if entry.dtype != "U8" or len(entry.shape) != 1:
                    raise MalformedHeaderError(path, f"delta tensor {name!r} must be 1-D U8, got {entry.dtype} {list(entry.shape)}")
                want = hdr.metadata.get(name)
                if not is_well_formed_digest(index.checksum_format or "", want):
                    raise MalformedHeaderError(
                        path, f"__metadata__ has no well-formed {index.checksum_format} digest for {name!r} (got {want!r})"
                    )
                # A frame-only check (xor, overwrite) walks the file range: no copy of a payload
                # that may be as large as its tensor; other codecs parse a copy.
                payload = (RangeStream(fd, entry.offset, entry.nbytes, path) if getattr(codec, "structure_from_frame", False)
                           else memoryview(read_range(fd, entry.offset, entry.nbytes, path)))
                try:
                    structure = codec.check_structure(payload, name)
                except PayloadBoundError as e:
                    e.args = (f"v{index.version}: {e.args[0]}",)
                    raise
                finally:
                    if isinstance(payload, memoryview):
                        try:
                            payload.release()
                        except BufferError:
                            pass
                ref = PayloadRef(path, entry.offset, entry.nbytes, file_id)
                tensors[name] = DeltaTensor(name, ref, cast(str, want), structure)  # well-formed: a str
                nbytes += entry.nbytes
        finally:
            os.close(fd)
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
                codec.check_fit(t.structure, entry.nbytes, DTYPE_NBYTES[entry.dtype], name)
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
    steps: list[tuple[str, DeltaTensor]]  # (encoding, payload), oldest first
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
            job.steps.append((d.index.delta_encoding or "", t))
            job.digest, job.checksum_format, job.version = t.digest, d.index.checksum_format or "", d.index.version
    return sorted(jobs.values(), key=lambda j: -j.entry.nbytes)


def _passes(steps: list, per_pass: int) -> list[list]:
    return [steps[i : i + per_pass] for i in range(0, len(steps), per_pass)]


def _apply_steps(
    region: np.ndarray, job: _Job, chunk_nbytes: int, shards: _ShardMaps, hasher, seg_range: tuple[int, int] | None = None
) -> bool:
    """Apply the job's payloads a pass at a time (as many as a worker may hold mapped); True
    when the last pass fed ``hasher`` (xor and the segment-major codecs hash as they go)."""
    itemsize = DTYPE_NBYTES[job.entry.dtype]
    passes = _passes(job.steps, shards.per_pass)
    hashed = False
    for k, group in enumerate(passes):
        h = hasher if k == len(passes) - 1 else None
        encodings = {enc for enc, _ in group}
        chain = _chain_codec(encodings)
        stream = encodings == {"xor"} and seg_range is None
        with shards.payloads([t.ref for _, t in group], stream=stream) as payloads:
            if chain is not None:
                # segment-major: every payload's changes to a segment, then hash it while cached
                structures = [t.structure for _, t in group]
                chain.apply_chain(region, payloads, structures, job.name, chunk_nbytes, h, seg_range=seg_range)
                hashed = h is not None
            elif encodings == {"xor"} and seg_range is None:
                apply_xor_chain(region, payloads, job.name, chunk_nbytes, h)
                hashed = h is not None
            else:
                # a mixed pass: each payload whole, in order, each against the previous one's bytes
                for (enc, t), payload in zip(group, payloads):
                    get_codec(enc).apply(region, payload, itemsize, job.name, chunk_nbytes, structure=t.structure)
    return hashed


def _chain_codec(encodings: set[str]) -> ChainCodec | None:
    """The codec of a single-encoding chain that applies segment-major, else None."""
    if len(encodings) != 1:
        return None
    codec = get_codec(next(iter(encodings)))
    return codec if isinstance(codec, ChainCodec) else None


def _region(maps: _Maps, job: _Job) -> np.ndarray:
    return np.ndarray((job.entry.nbytes,), dtype=np.uint8, buffer=maps.get(job.path), offset=job.entry.offset)


def _run_job(job: _Job, maps: _Maps, chunk_nbytes: int, shards: _ShardMaps) -> tuple[str, str, str] | None:
    region = _region(maps, job)
    try:
        hasher = tensor_hasher(job.checksum_format)
        if not _apply_steps(region, job, chunk_nbytes, shards, hasher):
            _hash_in_chunks(hasher, region, chunk_nbytes)
        actual = hasher.hexdigest()
    finally:
        del region
    return None if actual == job.digest else (job.name, job.digest, actual)


# A tensor of a segment-major encoding (sparse-v1, sparse-v2) larger than this and than its
# fair share of the work is cut into runs of segments applied by several workers (one large
# embedding would otherwise keep one worker busy while the rest idle), then hashed in one pass.
SPLIT_MIN_NBYTES = 64 << 20


def _split_plan(jobs: list[_Job], workers: int) -> dict[str, list[tuple[int, int]]]:
    """name -> segment ranges, for the tensors worth splitting across workers."""
    if workers <= 1:
        return {}
    total = sum(j.entry.nbytes for j in jobs)
    limit = max(SPLIT_MIN_NBYTES, total // (2 * workers))
    plan: dict[str, list[tuple[int, int]]] = {}
    for job in jobs:
        chain = _chain_codec({enc for enc, _ in job.steps})
        if job.entry.nbytes <= limit or chain is None:
            continue
        nseg = chain.chain_segment_count([t.structure for _, t in job.steps])
        if not nseg or nseg < 2:
            continue
        parts = min(nseg, workers, -(-job.entry.nbytes // (limit // 2)))
        bounds = [nseg * i // parts for i in range(parts + 1)]
        plan[job.name] = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    return plan


def _apply_part(job: _Job, maps: _Maps, chunk_nbytes: int, shards: _ShardMaps, seg_range: tuple[int, int]) -> None:
    region = _region(maps, job)
    try:
        _apply_steps(region, job, chunk_nbytes, shards, None, seg_range=seg_range)
    finally:
        del region


def _verify_job(job: _Job, maps: _Maps, chunk_nbytes: int) -> tuple[str, str, str] | None:
    region = _region(maps, job)
    try:
        hasher = tensor_hasher(job.checksum_format)
        _hash_in_chunks(hasher, region, chunk_nbytes)
        actual = hasher.hexdigest()
    finally:
        del region
    return None if actual == job.digest else (job.name, job.digest, actual)


def _run_jobs(
    pool: ThreadPoolExecutor, jobs: list[_Job], maps: _Maps, chunk_nbytes: int, workers: int, shards: _ShardMaps, progress
) -> list:
    """Every job applied and verified; large segment-major tensors in parts, hashed afterwards."""
    plan = _split_plan(jobs, workers)
    units: list[tuple[_Job, tuple[int, int] | None]] = [(j, r) for j in jobs if j.name in plan for r in plan[j.name]]
    units += [(j, None) for j in jobs if j.name not in plan]
    done = 0
    results = []

    def run_unit(unit):
        job, seg_range = unit
        if seg_range is None:
            return _run_job(job, maps, chunk_nbytes, shards)
        _apply_part(job, maps, chunk_nbytes, shards, seg_range)
        return _PART_DONE

    bar = progress_report.stage("apply", sum(j.entry.nbytes for j in jobs))  # the tensor bytes brought to the version
    for (job, _), r in zip(units, pool.map(run_unit, units)):
        if r is _PART_DONE:
            continue
        results.append(r)
        done += 1
        bar.advance(job.entry.nbytes)
        if progress is not None:
            progress(done, len(jobs))
    split = [j for j in jobs if j.name in plan]
    for job, r in zip(split, pool.map(lambda j: _verify_job(j, maps, chunk_nbytes), split)):
        results.append(r)
        done += 1
        bar.advance(job.entry.nbytes)
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
    verify_each_version: bool,
    flush: bool = True,
    progress: "Callable[[int, int], None] | None" = None,
    payloads_per_pass: int | None = None,
) -> list[str]:
    """Apply the loaded deltas in place and verify; the caller has cleared the marker.

    Folded (the default): each tensor verified once, against its newest digest; a mismatch
    raises ``VerifyFailed``. ``verify_each_version``: every version applied and verified in
    turn, a mismatch raises ``ChecksumMismatchError`` naming the version (the diagnostic).

    Returns the local files written. With ``flush=False`` their pages are left for the caller
    to fsync (deferred durability): the marker must not be written before that.
    """
    shards = _ShardMaps(max(1, int(payloads_per_pass or knobs.PAYLOADS_PER_PASS.get())), workers)
    maps = _Maps()
    try:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="weightsync-apply")
        try:
            groups = [[d] for d in deltas] if verify_each_version else [deltas]
            for group in groups:
                jobs = _jobs(group, table)
                results = _run_jobs(pool, jobs, maps, chunk_nbytes, workers, shards, progress)
                bad = [r for r in results if r is not None]
                if bad:
                    last = group[-1].index
                    if verify_each_version:
                        raise ChecksumMismatchError(last.version, bad, last.checksum_format or "")
                    versions = {j.name: j.version for j in jobs}
                    raise VerifyFailed(bad, max(versions[n] for n, _, _ in bad), last.checksum_format or "")
        except BaseException:
            # Interrupted (Ctrl-C) or failed: the tensors not started yet are not applied (the
            # marker is cleared, so nothing trusts a partial apply), and the running ones are
            # waited for before the maps they write through are closed below.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        if flush:
            maps.flush()
        return maps.paths()
    except BaseException as e:
        # An ndarray over an mmap holds no buffer export, so the close below unmaps regions that
        # the frames of this traceback still hold: whoever shows their locals (an error
        # reporter, a test runner) would read unmapped memory. Drop those locals first.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        shards.close()
        maps.close()


def fsync_files(paths: list[str]) -> None:
    """Write back pages dirtied through (closed) mmaps: fsync covers them on Linux."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
