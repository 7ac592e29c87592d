"""Finish a live update's staging while serving, scatter it during the pause, undo it exactly.

Staging has two halves. The heavy one (``live.stage``: positions, mapping, new values read from
the verified local checkpoint) runs in the rank's pull helper process. This module does the
engine-side half, in the scheduler process but still while serving (``finish_staging_steps``):
cast the new values to each parameter's dtype (what the loader's ``copy_`` does), and read the
*old* values at the same positions from the live parameters, which is the undo log. It runs on
the scheduler thread itself, in bounded steps between loop iterations (``loop_slices``).
Everything sits in host memory, pinned when the parameters live on a CUDA device.

Memory bound, per rank: ``8 + 2 x itemsize`` bytes per changed element of this rank's shard
(the index, the new values, the old values), plus the checkpoint-dtype values while the cast
runs; staging is refused (the call reloads) once the changed elements pass ``max_elements``.

The pause (``scatter_with_undo``) is then only the writes into each parameter's own storage
(pointers unchanged, so captured CUDA graphs stay valid): ``index_copy_`` on a device, numpy
fancy assignment over integer views for sparse patches on the CPU, with one intra-op thread (a multi-threaded
``index_copy_`` of bf16 over scattered positions is many times slower here, and the TP ranks
already run side by side). On any failure every patch is written
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

from .coordinate_map import INT_OF_WIDTH, TORCH_DTYPE_OF, CheckpointReader, CoordinateMap, as_int_bits
from .stage import Patch, StagingRefused, positions_through, stage_changes
from .loop_slices import drain

__all__ = ["ParamPatch", "RestoreFailed", "RestoreResult", "SavedOld", "StagedUpdate", "StagingRefused", "UndoLog", "finish_staging", "positions_through",
           "scatter_with_undo", "stage_update", "undo_log_steps"]

SPARSE_WRITE_DENSITY = 0.03  # below it a CPU patch is written through numpy (see ParamPatch.write)


class ParamPatch(NamedTuple):
    param: str
    flat: torch.Tensor  # the parameter's own storage, flat (a view: writes go to the live weights)
    index: torch.Tensor  # int64 flat positions in the contiguous parameter
    values: torch.Tensor  # the new values, the parameter's dtype, host memory
    old: torch.Tensor  # the live values there when staged (the undo log)
    device_index: Optional[torch.Tensor] = None  # ``index`` on the parameter's device (None on the CPU)

    def write(self, source: torch.Tensor) -> None:
        """``flat[index] = source`` in place."""
        if self.flat.device.type == "cpu" and self.index.numel() < SPARSE_WRITE_DENSITY * self.flat.numel():
            # numpy's fancy assignment over same-width integer views: the same bytes, measured
            # about 1.5x faster than index_copy_ at 1% density, and slower from about 5%
            as_int_bits(self.flat).numpy()[self.index.numpy()] = as_int_bits(source).numpy()
        else:
            self.flat.index_copy_(0, self.on_device_index(), source.to(self.flat.device, non_blocking=True))

    def on_device_index(self) -> torch.Tensor:
        if self.flat.device.type == "cpu":
            return self.index
        if self.device_index is not None:
            return self.device_index
        return self.index.to(self.flat.device, non_blocking=True)


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
    from_key: Optional[tuple] = None  # the identity of the live version it was staged from (live.identity)
    target: Any = None  # the live version it makes (a live.identity.LiveVersion)

    @property
    def nbytes(self) -> int:
        return sum(p.index.nbytes + p.values.nbytes + p.old.nbytes for p in self.patches)


def _as_torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    """The checkpoint values (integer carrier) as a tensor of the checkpoint's dtype, zero-copy."""
    torch_dtype = TORCH_DTYPE_OF[dtype]
    width = values.dtype.itemsize
    carrier = torch.from_numpy(values.view(np.uint8 if width == 1 else np.dtype(f"<i{width}")))  # torch lacks wide uints
    return carrier.view(torch_dtype) if torch_dtype != INT_OF_WIDTH[width] else carrier


STEP_ELEMENTS = 1 << 16  # elements per step of finish_staging_steps: well under a millisecond


def finish_staging(patches: Iterable[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate) -> StagedUpdate:
    """Cast each patch's values to its parameter's dtype and save the live values it overwrites."""
    with one_intra_op_thread():
        drain(finish_staging_steps(patches, params, staged))
    return staged


def finish_staging_steps(
    patches: Iterable[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate,
    saved: "Optional[list[SavedOld]]" = None,
) -> Iterator[None]:
    """``finish_staging`` in steps of at most ``STEP_ELEMENTS`` elements, yielding between them.

    The scheduler thread runs these a few at a time between its loop iterations
    (``loop_slices.LoopSlices``). From any other thread of the scheduler process every torch
    call has to win the GIL back from sglang's busy loop: measured 9 ms per call at TP=1, with
    a 0.1 ms switch interval (4.3 s for 6.6M elements; 0.17 s of steps on the loop thread).
    ``staged.engine_s`` counts only the time spent in the steps. ``saved``: the undo log, when
    ``undo_log_steps`` already took it from the same patches (while the helper still wrote their
    values).
    """
    patches = list(patches)
    if saved is None:
        saved = yield from undo_log_steps(patches, params, staged)
    yield from _new_values_steps(patches, saved, staged)


class SavedOld(NamedTuple):
    """What one patch needs only its positions for: where it writes, and the undo log."""

    flat: torch.Tensor  # the parameter's own storage, flat
    index: torch.Tensor  # the positions, host memory (pinned with CUDA)
    old: torch.Tensor  # the live values there (host memory, pinned with CUDA)
    pinned: bool
    device_index: Optional[torch.Tensor] = None  # the positions on the parameter's device (kept: a
    # restore inside the pause must not allocate device memory for them)


def undo_log_steps(
    patches: list[Patch], params: Mapping[str, torch.Tensor], staged: StagedUpdate
) -> Generator[None, None, list[SavedOld]]:
    """The first half of ``finish_staging_steps``: save the live values at every patch's
    positions (reads ``patch.index`` only, never ``patch.values``); returns them."""
    pin = any(p.device.type == "cuda" for p in params.values())
    saved = []
    for patch in patches:
        t0 = time.perf_counter()
        flat = params[patch.param].data.view(-1)
        count = int(patch.index.size)
        on_cpu = flat.device.type == "cpu"
        with _quiet_readonly():
            shared_index = torch.from_numpy(patch.index)
        # on the CPU the shared file's views are used as they are; for a device, pinned copies
        index = shared_index if not pin else torch.empty(count, dtype=torch.int64, pin_memory=True)
        device_index = index if on_cpu else torch.empty(count, dtype=torch.int64, device=flat.device)
        old = torch.empty(count, dtype=flat.dtype, pin_memory=pin)
        for a in range(0, count, STEP_ELEMENTS):
            b = min(count, a + STEP_ELEMENTS)
            if index is not shared_index:
                index[a:b].copy_(shared_index[a:b])
            if on_cpu:
                torch.index_select(flat, 0, index[a:b], out=old[a:b])
            else:
                device_index[a:b].copy_(index[a:b])
                old[a:b].copy_(flat.index_select(0, device_index[a:b]))
            staged.engine_s += time.perf_counter() - t0
            yield
            t0 = time.perf_counter()
        saved.append(SavedOld(flat, index, old, pin, None if on_cpu else device_index))
        staged.engine_s += time.perf_counter() - t0
    return saved


def _new_values_steps(patches: list[Patch], saved: list[SavedOld], staged: StagedUpdate) -> Iterator[None]:
    """The second half: each patch's new values in its parameter's dtype (the checkpoint's bytes
    as they are when the dtypes agree on the CPU: no step then), and the patches it makes."""
    for patch, s in zip(patches, saved, strict=True):
        t0 = time.perf_counter()
        count = int(patch.index.size)
        with _quiet_readonly():
            source = _as_torch(patch.values, patch.dtype)
        values = source
        if source.dtype != s.flat.dtype or s.pinned:
            values = torch.empty(count, dtype=s.flat.dtype, pin_memory=s.pinned)
            for a in range(0, count, STEP_ELEMENTS):
                b = min(count, a + STEP_ELEMENTS)
                values[a:b].copy_(source[a:b])
                staged.engine_s += time.perf_counter() - t0
                yield
                t0 = time.perf_counter()
        staged.patches.append(ParamPatch(patch.param, s.flat, s.index, values, s.old, s.device_index))
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
) -> StagedUpdate:
    """Both halves of staging in this process, for ``changes`` (``(tensor, entry, positions)``).

    What the helper process does with ``live.stage.stage_job``, here from given positions and a
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
    finish_staging(patches, params, staged)
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


class UndoLog:
    """The old values at every position a scatter may have written, to put back on failure.

    Failure-atomic: the buffers a restore and its check need are allocated here, before the
    first write (on a device every write-back would otherwise allocate the index and the values,
    and an out-of-memory write is exactly what a restore inside the pause may hit); ``restore``
    tries every patch even after one failed, then reads every patch back and compares it with
    the undo log bit for bit. It never raises: the caller must reload on ``restored=False``.
    """

    def __init__(self, patches: list[ParamPatch]) -> None:
        self._patches = list(patches)
        # one scratch pair per (device, width): the undo values on the device, and the read-back
        largest: dict[tuple[str, int], int] = {}
        for p in self._patches:
            key = (str(p.flat.device), p.flat.element_size())
            largest[key] = max(largest.get(key, 0), int(p.index.numel()))
        self._scratch = {
            key: (torch.empty(n, dtype=INT_OF_WIDTH[key[1]], device=key[0]),
                  torch.empty(n, dtype=INT_OF_WIDTH[key[1]], device=key[0]) if not key[0].startswith("cpu") else None)
            for key, n in largest.items()
        }

    def _buffers(self, p: ParamPatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        check, device_old = self._scratch[(str(p.flat.device), p.flat.element_size())]
        n = int(p.index.numel())
        return check[:n], (device_old[:n] if device_old is not None else None)

    def _write_back(self, p: ParamPatch) -> None:
        _, device_old = self._buffers(p)
        if device_old is None:
            p.write(p.old)
            return
        if p.device_index is None:
            raise RuntimeError("no device copy of the positions was staged (a write-back would allocate)")
        device_old.copy_(as_int_bits(p.old), non_blocking=True)
        p.flat.index_copy_(0, p.device_index, device_old.view(p.flat.dtype))

    def _holds_old(self, p: ParamPatch) -> bool:
        check, device_old = self._buffers(p)
        torch.index_select(as_int_bits(p.flat), 0, p.on_device_index(), out=check)
        if device_old is None:
            return torch.equal(check, as_int_bits(p.old))
        device_old.copy_(as_int_bits(p.old), non_blocking=True)
        return torch.equal(check, device_old)

    def restore(self, *, before_write: Optional[Callable[[int, str], None]] = None) -> RestoreResult:
        """Write every patch back (reverse order), then check each against the undo log.

        ``before_write(k, param)``: called before patch ``k``'s write-back (a test's fault)."""
        failures: list[str] = []
        failed: set[str] = set()  # params already reported (one failure line each)
        with one_intra_op_thread():
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
                if any(p.flat.device.type == "cuda" for p in self._patches):
                    torch.cuda.synchronize()
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
            self._scratch.clear()
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
    """Write every patch into the parameter it was staged for; returns the undo log and the
    elements written.

    On an exception every patch is restored before it propagates, so this rank is exactly at
    the previous version; if that restore fails too, ``RestoreFailed`` (the rank must reload). A
    caller that learns another rank failed calls ``undo.restore()`` and checks its result.
    """
    undo = UndoLog(staged.patches)
    written = 0
    try:
        with one_intra_op_thread():
            for k, p in enumerate(staged.patches):
                if before_write is not None:
                    before_write(k, p.param)
                p.write(p.values)
                written += int(p.index.numel())
        if any(p.flat.device.type == "cuda" for p in staged.patches):
            torch.cuda.synchronize()
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
