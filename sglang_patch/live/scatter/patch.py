"""Finish a live update's staging while serving, scatter it during the pause, undo it exactly.

Staging has two halves. The heavy one (``live.mapping.stage``: positions, mapping, new values read from
the verified local checkpoint) runs in the rank's pull helper process. This module does the
engine-side half, in the scheduler process but still while serving (``finish_staging_steps``):
cast the new values to each parameter's dtype (what the loader's ``copy_`` does), read the
*old* values at the same positions from the live parameters, which is the undo log, and make
everything the pause and a restore use: on a device the index and the values copied there, and
the restore's scratch. It runs on the scheduler thread itself, in bounded steps between loop
iterations (``loop_slices``). The pause and the restore then allocate nothing, on any device:
an out-of-memory error cannot hit them (``tests/unit/test_live_pause_allocations.py``).

Memory bound, per rank: ``8 + 2 x itemsize`` bytes of host memory per changed element of this
rank's shard (the index, the new values, the old values), plus the checkpoint-dtype values while
the cast runs; staging is refused (the call reloads) once the changed elements pass
``max_elements``. For parameters on a device, ``8 + itemsize`` bytes more per changed element
on that device (the index and the values, copied there at staging) and the restore's scratch
(``RestoreBuffers``: the largest patch's elements once on the device and once on the host).
No host memory is pinned: the pause reads none (its index and values are on the device
already), staging copies in bounded steps while serving, and a restore is the rare path. So
there is nothing for torch's caching host allocator to keep at its high-water mark; everything
is freed with the staged update (``live.state._release_later``).

The pause (``scatter_with_undo``) is then only the writes into each parameter's own storage
(pointers unchanged, so captured CUDA graphs stay valid): ``index_copy_`` on a device, ordered
with sglang's forward stream by events (``live.scatter.device.PauseFence``); on the CPU one
compiled loop that writes each element and reads it back a few entries later (``host_scatter``),
or, where it was not built, numpy's fancy assignment over integer views for sparse patches and
``index_copy_`` for dense ones, with one intra-op thread (a multi-threaded ``index_copy_`` of
bf16 over scattered positions is many times slower here, and the TP ranks already run side by
side), each chunk read back while it is in cache. Every written element is compared bit for bit
with the staged value (``ReadBack``): a write that did not land fails the scatter. On any failure every patch is written
back from the undo log, in reverse order, so the rank is exactly at the previous version. The
undo log is valid because the live weights cannot change between staging and the pause
without voiding the staging (the weights' generation, checked when the ranks vote).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, NamedTuple, Optional

import numpy as np
import torch

from ..loop_slices import drain
from ..mapping.coordinate_map import INT_OF_WIDTH, TORCH_DTYPE_OF, CheckpointReader, CoordinateMap, as_int_bits
from ..mapping.differ import DifferFlags
from ..mapping.stage import Patch, StagingRefused, positions_through, stage_changes
from . import host_scatter
from .device import HostFence, PauseFence, needs_device_copies

__all__ = ["ParamPatch", "ReadBack", "RestoreBuffers", "RestoreFailed", "RestoreResult", "SavedOld", "StagedUpdate", "StagingRefused", "UndoLog", "finish_staging", "positions_through",
           "scatter_with_undo", "stage_update", "undo_log_steps", "WriteNotLanded"]

SPARSE_WRITE_DENSITY = 0.03  # below it a CPU patch is written through numpy (see ParamPatch.write)
# a host patch is written and read back in chunks of this many elements: read right after its
# write, a chunk's lines are still in cache. Measured on 100M bf16 elements, busy 2-core box: 1%
# written (numpy's write), the read-back and compare add 0.45x of the write in chunks of 16K, 0.8x
# in chunks of 64K, 1.4x after the whole patch; 5% written (index_copy_), 0.9x in chunks of 16K,
# 0.64-0.71x of 64K, 1.35-1.7x of 256K (a chunked index_copy_ also costs more than one call)
READ_BACK_CHUNK = 1 << 14
DENSE_READ_BACK_CHUNK = 1 << 16


class ParamPatch(NamedTuple):
    param: str
    flat: torch.Tensor  # the parameter's own storage, flat (a view: writes go to the live weights)
    index: torch.Tensor  # int64 flat positions in the contiguous parameter, host memory
    values: torch.Tensor  # the new values, the parameter's dtype, host memory
    old: torch.Tensor  # the live values there when staged (the undo log), host memory
    device_index: Optional[torch.Tensor] = None  # ``index`` on the parameter's device, made at staging
    device_values: Optional[torch.Tensor] = None  # ``values`` there (None: written from the host)

    def write(self, source: torch.Tensor, start: int = 0, stop: Optional[int] = None) -> None:
        """``flat[index[start:stop]] = source[start:stop]`` in place; ``source`` on ``flat``'s
        device (the host for a patch without device copies). Never copies or allocates: inside
        the pause, an allocation is an out-of-memory error waiting to happen."""
        if self.device_index is None and host_scatter.compiled() is not None:
            host_scatter.scatter(self.flat, self.index, source, start, stop)
        elif self.writes_through_numpy():
            # numpy's fancy assignment over same-width integer views: the same bytes, measured
            # about 1.5x faster than index_copy_ at 1% density, and slower from about 5%
            as_int_bits(self.flat).numpy()[self.index.numpy()[start:stop]] = as_int_bits(source).numpy()[start:stop]
        elif start == 0 and stop is None:
            self.flat.index_copy_(0, self.on_device_index(), source)
        else:
            self.flat.index_copy_(0, self.on_device_index()[start:stop], source[start:stop])

    def writes_through_numpy(self) -> bool:
        return self.device_index is None and self.index.numel() < SPARSE_WRITE_DENSITY * self.flat.numel()

    def read_back_chunk(self) -> int:
        """Elements written and read back at a time on the host without the compiled loop
        (``READ_BACK_CHUNK``)."""
        return READ_BACK_CHUNK if self.writes_through_numpy() else DENSE_READ_BACK_CHUNK

    def write_new(self, start: int = 0, stop: Optional[int] = None) -> None:
        """The scatter's write of positions ``start:stop``: the new values, from the copies
        staging made on the device."""
        self.write(self.device_values if self.device_values is not None else self.values, start, stop)

    def on_device_index(self) -> torch.Tensor:
        if self.device_index is not None:
            return self.device_index
        if self.flat.device.type != "cpu":
            raise RuntimeError(f"{self.param}: no copy of the positions was staged on {self.flat.device}")
        return self.index


@dataclass
class StagedUpdate:
    """One rank's staged change from ``from_version`` to ``to_version`` of ``source_dir``."""

    from_version: int
    to_version: int
    source_dir: Optional[str]
    local_checkpoint_dir: str
    generation: int  # the live weights' generation it was staged against
    patches: list[ParamPatch] = field(default_factory=list)
    elements: int = 0
    tensors: int = 0
    stage_s: float = 0.0  # both halves
    helper_s: float = 0.0  # the helper's half (0 when it ran in this process)
    engine_s: float = 0.0  # the engine's half: the time inside finish_staging's steps
    engine_where: str = "in this thread"  # which thread ran them (logged)
    keepalive: object = None  # what the patches' memory belongs to (the helper's shared file)
    restore_buffers: "Optional[RestoreBuffers]" = None  # a restore's scratch, made at staging
    fence: Any = None  # orders the pause's writes with the device (live.scatter.device.PauseFence; None: the CPU's)
    from_key: Optional[tuple] = None  # the identity of the live version it was staged from (live.identity)
    target: Any = None  # the live version it makes (a live.identity.LiveVersion)

    @property
    def nbytes(self) -> int:
        """Host memory: the index, the new and the old values."""
        return sum(p.index.nbytes + p.values.nbytes + p.old.nbytes for p in self.patches)

    @property
    def device_nbytes(self) -> int:
        """Device memory: the index and the values copied there, and the restore's scratch."""
        copies = sum(p.device_index.nbytes + p.device_values.nbytes for p in self.patches if p.device_values is not None)
        return copies + (self.restore_buffers.device_nbytes if self.restore_buffers is not None else 0)


def _as_torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    """The checkpoint values (integer carrier) as a tensor of the checkpoint's dtype, zero-copy."""
    torch_dtype = TORCH_DTYPE_OF[dtype]
    width = values.dtype.itemsize
    carrier = torch.from_numpy(values.view(np.uint8 if width == 1 else np.dtype(f"<i{width}")))  # torch lacks wide uints
    return carrier.view(torch_dtype) if torch_dtype != INT_OF_WIDTH[width] else carrier


STEP_ELEMENTS = 1 << 16  # elements per step of finish_staging_steps: well under a millisecond


def finish_staging(patches: Iterable[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate,
                   device_copies: Optional[bool] = None) -> StagedUpdate:
    """Cast each patch's values to its parameter's dtype, save the live values it overwrites, and
    make what the pause and a restore use (``finish_staging_steps``)."""
    with one_intra_op_thread():
        drain(finish_staging_steps(patches, params, staged, device_copies=device_copies))
    return staged


def finish_staging_steps(
    patches: Iterable[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate,
    saved: "Optional[list[SavedOld]]" = None, device_copies: Optional[bool] = None,
) -> Iterator[None]:
    """``finish_staging`` in steps of at most ``STEP_ELEMENTS`` elements, yielding between them.

    The scheduler thread runs these a few at a time between its loop iterations
    (``loop_slices.LoopSlices``). From any other thread of the scheduler process every torch
    call has to win the GIL back from sglang's busy loop: measured 9 ms per call at TP=1, with
    a 0.1 ms switch interval (4.3 s for 6.6M elements; 0.17 s of steps on the loop thread).
    ``staged.engine_s`` counts only the time spent in the steps. ``saved``: the undo log, when
    ``undo_log_steps`` already took it from the same patches (while the helper still wrote their
    values). ``device_copies``: see ``undo_log_steps``.
    """
    patches = list(patches)
    if saved is None:
        saved = yield from undo_log_steps(patches, params, staged, device_copies=device_copies)
    yield from _new_values_steps(patches, saved, staged)
    t0 = time.perf_counter()
    staged.restore_buffers = RestoreBuffers(staged.patches)  # the last allocation a restore would make
    staged.engine_s += time.perf_counter() - t0


class SavedOld(NamedTuple):
    """What one patch needs only its positions for: where it writes, and the undo log."""

    flat: torch.Tensor  # the parameter's own storage, flat
    index: torch.Tensor  # the positions, host memory (the helper's shared file)
    old: torch.Tensor  # the live values there, host memory
    device_index: Optional[torch.Tensor] = None  # the positions on the parameter's device (the
    # pause and a restore inside it must not copy them there: that allocates)


def undo_log_steps(
    patches: list[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate,
    device_copies: Optional[bool] = None,
) -> Generator[None, None, list[SavedOld]]:
    """The first half of ``finish_staging_steps``: save the live values at every patch's
    positions (reads ``patch.index`` only, never ``patch.values``); returns them.

    ``device_copies``: whether the positions (and later the values) get their own copies on the
    parameter's device; None: for parameters off the CPU (``live.scatter.device.needs_device_copies``).
    True on CPU parameters runs the device path on the CPU (a test's way to exercise it here).
    """
    saved = []
    for patch in patches:
        t0 = time.perf_counter()
        flat = params[patch.param].data.view(-1)
        count = int(patch.index.size)
        copies = needs_device_copies(flat) if device_copies is None else device_copies
        with _quiet_readonly():
            index = torch.from_numpy(patch.index)  # the shared file's view, as it is
        device_index = torch.empty(count, dtype=torch.int64, device=flat.device) if copies else None
        old = torch.empty(count, dtype=flat.dtype)  # host memory, not pinned (see the module doc)
        for a in range(0, count, STEP_ELEMENTS):
            b = min(count, a + STEP_ELEMENTS)
            if device_index is None:
                torch.index_select(flat, 0, index[a:b], out=old[a:b])
            else:
                device_index[a:b].copy_(index[a:b])  # synchronous: the source is pageable
                old[a:b].copy_(flat.index_select(0, device_index[a:b]))
            staged.engine_s += time.perf_counter() - t0
            yield
            t0 = time.perf_counter()
        saved.append(SavedOld(flat, index, old, device_index))
        staged.engine_s += time.perf_counter() - t0
    return saved


def _new_values_steps(patches: list[Patch], saved: list[SavedOld], staged: StagedUpdate) -> Iterator[None]:
    """The second half: each patch's new values in its parameter's dtype on the host (the
    checkpoint's bytes as they are when the dtypes agree: no step then) and, for a patch with
    device copies, on the parameter's device; and the patches it makes."""
    for patch, s in zip(patches, saved, strict=True):
        t0 = time.perf_counter()
        count = int(patch.index.size)
        with _quiet_readonly():
            source = _as_torch(patch.values, patch.dtype)
        values = source if source.dtype == s.flat.dtype else torch.empty(count, dtype=s.flat.dtype)
        device_values = None if s.device_index is None else torch.empty(count, dtype=s.flat.dtype, device=s.flat.device)
        if values is not source or device_values is not None:
            for a in range(0, count, STEP_ELEMENTS):
                b = min(count, a + STEP_ELEMENTS)
                if values is not source:
                    values[a:b].copy_(source[a:b])
                if device_values is not None:
                    device_values[a:b].copy_(values[a:b])
                staged.engine_s += time.perf_counter() - t0
                yield
                t0 = time.perf_counter()
        staged.patches.append(ParamPatch(patch.param, s.flat, s.index, values, s.old, s.device_index, device_values))
        staged.engine_s += time.perf_counter() - t0


@contextlib.contextmanager
def _quiet_readonly() -> Iterator[None]:
    # The shared file is mapped read-only and nothing writes through these views.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def stage_update(
    cmap: CoordinateMap,
    params: Mapping[str, torch.Tensor],
    changes: Iterable[tuple[str, object, np.ndarray]],
    new_checkpoint: CheckpointReader,
    *,
    max_elements: int,
    staged: StagedUpdate,
    device_copies: Optional[bool] = None,
) -> StagedUpdate:
    """Both halves of staging in this process, for ``changes`` (``(tensor, entry, positions)``).

    What the helper process does with ``live.mapping.stage.stage_job``, here from given positions and a
    reader of torch tensors (tests, the in-process MoE map check).

    Raises:
        StagingRefused: a changed tensor is reload-only, or the changed elements pass
            ``max_elements``.
    """
    start = time.perf_counter()
    carriers: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}

    def values_at(name: str, positions: np.ndarray) -> np.ndarray:
        if name not in carriers:
            t = new_checkpoint.tensor(name).reshape(-1)
            carriers[name] = as_int_bits(t).numpy()
        return carriers[name][positions]

    def with_dtype() -> Iterator[tuple[str, str, np.ndarray]]:
        for name, _entry, positions in changes:
            if name not in dtypes:
                dtypes[name] = _dtype_name(new_checkpoint.tensor(name).dtype)
            yield name, dtypes[name], positions

    patches, staged.elements, staged.tensors = stage_changes(
        cmap.placements, cmap.unused_tensors, reload_only_reasons(cmap), with_dtype(), values_at,
        max_elements=max_elements,
    )
    finish_staging(patches, params, staged, device_copies=device_copies)
    staged.stage_s = time.perf_counter() - start
    return staged


def reload_only_reasons(cmap: CoordinateMap) -> dict[str, str]:
    """Checkpoint tensor -> why a change to it cannot be patched live (every mapped tensor)."""
    out = {}
    for name in set(cmap.placements) | set(cmap.reload_only_tensors):
        why = cmap.why_reload_only(name)
        if why is not None:
            out[name] = why
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in TORCH_DTYPE_OF.items() if v == dtype)


class RestoreResult(NamedTuple):
    """What ``UndoLog.restore`` did: ``restored`` only if every patch was written back and reads
    back exactly as the undo log holds it."""

    restored: bool
    failures: tuple = ()  # "param: what went wrong", one per patch that failed

    def describe(self) -> str:
        if self.restored:
            return "restored"
        return "not restored: " + "; ".join(self.failures)


class RestoreBuffers:
    """The scratch a restore and its check need, made at staging (``finish_staging_steps``).

    Per integer width, one host buffer of the largest patch's elements (the read-back compared
    with the undo log); per (device, width) of patches with device copies, one buffer there
    (the undo values on their way back, then the read-back). Patches share them one after the
    other: on a device every use is on the same stream, so each waits for the one before.
    """

    def __init__(self, patches: Iterable[ParamPatch]) -> None:
        patches = list(patches)
        host: dict[int, int] = {}
        device: dict[tuple[str, int], int] = {}
        for p in patches:
            width, n = p.flat.element_size(), int(p.index.numel())
            host[width] = max(host.get(width, 0), n)
            if p.device_index is not None:
                key = (str(p.flat.device), width)
                device[key] = max(device.get(key, 0), n)
        # zeros, not empty: the scatter reads every patch back through these, so they are written
        # now and the pause takes no first-touch page faults on them
        self.host = {w: torch.zeros(n, dtype=INT_OF_WIDTH[w]) for w, n in host.items()}
        self.device = {k: torch.zeros(n, dtype=INT_OF_WIDTH[k[1]], device=k[0]) for k, n in device.items()}
        # the scatter's compare of what it wrote: on the host one bool per element of the largest
        # patch (numpy's ``!=`` into it); per device a pair of flags per patch there, set without
        # a reduction (``mapping.differ``: a reduction on CUDA takes a workspace in the pause)
        self.host_differs = np.ones(max(host.values(), default=0), dtype=np.bool_)
        self.counts_at = {}  # patch position -> its slot in its device's flags
        slots: dict[str, int] = {}
        for k, p in enumerate(patches):
            if p.device_index is not None:
                d = str(p.flat.device)
                self.counts_at[k] = (d, slots.get(d, 0))
                slots[d] = slots.get(d, 0) + 1
        largest = _largest_per_device(device)
        self.device_flags = {d: DifferFlags(d, n, largest[d]) for d, n in slots.items()}

    @property
    def device_nbytes(self) -> int:
        return sum(t.nbytes for t in self.device.values()) + sum(f.nbytes for f in self.device_flags.values())

    def for_patch(self, p: ParamPatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(host read-back, device scratch or None), each exactly ``p``'s elements (views)."""
        n = int(p.index.numel())
        host = self.host.get(p.flat.element_size())
        device = self.device.get((str(p.flat.device), p.flat.element_size())) if p.device_index is not None else None
        if host is None or host.numel() < n or (p.device_index is not None and (device is None or device.numel() < n)):
            raise RuntimeError(f"{p.param}: no restore buffer of {n} elements was made at staging "
                               f"(making one now would allocate inside the pause)")
        return host[:n], (device[:n] if device is not None else None)


def _largest_per_device(sizes: Mapping[tuple[str, int], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (device, _), n in sizes.items():
        out[device] = max(out.get(device, 0), n)
    return out


class WriteNotLanded(RuntimeError):
    """A patch read back right after its write holds other bits than the staged values: the
    scatter fails, so the rank restores and the transaction rolls every rank back."""


class ReadBack:
    """The scatter's check of its own writes: each patch read back from the storage it wrote,
    right after the write (its lines still in cache on the CPU; on a device the same stream, so
    after the write), and compared bit for bit with the staged values. Allocates nothing: the
    buffers are the restore's, made at staging (``RestoreBuffers``). On the host each patch is
    compared at once; on a device the differing elements of each patch are counted there and
    read once, after the fence's wait (``verify_device``)."""

    def __init__(self, patches: list[ParamPatch], buffers: RestoreBuffers) -> None:
        self._patches = patches
        self._buffers = buffers
        for flags in buffers.device_flags.values():  # a retry after a rollback reuses them
            flags.reset()
        self.elements = 0  # read back and equal to the staged values
        self._seconds = 0.0  # the read-backs timed apart (numpy's; on a device the launches only)
        self._compiled = host_scatter.ScatterTimings()  # the compiled loop's, whose cost is measured

    @property
    def seconds(self) -> float:
        """What reading back cost the scatter (on a device: the launches; the work runs with the
        writes)."""
        return self._seconds + self._compiled.read_back_s

    def after_write(self, k: int, p: ParamPatch, start: int = 0, stop: Optional[int] = None) -> None:
        """Patch ``k``'s positions ``start:stop`` (host patches: one chunk,
        ``ParamPatch.read_back_chunk``) were just written: read them back and compare."""
        t0 = time.perf_counter()
        n = int(p.index.numel())
        if p.device_index is not None:
            _, got = self._buffers.for_patch(p)
            device, slot = self._buffers.counts_at[k]
            torch.index_select(as_int_bits(p.flat), 0, p.device_index, out=got)
            self._buffers.device_flags[device].mark(slot, got, as_int_bits(p.device_values))
            self.elements += n
            self._seconds += time.perf_counter() - t0
            return
        stop = n if stop is None else stop
        got, _ = self._buffers.for_patch(p)
        got_np, expected_np = got.numpy()[start:stop], as_int_bits(p.values).numpy()[start:stop]
        # mode "clip": numpy buffers a take with out= in its default mode (the positions are in
        # range: staging took the undo log from them)
        np.take(as_int_bits(p.flat).numpy(), p.index.numpy()[start:stop], out=got_np, mode="clip")
        differs = self._buffers.host_differs[start:stop]
        np.not_equal(got_np, expected_np, out=differs)
        self._seconds += time.perf_counter() - t0
        if differs.any():
            raise WriteNotLanded(self._describe(p, got_np, expected_np, start))
        self.elements += stop - start

    def write_and_read_back(self, p: ParamPatch) -> None:
        """Write host patch ``p`` and read every element back in one compiled loop
        (``host_scatter``); ``seconds`` gets what the read-back cost it, as the loop measured."""
        result = host_scatter.scatter_and_read_back(p.flat, p.index, p.values)
        self._compiled += result.timings
        if result.first_differing >= 0:
            # the loop read back its chunk in order up to the first element that differed (and
            # stopped there): describe that stretch
            stop = result.first_differing + 1
            start = result.first_differing - result.first_differing % host_scatter.CHUNK
            got = as_int_bits(p.flat).numpy()[p.index.numpy()[start:stop]]  # the failure path: this allocates
            raise WriteNotLanded(self._describe(p, got, as_int_bits(p.values).numpy()[start:stop], start))
        self.elements += int(p.index.numel())

    def verify_device(self) -> None:
        """After the fence's wait: every patch written from device copies held its values."""
        t0 = time.perf_counter()
        differing = {d: flags.differing() for d, flags in self._buffers.device_flags.items()}  # synchronous, a few bytes
        for k, (d, slot) in self._buffers.counts_at.items():
            if bool(differing[d][slot]):
                p = self._patches[k]
                # the failure path: this allocates (the rank restores and the update fails anyway)
                got = as_int_bits(p.flat).index_select(0, p.device_index).cpu().numpy()
                self._seconds += time.perf_counter() - t0
                raise WriteNotLanded(self._describe(p, got, as_int_bits(p.values).numpy()))
        self._seconds += time.perf_counter() - t0

    @staticmethod
    def _describe(p: ParamPatch, got: np.ndarray, expected: np.ndarray, start: int = 0) -> str:
        """``got``/``expected``: positions ``start:`` of the patch (one chunk, or all of it)."""
        bad = np.flatnonzero(got != expected)
        k = int(bad[0])
        as_dtype = lambda bits: torch.from_numpy(bits[k:k + 1].copy()).view(p.flat.dtype).item()  # noqa: E731
        where = f"of {got.size}" if start == 0 and got.size == p.index.numel() else \
            f"of positions {start}-{start + got.size - 1} of {int(p.index.numel())}"
        return (f"{p.param}: {bad.size} {where} written element(s) read back other bits than staged, "
                f"first at flat position {int(p.index[start + k])}: expected {as_dtype(expected)!r}, found {as_dtype(got)!r}")


class UndoLog:
    """The old values at every position a scatter may have written, to put back on failure.

    Failure-atomic: it allocates nothing (the index, the undo values' device scratch and the
    read-back were all made at staging, so an out-of-memory error cannot stop a restore inside
    the pause); ``restore`` tries every patch even after one failed, waits for the device
    (``fence``), then reads every patch back and compares it with the undo log bit for bit. It
    never raises: the caller must reload on ``restored=False``.
    """

    def __init__(self, patches: list[ParamPatch], buffers: Optional[RestoreBuffers] = None,
                 fence: Optional[PauseFence] = None) -> None:
        self._patches = list(patches)
        # None: made here (a caller outside the pause); scatter_with_undo passes staging's
        self._buffers = buffers if buffers is not None else RestoreBuffers(self._patches)
        self._fence = fence or HostFence()
        self.read_back: Optional[ReadBack] = None  # the scatter's check of its writes (scatter_with_undo)

    def _write_back(self, p: ParamPatch) -> None:
        _, device_old = self._buffers.for_patch(p)
        if device_old is None:
            p.write(p.old)
            return
        device_old.copy_(as_int_bits(p.old), non_blocking=True)  # pageable: the host is done reading on return
        p.write(device_old.view(p.flat.dtype))

    def _holds_old(self, p: ParamPatch) -> bool:
        check, device_old = self._buffers.for_patch(p)
        if device_old is None:
            torch.index_select(as_int_bits(p.flat), 0, p.on_device_index(), out=check)
        else:
            torch.index_select(as_int_bits(p.flat), 0, p.device_index, out=device_old)
            check.copy_(device_old)  # to pageable host memory: returns once the device wrote it
        return torch.equal(check, as_int_bits(p.old))

    def restore(self, *, before_write: Optional[Callable[[int, str], None]] = None) -> RestoreResult:
        """Write every patch back (reverse order), then check each against the undo log.

        ``before_write(k, param)``: called before patch ``k``'s write-back (a test's fault)."""
        failures: list[str] = []
        failed: set[str] = set()  # params already reported (one failure line each)
        with one_intra_op_thread():
            try:
                self._fence.begin_writes()
            except Exception as exc:
                failures.append(f"the device: {type(exc).__name__}: {exc}")
            for k in reversed(range(len(self._patches))):
                p = self._patches[k]
                try:
                    if before_write is not None:
                        before_write(k, p.param)
                    self._write_back(p)
                except Exception as exc:  # the others are still written back
                    failures.append(f"{p.param}: write-back failed: {type(exc).__name__}: {exc}")
                    failed.add(p.param)
            try:
                self._fence.end_writes()
                self._fence.wait()  # an asynchronous failure of the write-backs raises here
            except Exception as exc:
                failures.append(f"the device: {type(exc).__name__}: {exc}")
            for p in self._patches:
                try:
                    if not self._holds_old(p) and p.param not in failed:
                        failures.append(f"{p.param}: reads back other values than the undo log")
                        failed.add(p.param)
                except Exception as exc:
                    failures.append(f"{p.param}: read-back failed: {type(exc).__name__}: {exc}")
        if not failures:
            self._patches.clear()
        return RestoreResult(not failures, tuple(failures))

    @property
    def nbytes(self) -> int:
        return sum(p.old.nbytes for p in self._patches)


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def scatter_with_undo(
    staged: StagedUpdate, *, before_write: Optional[Callable[[int, str], None]] = None,
    before_restore: Optional[Callable[[int, str], None]] = None,
) -> tuple[UndoLog, int]:
    """Write every patch into the parameter it was staged for, read each back from the same
    storage right after its write and compare it bit for bit with the staged values
    (``ReadBack``: a write that did not land is a failed scatter, ``WriteNotLanded``), and wait
    until the device did; returns the undo log (``undo.read_back``: the elements verified and the
    read-back's time) and the elements written. Allocates nothing: everything it and a restore
    use was made at staging.

    On an exception (an asynchronous device error included: ``staged.fence`` raises it) every
    patch is restored before it propagates, so this rank is exactly at the previous version; if
    that restore fails too, ``RestoreFailed`` (the rank must reload). A caller that learns
    another rank failed calls ``undo.restore()`` and checks its result.
    """
    if staged.patches and staged.restore_buffers is None:
        raise RuntimeError("the update was staged without its restore buffers (finish_staging makes them)")
    fence = staged.fence or HostFence()
    undo = UndoLog(staged.patches, staged.restore_buffers, fence)
    check = undo.read_back = ReadBack(staged.patches, undo._buffers)
    written = 0
    try:
        with one_intra_op_thread():
            fence.begin_writes()
            for k, p in enumerate(staged.patches):
                if before_write is not None:
                    before_write(k, p.param)
                n = int(p.index.numel())
                if p.device_index is not None:
                    p.write_new()
                    check.after_write(k, p)
                elif host_scatter.compiled() is not None:
                    check.write_and_read_back(p)
                else:  # each chunk read back while its lines are still in cache
                    chunk = p.read_back_chunk()
                    for a in range(0, n, chunk):
                        p.write_new(a, min(n, a + chunk))
                        check.after_write(k, p, a, min(n, a + chunk))
                written += n
            fence.end_writes()
            fence.wait()
            check.verify_device()
    except BaseException as exc:
        result = undo.restore(before_write=before_restore)
        if not result.restored:
            raise RestoreFailed(result, exc) from exc
        raise
    return undo, written


class RestoreFailed(RuntimeError):
    """A scatter failed and writing the undo log back failed too: the rank holds neither version."""

    def __init__(self, result: RestoreResult, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}; the restore failed: {result.describe()}")
        self.result = result
