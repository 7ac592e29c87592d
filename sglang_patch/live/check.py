"""Each update proven from the live weights (issue 19): after every commit or reload, a rank
compares a fresh random sample of its mapped parameter elements with the local checkpoint's
bytes of the version it now claims, and every element a live apply wrote with the staged value.

Why a sample and not the whole model: the start-up proof already showed that each proven
parameter is a plain copy of its boxes; what can still go wrong later is a write that landed
somewhere else, a stale element, or bytes of another version. Those show up in any random
sample drawn afresh per update (positions from the version and a per-rank counter, so two
updates never check the same elements), at a cost of ``SAMPLE_PER_TENSOR`` elements in each of
``SAMPLE_TENSORS_PER_UPDATE`` checkpoint tensors (drawn afresh too), independent of the update's
and the model's size. The scattered elements are all checked:
their count is what the pause already paid for.

Only proven parameters are sampled: a reload-only or unproven parameter, or one no checkpoint
element lands on, has no expected value the map can rebuild (``not_checkable_params``).
The expected value is rebuilt as the proof does: the checkpoint element through the placement's
box, cast to the parameter's dtype by ``copy_`` (what the loader's copy does), compared bit for
bit. No sglang here.
"""

from __future__ import annotations

import itertools
import os
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from .coordinate_map import CoordinateMap, as_int_bits
from .results import RankCheck

SAMPLE_PER_TENSOR = 4096  # elements drawn per checkpoint tensor and update
# checkpoint tensors sampled per update, drawn afresh each time (a model's few hundred tensors are
# all reached within a few updates): the cost is per tensor (about 0.4 ms on this CPU), so the
# sample's cost stays bounded whatever the model's size
SAMPLE_TENSORS_PER_UPDATE = 64
SAMPLE_ENV = "WEIGHTSYNC_UPDATE_CHECK_SAMPLE"  # "<elements per tensor>,<tensors per update>"; "0,0": none


@dataclass
class _Tally:
    compared: int = 0
    mismatches: int = 0
    first: Optional[str] = None

    def add(self, where: str, expected: torch.Tensor, got: torch.Tensor, positions: np.ndarray) -> None:
        differ = torch.ne(as_int_bits(expected), as_int_bits(got))
        self.compared += int(differ.numel())
        bad = int(torch.count_nonzero(differ))
        if bad:
            self.mismatches += bad
            if self.first is None:
                k = int(torch.nonzero(differ)[0, 0])
                self.first = (f"{where}: element {int(positions[k])} holds {got[k].item()!r}, "
                              f"expected {expected[k].item()!r}")


def sample_seed(version: int, counter: int, rank: str = "") -> list[int]:
    """The sample's seed: fresh for each update (``counter``), and per rank."""
    return [int(version) & 0xFFFFFFFF, int(counter) & 0xFFFFFFFF, zlib.crc32(rank.encode())]


def checkable_params(cmap: CoordinateMap, param_names: Iterable[str]) -> tuple[set[str], set[str]]:
    """``(checked, not checkable)``: proven parameters with placements, and every other one."""
    names = set(param_names)
    mapped = {p.param for ps in cmap.placements.values() for p in ps}
    checked = {n for n in names & mapped & cmap.proven_params if n not in cmap.reload_only_params}
    return checked, names - checked


def _flat_host(t: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    # index_select, not flat[idx]: advanced indexing measured 100x slower on the CPU here
    flat = t.detach().reshape(-1)
    idx = torch.from_numpy(index)
    if flat.device.type != "cpu":
        return flat.index_select(0, idx.to(flat.device, non_blocking=True)).cpu()
    return flat.index_select(0, idx)


def check_sample(
    cmap: CoordinateMap, params: Mapping[str, torch.Tensor], read_tensor: Callable[[str], torch.Tensor],
    seed: list[int], per_tensor: int = SAMPLE_PER_TENSOR, tally: Optional[_Tally] = None,
    max_tensors: Optional[int] = None, checked: Optional[set[str]] = None,
) -> _Tally:
    """Compare up to ``per_tensor`` random elements of each of up to ``max_tensors`` random
    checkpoint tensors' boxes (into checkable parameters) with the parameter elements they land on.

    ``checked``: ``checkable_params``'s first set when the caller has it already (not rebuilt)."""
    tally = tally or _Tally()
    if checked is None:
        checked, _ = checkable_params(cmap, params)
    rng = np.random.default_rng(seed)
    tensors = [t for t in sorted(cmap.placements) if any(p.param in checked for p in cmap.placements[t])]
    if max_tensors is not None and len(tensors) > max_tensors:
        tensors = sorted(rng.choice(np.array(tensors, dtype=object), size=max_tensors, replace=False).tolist())
    for tensor in tensors:
        boxes = [p for p in cmap.placements[tensor] if p.param in checked]
        if not boxes or per_tensor <= 0:
            continue
        counts = np.array([int(np.prod(p.sizes, dtype=np.int64)) for p in boxes], dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            continue
        if total <= per_tensor:
            drawn = np.arange(total, dtype=np.int64)  # small: every element
        else:
            drawn = np.sort(rng.choice(total, size=per_tensor, replace=False)).astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)))
        src = read_tensor(tensor).reshape(-1)
        for b, p in enumerate(boxes):
            local = drawn[(drawn >= starts[b]) & (drawn < starts[b + 1])] - starts[b]
            if local.size == 0:
                continue
            multi = np.unravel_index(local, p.sizes) if p.sizes else ()
            src_pos = p.src_offset + sum((m * s for m, s in zip(multi, p.src_strides)), np.zeros_like(local))
            dst_pos = p.dst_offset + sum((m * s for m, s in zip(multi, p.dst_strides)), np.zeros_like(local))
            live = params[p.param]
            expected = torch.empty(local.size, dtype=live.dtype)
            expected.copy_(src.index_select(0, torch.from_numpy(src_pos)))  # the cast a load does
            tally.add(f"{p.param} (from {tensor})", expected, _flat_host(live, dst_pos), dst_pos)
    return tally


def check_scattered(patches: Iterable, tally: Optional[_Tally] = None) -> _Tally:
    """Compare every element a live apply wrote (``live.patch.ParamPatch``) with its staged value."""
    tally = tally or _Tally()
    for p in patches:
        if p.index.numel() == 0:
            continue
        got = p.flat.index_select(0, p.on_device_index())
        if got.device.type != "cpu":
            got = got.cpu()
        tally.add(f"{p.param} (scattered)", p.values, got, p.index.numpy())
    return tally


def check_update(
    rank: str, cmap: Optional[CoordinateMap], params: Mapping[str, torch.Tensor],
    read_tensor: Optional[Callable[[str], torch.Tensor]], *, version: int, counter: int,
    patches: Iterable = (), per_tensor: int = SAMPLE_PER_TENSOR, max_tensors: Optional[int] = None,
    still_valid: Callable[[], bool] = lambda: True,
) -> RankCheck:
    """One rank's check after an update to ``version`` (see the module docstring).

    ``read_tensor`` None: the checkpoint is not checked (only the scattered elements).
    ``still_valid``: False when the checkpoint changed during the check: the sample then counts
    for nothing (a pull's new bytes are not a mismatch of this version)."""
    start = time.perf_counter()
    scattered = check_scattered(patches)
    if cmap is None or not cmap.proven:
        why = "no proven coordinate map: the checkpoint sample was not drawn"
        return _result(rank, scattered, None, 0, len(params), start, why)
    checked, unchecked = checkable_params(cmap, params)
    if read_tensor is None:
        return _result(rank, scattered, None, len(checked), len(unchecked), start,
                       "no sample drawn: the local checkpoint does not name this version (or the sample is off)")
    sample = check_sample(cmap, params, read_tensor, sample_seed(version, counter, rank), per_tensor,
                          max_tensors=max_tensors, checked=checked)
    if not still_valid():
        return _result(rank, scattered, None, len(checked), len(unchecked), start,
                       "the local checkpoint changed during the check: the sample counts for nothing")
    return _result(rank, scattered, sample, len(checked), len(unchecked), start, "")


def _result(rank: str, scattered: _Tally, sample: Optional[_Tally], checked: int, unchecked: int, start: float,
            why: str) -> RankCheck:
    sampled = sample.compared if sample else 0
    mismatches = scattered.mismatches + (sample.mismatches if sample else 0)
    first = scattered.first or (sample.first if sample else None)
    return RankCheck(
        rank=rank, verified_elements=scattered.compared + sampled - mismatches, mismatches=mismatches,
        sampled_elements=sampled, scattered_elements=scattered.compared, checked_params=checked,
        not_checkable_params=unchecked, check_s=time.perf_counter() - start, detail=first or why,
    )


_counter = itertools.count(1)  # per scheduler process, i.e. per rank: each update draws afresh


def sample_size() -> tuple[int, int]:
    """``(elements per tensor, tensors per update)`` of the sample (``WEIGHTSYNC_UPDATE_CHECK_SAMPLE``)."""
    value = os.environ.get(SAMPLE_ENV, "")
    try:
        per_tensor, max_tensors = (int(x) for x in value.split(","))
        return max(0, per_tensor), max(0, max_tensors)
    except ValueError:
        return SAMPLE_PER_TENSOR, SAMPLE_TENSORS_PER_UPDATE


def check_after_update(state, local_dir: str, version: int, patches: Iterable = ()) -> RankCheck:
    """The check of ``live.state.LiveApplyState`` ``state`` once it holds ``version`` (after a
    commit or a reload from ``local_dir``); never raises (a check that fails says so)."""
    import weightsync.codecs.positions as positions

    from .coordinate_map import CheckpointReader
    from .identity import key_of_held

    try:
        live = state.live
        want = live.key() if live is not None and live.version == version else None

        def dir_holds_version() -> bool:
            held = positions.held_version(local_dir)
            return want is not None and held is not None and key_of_held(held) == want and not state.pull_is_running()

        per_tensor, max_tensors = sample_size()
        read = CheckpointReader(local_dir).tensor if per_tensor > 0 and dir_holds_version() else None
        return check_update(state.rank, state.cmap, state.params(), read, version=version, counter=next(_counter),
                            patches=patches, per_tensor=per_tensor, max_tensors=max_tensors,
                            still_valid=dir_holds_version)
    except Exception as exc:
        return RankCheck(rank=state.rank, detail=f"the check failed: {type(exc).__name__}: {exc}")
