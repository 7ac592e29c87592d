"""Stage a live update while serving, scatter it during the pause, undo it exactly on failure.

Stage (``stage_update``, in the pull thread, after the core verified the local checkpoint):
the changed element positions of each checkpoint tensor (decoded from the delta payloads by
``weightsync.positions``, never by diffing tensors) go through the proven coordinate map to
this rank's parameter positions; the new values are read at those positions from the verified
local checkpoint and cast to the parameter's dtype (what the loader's ``copy_`` does), in host
memory, pinned when the parameters live on a CUDA device.

Memory bound: per rank, ``(8 + itemsize)`` bytes per changed element of this rank's shard for the
staged update, plus 8 bytes per changed element of the one checkpoint tensor being mapped;
during the pause the undo log adds ``itemsize`` bytes per staged element. Staging stops (and
the call reloads) once the changed elements pass ``max_elements``.

Scatter (``scatter_with_undo``): ``index_copy_`` into each parameter's own storage (pointers
unchanged, so captured CUDA graphs stay valid); before each write the old values at the same
positions go to the undo log, and ``UndoLog.restore`` puts them back in reverse order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NamedTuple, Optional

import numpy as np
import torch

from .coordinate_map import CheckpointReader, CoordinateMap, Placement


class StagingRefused(Exception):
    """This update cannot be patched live; ``reason`` says why (the call reloads instead)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ParamPatch(NamedTuple):
    param: str
    index: torch.Tensor  # int64 flat positions in the contiguous parameter
    values: torch.Tensor  # the new values, the parameter's dtype, host memory


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
    stage_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(p.index.nbytes + p.values.nbytes for p in self.patches)


def positions_through(p: Placement, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(checkpoint positions, parameter positions)`` of the sorted ``positions`` inside ``p``'s box."""
    lo = p.src_offset
    hi = lo + sum((n - 1) * s for n, s in zip(p.sizes, p.src_strides))
    a, b = np.searchsorted(positions, [lo, hi + 1])
    if a == b:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    chosen = positions[a:b]
    rest = chosen - lo
    ok = np.ones(rest.size, dtype=bool)
    dst = np.full(rest.size, p.dst_offset, dtype=np.int64)
    for d in sorted(range(len(p.sizes)), key=lambda d: -p.src_strides[d]):
        i = rest // p.src_strides[d]
        ok &= i < p.sizes[d]
        rest = rest - i * p.src_strides[d]
        dst += i * p.dst_strides[d]
    ok &= rest == 0
    return chosen[ok], dst[ok]


def stage_update(
    cmap: CoordinateMap,
    params: Mapping[str, torch.Tensor],
    changes: Iterable[tuple[str, object, np.ndarray]],
    new_checkpoint: CheckpointReader,
    *,
    max_elements: int,
    staged: StagedUpdate,
) -> StagedUpdate:
    """Fill ``staged`` with this rank's patches for ``changes`` (``(tensor, entry, positions)``).

    Raises:
        StagingRefused: a changed tensor is reload-only, or the changed elements pass
            ``max_elements``.
    """
    start = time.perf_counter()
    index_parts: dict[str, list[torch.Tensor]] = {}
    value_parts: dict[str, list[torch.Tensor]] = {}
    pin = any(p.device.type == "cuda" for p in params.values())
    for name, _entry, positions in changes:
        if name in cmap.unused_tensors:
            continue  # the loader ignores it on this rank, so a reload would too
        why = cmap.why_reload_only(name)
        if why is not None:
            raise StagingRefused(why)
        placements = cmap.placements.get(name)
        if not placements:
            raise StagingRefused(f"checkpoint tensor {name} changed but the map has no placement for it")
        staged.tensors += 1
        source = None
        for p in placements:
            hf_pos, dst_pos = positions_through(p, positions)
            if not hf_pos.size:
                continue
            staged.elements += int(hf_pos.size)
            if staged.elements > max_elements:
                raise StagingRefused(
                    f"more than {max_elements} changed elements on this rank (the live-apply threshold); "
                    "a reload is as cheap"
                )
            if source is None:
                source = new_checkpoint.tensor(name).reshape(-1)
            dtype = params[p.param].dtype
            values = source[torch.from_numpy(hf_pos)].to(dtype)
            index_parts.setdefault(p.param, []).append(torch.from_numpy(dst_pos))
            value_parts.setdefault(p.param, []).append(values)
    for param, parts in index_parts.items():
        index = torch.cat(parts) if len(parts) > 1 else parts[0]
        values = torch.cat(value_parts[param]) if len(parts) > 1 else value_parts[param][0]
        if pin:
            index, values = index.pin_memory(), values.pin_memory()
        staged.patches.append(ParamPatch(param, index, values))
    staged.stage_s = time.perf_counter() - start
    return staged


class UndoLog:
    """The old values at every position a scatter wrote, to put back on failure."""

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(self, flat: torch.Tensor, index: torch.Tensor) -> None:
        self._entries.append((flat, index, flat.index_select(0, index)))

    def restore(self) -> None:
        for flat, index, old in reversed(self._entries):
            flat.index_copy_(0, index, old)
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(old.nbytes for _, _, old in self._entries)


def scatter_with_undo(
    staged: StagedUpdate,
    params: Mapping[str, torch.Tensor],
    *,
    before_write: Optional[Callable[[int, str], None]] = None,
) -> tuple[UndoLog, int]:
    """Write every patch in place; returns the undo log and the elements written.

    On an exception the positions written so far are restored before it propagates, so this
    rank is exactly at the previous version; a caller that learns another rank failed calls
    ``undo.restore()`` itself.
    """
    undo = UndoLog()
    written = 0
    try:
        for k, patch in enumerate(staged.patches):
            flat = params[patch.param].data.view(-1)
            index = patch.index.to(flat.device, non_blocking=True)
            values = patch.values.to(flat.device, non_blocking=True)
            undo.record(flat, index)
            if before_write is not None:
                before_write(k, patch.param)
            flat.index_copy_(0, index, values)
            written += int(index.numel())
        if any(p.device.type == "cuda" for p in params.values()):
            torch.cuda.synchronize()
    except BaseException:
        undo.restore()
        raise
    return undo, written
