"""What a live update changes on one rank, computed from the verified local checkpoint alone.

This is the heavy half of live apply's staging, and it needs no engine: the changed element
positions of each checkpoint tensor (decoded from the delta payloads by
``weightsync.puller.positions``, never by diffing tensors), mapped through the rank's proven
placements to parameter positions, and the new values read at those positions from the local
checkpoint, still in the checkpoint's dtype. It runs in the rank's pull helper process
(``pull.process``), which has its own interpreter and CPUs: in the scheduler process every
numpy call would have to win the GIL back from sglang's busy-polling loop (about 5 ms each,
thousands of calls). The scheduler then only casts the values and saves the old ones
(``live.scatter.patch.finish_staging``), a few large torch calls per parameter.

No torch and no sglang here (the helper imports only the core and numpy).

Results travel as one anonymous shared-memory file (``memfd``) passed over the helper's socket:
per patch an int64 index array and a values array, at 64-byte aligned offsets that the reply
(``StageReply.patches``) names. Its size is ``(8 + checkpoint itemsize)`` bytes per changed
element of this rank's shard, refused past ``max_elements`` (the live-apply threshold). The
scheduler side lends the file of an earlier staging back once nothing there maps it any more
(``SpareFile``), and the helper keeps its maps of the local checkpoint (``KeptMaps``): both
save faulting in fresh pages, the largest cost of staging on this VM after decoding.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from typing import Callable, Iterable, NamedTuple, Optional

import msgspec
import numpy as np

from weightsync.format.safetensors_io import DTYPE_NBYTES

# numpy cannot hold bf16: checkpoint values travel as same-width integers.
CARRIER = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALIGN = 64


class Placement(NamedTuple):
    """One recorded copy: a box of checkpoint tensor ``tensor`` -> the same box of ``param``.

    Element ``i`` (a multi-index over ``sizes``) of the box is checkpoint element
    ``src_offset + i . src_strides`` and parameter element ``dst_offset + i . dst_strides``
    (flat, row-major, of the contiguous parameter).
    """

    tensor: str
    param: str
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]


class StageJob(msgspec.Struct, frozen=True, tag="stage"):
    """Stage ``from_version -> to_version`` of ``source_dir`` out of ``local_checkpoint_dir``."""

    local_checkpoint_dir: str
    source_dir: str
    from_version: int
    to_version: int
    max_elements: int
    placements: dict[str, list[Placement]]  # the rank's proven map: checkpoint tensor -> boxes
    unused: list[str]  # tensors the loader ignores on this rank (a reload would too)
    reload_only: dict[str, str]  # tensor -> why a change to it cannot be patched live
    memfd_follows: bool = False  # a spare shared file to write into follows the frame (``SpareFile``)


class PatchRef(msgspec.Struct, frozen=True):
    """Where one patch lies in the shared file: ``count`` positions of ``param``, values in ``dtype``."""

    param: str
    dtype: str  # the checkpoint tensor's safetensors dtype (the scheduler casts)
    count: int
    index_offset: int
    values_offset: int


class StagePositions(msgspec.Struct, frozen=True, tag="positions"):
    """The helper's first answer when there are patches: every patch's positions are in the
    shared file that follows, their values not yet (``StageReply`` says when they are). The
    scheduler saves its undo log from the positions meanwhile (``live.scatter.patch.undo_log_steps``)."""

    patches: list[PatchRef]
    shared_nbytes: int


class StageReply(msgspec.Struct, frozen=True, tag="staged"):
    """The helper's answer: patches in the shared file that follows, or why not (``refused``)."""

    refused: Optional[str] = None
    error: Optional[str] = None  # staging itself failed (a bug, a malformed payload): logged
    patches: list[PatchRef] = []
    shared_nbytes: int = 0  # the size of the shared file that follows when there are patches
    elements: int = 0
    tensors: int = 0
    nbytes: int = 0
    stage_s: float = 0.0


class StagingRefused(Exception):
    """This update cannot be patched live; ``reason`` says why (the call reloads instead)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Patch(NamedTuple):
    param: str
    dtype: str
    index: np.ndarray  # int64 flat positions in the contiguous parameter
    values: np.ndarray  # the checkpoint's values there, as the same-width integer carrier


def positions_through(p: Placement, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(checkpoint positions, parameter positions)`` of the sorted ``positions`` inside ``p``'s box."""
    chosen, dst = _through(p, positions)
    return chosen, _parameter_positions(chosen, dst)


class RunShifts(NamedTuple):
    """Parameter positions as one shift per run of checkpoint positions: the first ``counts[0]``
    positions move by ``shifts[0]``, the next ``counts[1]`` by ``shifts[1]``, and so on."""

    shifts: np.ndarray  # int64, one per run of the box
    counts: np.ndarray  # int64, the chosen positions in each run

    def added_to(self, chosen: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return np.add(chosen, np.repeat(self.shifts, self.counts), out=out)


def _parameter_positions(chosen: np.ndarray, dst: "np.ndarray | int | RunShifts") -> np.ndarray:
    if isinstance(dst, RunShifts):
        return dst.added_to(chosen)
    return chosen + dst if isinstance(dst, int) else dst


MAX_RUNS = 1 << 20  # past it a box's rows are too many and too short for the run path to pay


def _through(p: Placement, positions: np.ndarray) -> tuple[np.ndarray, "np.ndarray | int | RunShifts"]:
    """``positions_through``, with the parameter positions left as shifts where the box is made
    of contiguous runs: a 5% change is tens of millions of positions, and materializing the
    shifted copy here only for it to be copied again into the shared file costs a pass and
    fresh pages."""
    lo = p.src_offset
    hi = lo + sum((n - 1) * s for n, s in zip(p.sizes, p.src_strides))
    a, b = np.searchsorted(positions, [lo, hi + 1])
    if a == b:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    chosen = positions[a:b]
    order = sorted((d for d in range(len(p.sizes)) if p.sizes[d] != 1), key=lambda d: -p.src_strides[d])
    if _is_run(p.sizes, p.src_strides, order) and _is_run(p.sizes, p.dst_strides, order):
        # both boxes are one contiguous run (TP row slices, fused rows): a shift, no division
        return chosen, p.dst_offset - lo
    runs = _runs(p, order)
    if runs is not None:
        return _through_runs(chosen, *runs)
    rest = chosen - lo
    ok = np.ones(rest.size, dtype=bool)
    dst = np.full(rest.size, p.dst_offset, dtype=np.int64)
    for d in order:
        i = rest // p.src_strides[d]
        ok &= i < p.sizes[d]
        rest = rest - i * p.src_strides[d]
        dst += i * p.dst_strides[d]
    ok &= rest == 0
    return chosen[ok], dst[ok]


def _runs(p: Placement, order: list[int]) -> Optional[tuple[np.ndarray, np.ndarray, int]]:
    """``(run starts in the checkpoint tensor, run starts in the parameter, run length)`` when
    ``p``'s box is rows contiguous in both (a row-parallel TP slice: each rank's columns of
    every row), ascending and apart; None when it is not (the general path decides then)."""
    inner = order[-1]  # not empty: a box without dims of size > 1 is one run
    length = p.sizes[inner]
    if p.src_strides[inner] != 1 or p.dst_strides[inner] != 1 or length < 2:
        return None
    outer = order[:-1]
    count = 1
    for d in outer:
        count *= p.sizes[d]
        if p.src_strides[d] <= 0 or count > MAX_RUNS:
            return None
    src = np.full(1, p.src_offset, dtype=np.int64)
    dst = np.full(1, p.dst_offset, dtype=np.int64)
    for d in outer:  # row-major over the outer dims, the largest source stride first
        step = np.arange(p.sizes[d], dtype=np.int64)
        src = (src[:, None] + step * p.src_strides[d]).reshape(-1)
        dst = (dst[:, None] + step * p.dst_strides[d]).reshape(-1)
    if src.size > 1 and not bool(np.all(src[1:] >= src[:-1] + length)):
        return None  # runs that overlap or go backwards: not a plain row slice
    return src, dst, length


def _through_runs(chosen: np.ndarray, src: np.ndarray, dst: np.ndarray, length: int) -> tuple[np.ndarray, RunShifts]:
    """The sorted ``chosen`` positions inside the runs ``[src, src + length)``, each run's shift."""
    first = np.searchsorted(chosen, src)
    end = np.searchsorted(chosen, src + length)
    counts = end - first
    total = int(counts.sum())
    if total == chosen.size:
        inside = chosen
    else:
        # +1 where a run's positions begin, -1 where they end: the running sum is 1 inside runs
        edges = np.zeros(chosen.size + 1, dtype=np.int8)
        np.add.at(edges, first, 1)
        np.add.at(edges, end, -1)
        inside = chosen[np.cumsum(edges[:-1], dtype=np.int8).view(bool)]
    return inside, RunShifts(dst - src, counts)


def source_windows(placements: dict[str, list[Placement]]) -> dict[str, tuple[int, int]]:
    """Per checkpoint tensor, the first and last of its elements any of this rank's boxes reads."""
    out = {}
    for name, boxes in placements.items():
        if boxes:
            out[name] = (min(p.src_offset for p in boxes),
                         max(p.src_offset + sum((n - 1) * s for n, s in zip(p.sizes, p.src_strides)) for p in boxes))
    return out


def _is_run(sizes: tuple[int, ...], strides: tuple[int, ...], order: list[int]) -> bool:
    """Whether a box with ``strides`` (dims in ``order``, outermost first) is one contiguous run."""
    step = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != step:
            return False
        step *= sizes[d]
    return True


class PlannedPatch(NamedTuple):
    """One parameter's changed positions, before any value is read: ``parts`` of
    ``(checkpoint tensor, checkpoint positions, parameter positions)``, the parameter positions
    an array, one shift (``int``) to add to the checkpoint positions, or one shift per run."""

    param: str
    dtype: str
    parts: list[tuple[str, np.ndarray, "np.ndarray | int | RunShifts"]]

    @property
    def count(self) -> int:
        return sum(int(hf.size) for _, hf, _ in self.parts)

    def fill(self, index: np.ndarray, values: np.ndarray, into: "ValuesInto") -> None:
        """Write the parameter positions into ``index`` and, through ``into``, the new values
        into ``values`` (both ``count`` long: arrays here, or views of the shared file)."""
        self.fill_index(index)
        self.fill_values(values, into)

    def fill_index(self, index: np.ndarray) -> None:
        at = 0
        for _, hf, dst in self.parts:
            if isinstance(dst, int):
                np.add(hf, dst, out=index[at : at + hf.size])
            elif isinstance(dst, RunShifts):
                dst.added_to(hf, out=index[at : at + hf.size])
            else:
                index[at : at + hf.size] = dst
            at += int(hf.size)

    def fill_values(self, values: np.ndarray, into: "ValuesInto") -> None:
        at = 0
        for name, hf, _ in self.parts:
            into(name, hf, values[at : at + hf.size])
            at += int(hf.size)


# ``into(tensor, checkpoint positions, out)``: the new values there, as the integer carrier
ValuesInto = Callable[[str, np.ndarray, np.ndarray], None]


def carrier_of(dtype: str) -> type:
    return CARRIER[DTYPE_NBYTES[dtype]]


def plan_changes(
    placements: dict[str, list[Placement]],
    unused: Iterable[str],
    reload_only: dict[str, str],
    changes: Iterable[tuple[str, str, np.ndarray]],
    *,
    max_elements: int,
) -> tuple[list[PlannedPatch], int, int]:
    """``(planned patches, elements, tensors)`` for ``changes`` (``(tensor, dtype, sorted positions)``).

    Raises:
        StagingRefused: a changed tensor is reload-only or unmapped, or the changed elements
            pass ``max_elements``.
    """
    unused = set(unused)
    planned: dict[tuple[str, str], PlannedPatch] = {}
    elements = tensors = 0
    for name, dtype, positions in changes:
        if name in unused:
            continue
        why = reload_only.get(name)
        if why is not None:
            raise StagingRefused(why)
        boxes = placements.get(name)
        if not boxes:
            raise StagingRefused(f"checkpoint tensor {name} changed but the map has no placement for it")
        tensors += 1
        for p in boxes:
            hf_pos, dst_pos = _through(p, positions)
            if not hf_pos.size:
                continue
            elements += int(hf_pos.size)
            if elements > max_elements:
                raise StagingRefused(
                    f"more than {max_elements} changed elements on this rank (the live-apply threshold); "
                    "a reload is as cheap"
                )
            key = (p.param, dtype)
            if key not in planned:
                planned[key] = PlannedPatch(p.param, dtype, [])
            planned[key].parts.append((name, hf_pos, dst_pos))
    return list(planned.values()), elements, tensors


def stage_changes(
    placements: dict[str, list[Placement]],
    unused: Iterable[str],
    reload_only: dict[str, str],
    changes: Iterable[tuple[str, str, np.ndarray]],
    values_at: Callable[[str, np.ndarray], np.ndarray],
    *,
    max_elements: int,
) -> tuple[list[Patch], int, int]:
    """``plan_changes``, then each patch's new values read by ``values_at(tensor, checkpoint
    positions)`` (integer carrier), as arrays of this process."""
    planned, elements, tensors = plan_changes(placements, unused, reload_only, changes, max_elements=max_elements)

    def into(name: str, positions: np.ndarray, out: np.ndarray) -> None:
        out[...] = values_at(name, positions).view(out.dtype)

    return materialize(planned, into), elements, tensors


def materialize(planned: list[PlannedPatch], into: ValuesInto) -> list[Patch]:
    """Each planned patch as arrays of this process, its new values read by ``into``."""
    patches = []
    for pp in planned:
        index, values = np.empty(pp.count, dtype=np.int64), np.empty(pp.count, dtype=carrier_of(pp.dtype))
        pp.fill(index, values, into)
        patches.append(Patch(pp.param, pp.dtype, index, values))
    return patches


class _LocalValues:
    """New values at given positions of the local checkpoint's tensors (one map per weight file).

    ``kept``: maps to reuse and leave open (``KeptMaps``); without it each file is mapped here
    and unmapped by ``close``.
    """

    def __init__(self, table: dict, kept: "Optional[KeptMaps]" = None) -> None:
        self.table = table
        self._kept = kept
        self._maps: dict[str, mmap.mmap] = {}

    def dtype_of(self, name: str) -> str:
        return self.table[name][1].dtype

    def into(self, name: str, positions: np.ndarray, out: np.ndarray) -> None:
        np.take(self._flat(name), positions, out=out)

    def _flat(self, name: str) -> np.ndarray:
        path, e = self.table[name]
        mm = self._maps.get(path)
        if mm is None:
            mm = self._maps[path] = self._kept.map_of(path) if self._kept is not None else _map_read_only(path)
        itemsize = DTYPE_NBYTES[e.dtype]
        return np.frombuffer(mm, dtype=CARRIER[itemsize], count=e.nbytes // itemsize, offset=e.offset)

    def close(self) -> None:
        if self._kept is None:
            for mm in self._maps.values():
                mm.close()
        self._maps.clear()


def _map_read_only(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class KeptMaps:
    """Read-only maps of one local checkpoint's weight files, kept open from one staging to the
    next (the helper's): mapping the page-cache pages of a rank's shard, page by page as the
    values are gathered, cost 0.2-0.3 s of a 5% staging at TP=2 here, and unmapping them 0.07 s.

    Sound because the pull writes the local files in place (``weightsync.puller.apply``: through maps of
    the same files), so a kept map sees exactly the bytes the pull verified; a file that is
    another file now (a new inode, or another size: a reseed, an operator's copy) is mapped
    again. Resources: one map (and its descriptor) per weight file of the last dir staged from,
    and none of a file that is gone: a reseed from a full version or an anchor replaces or deletes
    the old layout's files, and a map would keep a deleted file's blocks allocated for the
    helper's life (a full checkpoint of disk on a real model), so ``drop_stale`` runs at every
    staging and after every pull.
    """

    def __init__(self) -> None:
        self._dir: Optional[str] = None
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}

    def begin(self, local_dir: str) -> "KeptMaps":
        """Keep the maps of ``local_dir`` only (a staging from another dir drops the others)."""
        if local_dir != self._dir:
            self.close()
            self._dir = local_dir
        self.drop_stale()
        return self

    def drop_stale(self) -> list[str]:
        """Unmap each kept file that is no longer the file at its path (deleted, or another inode
        or size there now); returns their paths."""
        dropped = []
        for path, (identity, mm) in list(self._maps.items()):
            try:
                st = os.stat(path)
                current: Optional[tuple[int, int, int]] = (st.st_dev, st.st_ino, st.st_size)
            except OSError:
                current = None
            if current != identity:
                mm.close()
                del self._maps[path]
                dropped.append(path)
        return dropped

    def map_of(self, path: str) -> mmap.mmap:
        st = os.stat(path)
        identity = (st.st_dev, st.st_ino, st.st_size)
        kept = self._maps.get(path)
        if kept is not None and kept[0] == identity:
            return kept[1]
        if kept is not None:
            kept[1].close()
        mm = _map_read_only(path)
        self._maps[path] = (identity, mm)
        return mm

    def close(self) -> None:
        for _, mm in self._maps.values():
            mm.close()
        self._maps.clear()
        self._dir = None


KEPT_MAPS = KeptMaps()  # the helper process's (stage_job_shared)


class _Plan(NamedTuple):
    planned: list[PlannedPatch]
    elements: int
    tensors: int


def _plan_job(job: StageJob) -> _Plan:
    """The positions ``job`` changes on this rank (no value read yet).

    Raises:
        StagingRefused, PositionsUnavailableError: it cannot be patched live.
    """
    import weightsync.puller.positions as positions

    chain, indexes = positions.plan_change_chain(job.source_dir, job.from_version, job.to_version)
    if not chain.is_deltas_only:
        raise StagingRefused(f"v{chain.full_version} in the chain v{job.from_version} -> v{job.to_version} is a full version")
    changes = (
        (name, entry.dtype, pos)
        for name, entry, pos in positions.iter_changed_elements(
            job.local_checkpoint_dir, job.source_dir, chain, indexes, skip=frozenset(job.unused),
            windows=source_windows(job.placements),
        )
    )
    return _Plan(*plan_changes(job.placements, job.unused, job.reload_only, changes, max_elements=job.max_elements))


def _local_values(job: StageJob, kept: Optional[KeptMaps] = None) -> _LocalValues:
    from weightsync.format.manifest import checkpoint_weight_files
    from weightsync.format.safetensors_io import local_tensor_table

    local = job.local_checkpoint_dir
    return _LocalValues(local_tensor_table(local, checkpoint_weight_files(local)),
                        kept.begin(local) if kept is not None else None)


def _refusal(exc: Exception, start: float) -> StageReply:
    reason = exc.reason if isinstance(exc, StagingRefused) else str(exc)
    return StageReply(refused=reason, stage_s=time.perf_counter() - start)


def stage_job(job: StageJob, positions_ready: Optional[Callable[[list[Patch]], None]] = None) -> tuple[StageReply, list[Patch]]:
    """Everything ``job`` changes on this rank, as arrays of this process, or the reason it
    cannot be patched live (the scheduler's own path when it has no helper; tests). A stager:
    ``positions_ready`` is never called (the values come with the positions)."""
    from weightsync.errors import PositionsUnavailableError

    start = time.perf_counter()
    try:
        plan = _plan_job(job)
        values = _local_values(job)
        try:
            patches = materialize(plan.planned, values.into)
        finally:
            values.close()
    except (StagingRefused, PositionsUnavailableError) as exc:  # e.g. sparse-v2 with several magnitude classes
        return _refusal(exc, start), []
    nbytes = sum(p.index.nbytes + p.values.nbytes for p in patches)
    return StageReply(elements=plan.elements, tensors=plan.tensors, nbytes=nbytes, stage_s=time.perf_counter() - start), patches


def stage_job_shared(
    job: StageJob, into_fd: Optional[int] = None, *, kept_maps: Optional[KeptMaps] = None,
    positions_written: Optional[Callable[[StagePositions, int], None]] = None,
) -> tuple[StageReply, Optional[int]]:
    """``stage_job`` written straight into an anonymous shared-memory file: ``(reply, memfd)``,
    the memfd (the caller closes it) only when there are patches; ``reply.patches`` locates them.

    ``into_fd``: a spare file of an earlier staging to write into instead of a new one (handed
    over: it is the returned file, or closed here when there is none; it may be larger than this
    staging needs, and only ``reply.shared_nbytes`` of it are mapped). Its pages are already
    allocated: fresh shared pages fault in at about 1 GB/s on this VM, 0.18 s for the 160 MB
    of a 5% change at TP=2, against 0.06 s to map pages the file already has. ``kept_maps``: the
    local checkpoint's maps to reuse and keep (``KeptMaps``; the helper passes ``KEPT_MAPS``).
    ``positions_written(positions, fd)``: called once every patch's positions are in the file,
    before any value is read (the helper sends them, so the scheduler's undo log overlaps the
    values' gather); the file stays open here until this returns the reply.

    The positions are planned first, so the file is sized once and every index and value is
    written into it where the scheduler will read it: no array of the whole result is built in
    this process and copied afterwards (that copy cost 0.47 s of 1.9 s for 32M elements).
    Memory here: at most 16 bytes per changed element for the plan (8 where a box is a contiguous
    run), besides the file.
    """
    from weightsync.errors import PositionsUnavailableError
    start = time.perf_counter()
    try:
        plan = _plan_job(job)
    except (StagingRefused, PositionsUnavailableError) as exc:
        _close(into_fd)
        return _refusal(exc, start), None
    except BaseException:
        _close(into_fd)
        raise
    if not plan.planned:
        _close(into_fd)
        return StageReply(elements=plan.elements, tensors=plan.tensors, stage_s=time.perf_counter() - start), None
    refs, size = layout([(pp.param, pp.dtype, pp.count) for pp in plan.planned])
    fd = into_fd if into_fd is not None else os.memfd_create("weightsync-live-stage", os.MFD_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            # a spare file is never shrunk: it keeps the pages of the largest staging so far
            # (within the bound of one staging), so a 5% change after a 1% one still finds them
            os.ftruncate(fd, size)
        values = _local_values(job, kept_maps)
        try:
            with mmap.mmap(fd, size) as mm:
                _fault_in(mm)
                _write_patches(mm, plan.planned, refs, values.into,
                               None if positions_written is None else lambda: positions_written(StagePositions(refs, size), fd))
        finally:
            values.close()
    except BaseException:
        os.close(fd)
        raise
    nbytes = sum(r.count * (8 + DTYPE_NBYTES[r.dtype]) for r in refs)
    reply = StageReply(patches=refs, shared_nbytes=size, elements=plan.elements, tensors=plan.tensors, nbytes=nbytes,
                       stage_s=time.perf_counter() - start)
    return reply, fd


def _write_patches(mm: mmap.mmap, planned: list[PlannedPatch], refs: list[PatchRef], into: ValuesInto,
                   positions_written: Optional[Callable[[], None]]) -> None:
    """Every patch's positions, then (after ``positions_written()``) every patch's values, into
    the shared file's map ``mm`` (no view of it outlives this call, so the map can close)."""
    buf = np.frombuffer(mm, dtype=np.uint8)
    views = [_views(buf, r) for r in refs]
    for pp, (index, _) in zip(planned, views):
        pp.fill_index(index)
    if positions_written is not None:
        positions_written()
    for pp, (_, values) in zip(planned, views):
        pp.fill_values(values, into)


MADV_POPULATE_WRITE = 23  # Linux 5.14 (Python's mmap module does not name it)


def _fault_in(mm: mmap.mmap) -> None:
    """Fault every page of ``mm`` in with one call: 0.14-0.18 s for 160 MB of fresh pages here,
    against 0.24 s page by page as they are written; older kernels fault them as they are written."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        pass


def _close(fd: Optional[int]) -> None:
    if fd is not None:
        os.close(fd)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(patches: list[tuple[str, str, int]]) -> tuple[list[PatchRef], int]:
    """Each patch's offsets in the shared file (``(param, dtype, count)`` each), and the file's size."""
    refs, at = [], 0
    for param, dtype, count in patches:
        index_at = at
        at = _aligned(at + 8 * count)
        values_at = at
        at = _aligned(at + count * DTYPE_NBYTES[dtype])
        refs.append(PatchRef(param, dtype, count, index_at, values_at))
    return refs, at


def _views(buf: np.ndarray, ref: PatchRef) -> tuple[np.ndarray, np.ndarray]:
    """``(index, values)`` of one patch in the shared file's bytes ``buf``."""
    carrier = carrier_of(ref.dtype)
    index = buf[ref.index_offset : ref.index_offset + 8 * ref.count].view(np.int64)
    values = buf[ref.values_offset : ref.values_offset + ref.count * np.dtype(carrier).itemsize].view(carrier)
    return index, values


def read_shared(fd: int, refs: list[PatchRef], size: int, *, unmapped: Optional[Callable[[], None]] = None) -> list[Patch]:
    """The patches of a shared file (read-only views of one map that lives as long as they do).

    ``unmapped``: called once the last view is gone and the map with it (at once when there are
    no patches), from whichever thread dropped it: only then may anything rewrite the file.
    """
    if not refs:
        if unmapped is not None:
            unmapped()
        return []
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    if unmapped is not None:
        weakref.finalize(mm, unmapped)
    buf = np.frombuffer(mm, dtype=np.uint8)
    return [Patch(r.param, r.dtype, *_views(buf, r)) for r in refs]


class SpareFile:
    """At most one shared file of an earlier staging, kept for the next one to write into (see
    ``stage_job_shared``): the scheduler side of a rank owns it, lends it with each staging job.

    Invariant: a file is spare only while nothing can read or write it. ``keep_when_unmapped``
    makes a file spare from the finalizer of its last map in this process (``read_shared``), so
    no staged update, undo log or scatter still reads it; ``take`` hands it over for good, so a
    helper that fails or is killed while it writes never gives it back to anyone. Memory: the
    spare's pages, those of the largest staging so far (bounded as one staging is: ``max_elements``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._closed = False

    def take(self) -> Optional[int]:
        with self._lock:
            fd, self._fd = self._fd, None
        return fd

    def keep_when_unmapped(self, fd: int, only_if: Callable[[], bool] = lambda: True) -> Callable[[], None]:
        """A callback for ``read_shared(unmapped=...)`` that makes ``fd`` (owned from now) spare,
        or closes it unless ``only_if()`` (its helper finished writing it) by then."""
        return lambda: self._keep(fd) if only_if() else _close(fd)

    def _keep(self, fd: int) -> None:
        with self._lock:
            if self._closed:
                other: Optional[int] = fd
            else:
                self._fd, other = self._larger(fd, self._fd)
        _close(other)

    @staticmethod
    def _larger(a: int, b: Optional[int]) -> tuple[int, Optional[int]]:
        if b is None:
            return a, None
        return (a, b) if os.fstat(a).st_size >= os.fstat(b).st_size else (b, a)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        _close(self.take())
