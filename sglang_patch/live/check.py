"""Each update proven from the live weights (issue 19): after every commit or reload, a rank
compares a fresh random sample of its mapped parameter elements with the local checkpoint's
bytes of the version it now claims; after a live apply, that every storage it wrote is still
the one the engine reads (each written element was read back and compared with the staged
value inside the scatter itself: ``live.scatter.patch.ReadBack``).

Why a sample and not the whole model: the start-up proof already showed that each proven
parameter is a plain copy of its boxes; what can still go wrong later is a write that landed
somewhere else, a stale element, or bytes of another version. Those show up in any random
sample drawn afresh per update (positions from the version and a per-rank counter, so two
updates never check the same elements), at a cost of ``SAMPLE_PER_TENSOR`` elements in each of
``SAMPLE_TENSORS_PER_UPDATE`` checkpoint tensors (drawn afresh too), independent of the update's
and the model's size. The scattered elements are all checked, in the scatter, right after
each chunk's write while its lines are in cache (a gather at commit, with the lines long out
of cache, cost about as much as the scatter).

Where the cost goes (the pause holds generation off, so only what must be known before the
engine serves again runs inside it):

- A live apply's sample is *prepared while serving*, at staging (``UpdateChecker.prepare_steps``,
  bounded loop slices on the scheduler thread, like the rest of staging): positions drawn, the
  checkpoint bytes there read from the target version's verified local checkpoint, rebuilt as
  parameter-dtype values. Those bytes are the target version's published bytes whatever the dir
  holds later (the dir named that version before and after the read), so the pause reads no
  file: it gathers the live parameters at the sampled positions, one gather and one compare per
  parameter (``PreparedSample.compare``).
- The written elements are read back inside the scatter; at commit only each patched
  parameter's storage is compared with the view written (``check_scattered``: pointers, no
  element read). Nothing moves after the pause: the tokenizer holds generation off until the transaction's reply, and letting
  the engine serve before the check ends would put tokens of unchecked weights under the new
  version's label (or new weights under the old label); the reply's "success" would no longer
  mean "served only checked bytes".
- A reload's sample (and a live apply whose staging prepared none) is read inside the pause,
  through a reader whose headers are cached until the checkpoint's files change
  (``ReaderCache``).

Only proven parameters are sampled: a reload-only or unproven parameter, or one no checkpoint
element lands on, has no expected value the map can rebuild (``not_checkable_params``).
The expected value is rebuilt as the proof does: the checkpoint element through the placement's
box, cast to the parameter's dtype by ``copy_`` (what the loader's copy does), compared bit for
bit. State derived from a parameter (MLA's ``w_kc``/``w_vc``, ``live.mapping.derived``) is no parameter:
``DERIVED_LAYERS_PER_CHECK`` layers drawn afresh (among those a live apply re-derived, or among all
after a reload) are compared whole with the split of their live ``kv_b_proj``, inside the pause,
into a scratch made at the proof (``derived.CompareScratch``). No sglang here.
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, NamedTuple, Optional

import numpy as np
import torch

from .mapping.coordinate_map import CheckpointReader, CoordinateMap, as_int_bits
from .mapping.differ import DifferFlags
from .results import RankCheck

SAMPLE_PER_TENSOR = 4096  # elements drawn per checkpoint tensor and update
# checkpoint tensors sampled per update, drawn afresh each time (a model's few hundred tensors are
# all reached within a few updates): reading a tensor's sample costs about 0.4 ms on this CPU
# (at staging for a live apply), so the sample's cost stays bounded whatever the model's size
SAMPLE_TENSORS_PER_UPDATE = 64
# layers whose derived state is compared whole per update: about 6 ms each for a GLM-4.7-Flash layer
# (4.6M elements) on one CPU thread, so all 47 would cost 0.3 s of the pause there
DERIVED_LAYERS_PER_CHECK = 4
SAMPLE_ENV = "WEIGHTSYNC_UPDATE_CHECK_SAMPLE"  # "<elements per tensor>,<tensors per update>"; "0,0": none


@dataclass
class _Tally:
    compared: int = 0
    mismatches: int = 0
    first: Optional[str] = None
    seconds: float = 0.0
    derived_compared: int = 0  # elements of derived state (live.mapping.derived) compared

    def add(self, where: Callable[[int], str], expected: torch.Tensor, got: torch.Tensor,
            positions: torch.Tensor, dtype: torch.dtype) -> None:
        """``expected``/``got``: the same elements' int bits (host or device)."""
        self.compared += int(got.numel())
        if _equal(got, expected):
            return
        differ = torch.ne(got, expected)
        bad = int(torch.count_nonzero(differ))
        self.mismatches += bad
        if self.first is None and bad:
            k = int(torch.nonzero(differ)[0, 0])
            self.first = (f"{where(k)}: element {int(positions[k])} holds {got[k:k + 1].view(dtype).item()!r}, "
                          f"expected {expected[k:k + 1].view(dtype).item()!r}")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # numpy's comparison of host integers measured 5-10x faster than torch.equal here
    if a.device.type == "cpu" and b.device.type == "cpu":
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return bool(torch.equal(a, b))


def _storage_bits(params: Optional[Mapping[str, torch.Tensor]], name: str, bits: torch.Tensor) -> torch.Tensor:
    """``bits`` (a parameter's storage, flat, as int bits, taken at staging) if the engine's
    parameter ``name`` still is that storage, else the storage it is now: every gather reads what
    the engine reads, so a write into a storage it no longer uses shows up as mismatches.
    ``params`` None: ``bits`` as it is."""
    if params is None:
        return bits
    now = params[name]
    if now.data_ptr() == bits.data_ptr() and now.numel() == bits.numel() and now.element_size() == bits.element_size():
        return bits
    return as_int_bits(now.detach().reshape(-1))  # a copy only if not contiguous (none in sglang)


def sample_seed(version: int, counter: int, rank: str = "") -> list[int]:
    """The sample's seed: fresh for each update (``counter``), and per rank."""
    return [int(version) & 0xFFFFFFFF, int(counter) & 0xFFFFFFFF, zlib.crc32(rank.encode())]


def checkable_params(cmap: CoordinateMap, param_names: Iterable[str]) -> tuple[set[str], set[str]]:
    """``(checked, not checkable)``: proven parameters with placements, and every other one."""
    names = set(param_names)
    mapped = {p.param for ps in cmap.placements.values() for p in ps}
    checked = {n for n in names & mapped & cmap.proven_params if n not in cmap.reload_only_params}
    return checked, names - checked


# --- the sample: drawn and read (at staging), compared (in the pause) -------------------------


@dataclass
class _ParamSample:
    """One parameter's sampled elements: where they are and what they must hold."""

    param: str
    dtype: torch.dtype
    flat: torch.Tensor  # the live parameter's storage, flat, as int bits (a view)
    index: torch.Tensor  # flat positions, on the parameter's device
    expected: torch.Tensor  # int bits, on the parameter's device (a slice of its group's)
    got: torch.Tensor  # the gather's output (a slice of its group's, allocated with the sample)
    runs: list = field(default_factory=list)  # (end, checkpoint tensor): which tensor each position came from

    def source_of(self, k: int) -> str:
        ends = [end for end, _ in self.runs]
        return f"{self.param} (from {self.runs[bisect.bisect_right(ends, k)][1]})"


@dataclass
class _Group:
    """The sampled parameters of one device and element width: their gathers land side by side,
    so one compare covers them all. The compare's scratch is made with the group, at staging:
    on a device a pair of flags set without a reduction (``mapping.differ``), on the host a bool
    per element (numpy's ``!=`` into it); the pause allocates nothing while the check holds."""

    members: list[_ParamSample]
    expected: torch.Tensor
    got: torch.Tensor
    flags: Optional[DifferFlags] = None  # the device path
    host_differs: Optional[np.ndarray] = None  # the host path

    def holds_expected(self) -> bool:
        """Whether ``got`` equals ``expected`` bit for bit (after the gathers into ``got``)."""
        if self.flags is not None:
            self.flags.reset()
            self.flags.mark(0, self.got, self.expected)
            return not bool(self.flags.differing()[0])
        np.not_equal(self.got.numpy(), self.expected.numpy(), out=self.host_differs)
        return not bool(self.host_differs.any())


@dataclass
class PreparedSample:
    """Expected values of one update's sample, ready to compare with the live weights.

    Prepared for a live apply, ``settle_before_pause`` compares it with the live weights at
    staging: the elements that already hold the target's bytes are verified there
    (``before_pause``), and ``groups`` keeps only the others, for the pause."""

    groups: list[_Group] = field(default_factory=list)
    device_path: Optional[bool] = None  # True: compare as on a device even on the CPU (a test); None: by device
    checked: int = 0  # parameters the sample could reach
    unchecked: int = 0
    read_s: float = 0.0  # drawing and reading it (at staging for a live apply)
    before_pause: Optional[_Tally] = None  # what ``settle_before_pause`` verified

    @property
    def params(self) -> list[_ParamSample]:
        return [s for g in self.groups for s in g.members]

    @property
    def elements(self) -> int:
        return sum(int(g.expected.numel()) for g in self.groups)

    def compare(self, params: Optional[Mapping[str, torch.Tensor]] = None) -> _Tally:
        """Gather every sampled element of ``groups`` from the live weights (``params``: the
        engine's parameters now; None: the views taken when prepared) and compare bit for bit:
        one gather per parameter, one compare per device and element width (one synchronisation
        on a device); per parameter only after a mismatch, for the detail (which allocates: every
        rank reloads then)."""
        start = time.perf_counter()
        tally = _Tally()
        for g in self.groups:
            for s in g.members:
                torch.index_select(_storage_bits(params, s.param, s.flat), 0, s.index, out=s.got)
        for g in self.groups:
            if g.holds_expected():
                tally.compared += int(g.got.numel())
                continue
            for s in g.members:
                on_host = s.got.device.type == "cpu"
                tally.add(s.source_of, s.expected if on_host else s.expected.cpu(), s.got if on_host else s.got.cpu(),
                          s.index, s.dtype)
        tally.seconds = time.perf_counter() - start
        return tally

    def settle_before_pause(self, params: Optional[Mapping[str, torch.Tensor]] = None) -> _Tally:
        """At staging, while serving: compare every sampled element with the live weights now.
        Those that hold the target's bytes already are verified (kept as ``before_pause``):
        nothing changes the weights between here and the pause without voiding the staging (the
        weights' generation), and the scatter reads back each element it writes. ``groups``
        keeps the others, which the update must write: the pause compares them after its scatter."""
        start = time.perf_counter()
        tally, pending = _Tally(), []
        for g in self.groups:
            for s in g.members:
                torch.index_select(_storage_bits(params, s.param, s.flat), 0, s.index, out=s.got)
                differ = torch.ne(s.got, s.expected)
                left = int(torch.count_nonzero(differ))
                tally.compared += int(s.index.numel()) - left
                if left:
                    mask = differ.cpu().numpy()
                    pending.append((s.param, s.dtype, s.flat, s.index[differ], s.expected[differ],
                                    _masked_runs(s.runs, mask)))
        self.groups = _grouped(pending, self.device_path)
        tally.seconds = time.perf_counter() - start
        self.before_pause = tally
        return tally


def _grouped(members: list[tuple[str, torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, list]],
             device_path: Optional[bool] = None) -> list[_Group]:
    """``(param, dtype, flat bits, index, expected bits, runs)`` -> groups by device and width,
    each with its compare's scratch (``device_path`` True: the device's, on any device)."""
    by_key: dict[tuple, list] = {}
    for m in members:
        by_key.setdefault((str(m[2].device), m[4].dtype), []).append(m)
    groups = []
    for (device, _), ms in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        expected = torch.cat([m[4] for m in ms]).to(device)
        got = torch.zeros_like(expected)  # written now: the pause takes no first-touch page faults
        out, at = [], 0
        for param, dtype, flat, index, exp, runs in ms:
            n = int(exp.numel())
            out.append(_ParamSample(param, dtype, flat, index.to(device), expected[at:at + n], got[at:at + n], runs))
            at += n
        on_device = device_path if device_path is not None else torch.device(device).type != "cpu"
        groups.append(_Group(out, expected, got, flags=DifferFlags(device, 1, at) if on_device else None,
                             host_differs=None if on_device else np.ones(at, dtype=np.bool_)))
    return groups


def _draw(cmap: CoordinateMap, checked: set[str], rng: np.random.Generator, per_tensor: int,
          max_tensors: Optional[int]) -> list[tuple[str, list, np.ndarray, np.ndarray]]:
    """``(tensor, its checkable boxes, drawn positions, box starts)`` per sampled tensor."""
    tensors = [t for t in sorted(cmap.placements) if any(p.param in checked for p in cmap.placements[t])]
    if max_tensors is not None and len(tensors) > max_tensors:
        tensors = sorted(rng.choice(np.array(tensors, dtype=object), size=max_tensors, replace=False).tolist())
    out = []
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
        out.append((tensor, boxes, drawn, np.concatenate(([0], np.cumsum(counts)))))
    return out


def prepare_sample_steps(
    cmap: CoordinateMap, params: Mapping[str, torch.Tensor], read_values: Callable[[str, np.ndarray], torch.Tensor],
    seed: list[int], per_tensor: int = SAMPLE_PER_TENSOR, max_tensors: Optional[int] = None,
    checked: Optional[set[str]] = None, device_path: Optional[bool] = None,
) -> Generator[None, None, PreparedSample]:
    """Draw up to ``per_tensor`` random elements of each of up to ``max_tensors`` random
    checkpoint tensors' boxes (into checkable parameters) and rebuild the values the parameter
    elements they land on must hold; one step per tensor (``loop_slices``).

    ``read_values(tensor, flat positions)``: those checkpoint elements, in the checkpoint's dtype.
    ``checked``: ``checkable_params``'s first set when the caller has it already (not rebuilt).
    ``device_path``: see ``PreparedSample``."""
    names = list(params)
    if checked is None:
        checked, unchecked = checkable_params(cmap, names)
    else:
        unchecked = set(names) - checked
    spent = 0.0  # only the time inside the steps: a loop slice may wait long between them
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {}  # param -> [(tensor, dst positions, expected values)]
    for tensor, boxes, drawn, starts in _draw(cmap, checked, rng, per_tensor, max_tensors):
        located = []
        for b, p in enumerate(boxes):
            local = drawn[(drawn >= starts[b]) & (drawn < starts[b + 1])] - starts[b]
            if local.size == 0:
                continue
            multi = np.unravel_index(local, p.sizes) if p.sizes else ()
            src = p.src_offset + sum((m * s for m, s in zip(multi, p.src_strides)), np.zeros_like(local))
            dst = p.dst_offset + sum((m * s for m, s in zip(multi, p.dst_strides)), np.zeros_like(local))
            located.append((p.param, src, dst))
        if located:
            values = read_values(tensor, np.concatenate([src for _, src, _ in located]))
            at = 0
            for param, src, dst in located:
                expected = torch.empty(src.size, dtype=params[param].dtype)
                expected.copy_(values[at:at + src.size])  # the cast a load does
                at += src.size
                parts.setdefault(param, []).append((tensor, dst, as_int_bits(expected)))
        spent += time.perf_counter() - t0
        yield
        t0 = time.perf_counter()
    members = []
    for param in sorted(parts):
        live = params[param].detach()
        runs, end = [], 0
        for tensor, dst, _ in parts[param]:
            end += dst.size
            runs.append((end, tensor))
        index = torch.from_numpy(np.concatenate([dst for _, dst, _ in parts[param]]))
        members.append((param, live.dtype, as_int_bits(live.reshape(-1)), index,
                        torch.cat([e for _, _, e in parts[param]]), runs))
    sample = PreparedSample(_grouped(members, device_path), device_path=device_path, checked=len(checked),
                            unchecked=len(unchecked))
    sample.read_s = spent + time.perf_counter() - t0
    return sample


def _masked_runs(runs: list, mask: np.ndarray) -> list:
    """``runs`` (end, tensor) of a member's positions, for the positions ``mask`` keeps."""
    out, start, kept = [], 0, 0
    for end, tensor in runs:
        kept += int(mask[start:end].sum())
        out.append((kept, tensor))
        start = end
    return out


def check_sample(
    cmap: CoordinateMap, params: Mapping[str, torch.Tensor], read_tensor: Callable[[str], torch.Tensor],
    seed: list[int], per_tensor: int = SAMPLE_PER_TENSOR, tally: Optional[_Tally] = None,
    max_tensors: Optional[int] = None, checked: Optional[set[str]] = None,
) -> _Tally:
    """The sample drawn, read through ``read_tensor`` (a checkpoint tensor by name) and compared
    at once (``prepare_sample_steps`` then ``PreparedSample.compare``)."""
    from .loop_slices import drain

    sample = drain(prepare_sample_steps(cmap, params, values_through(read_tensor), seed, per_tensor,
                                        max_tensors, checked))
    found = sample.compare()
    if tally is not None:
        tally.compared += found.compared
        tally.mismatches += found.mismatches
        tally.first = tally.first or found.first
        return tally
    return found


def values_through(read_tensor: Callable[[str], torch.Tensor]) -> Callable[[str, np.ndarray], torch.Tensor]:
    """``read_values`` of ``prepare_sample_steps`` from a reader of whole tensors (a memmap view:
    only the pages of the drawn elements are read)."""
    return lambda name, positions: read_tensor(name).reshape(-1).index_select(0, torch.from_numpy(positions))


# --- the written elements: read back in the scatter, their storage still the engine's at commit ---


def check_scattered(patches: Iterable, tally: Optional[_Tally] = None,
                    params: Optional[Mapping[str, torch.Tensor]] = None) -> _Tally:
    """That every element a live apply wrote (``live.scatter.patch.ParamPatch``) is in a storage the
    engine reads. Reads no element: the scatter read each patch back right after writing it and
    compared it bit for bit with the staged values (``live.scatter.patch.ReadBack``; a commit follows
    only a scatter whose check held), while its lines were still in cache. What can change
    between that read and the commit without a write the sample could catch is the engine
    reading another storage: each patched parameter's current storage (``params``: the engine's
    parameters now) must be the flat view written, same pointer, size and element width; the
    elements of a patch whose storage is not count as mismatches. ``params`` None: nothing to
    compare against (the patches' own views), every written element counts as verified."""
    tally = tally or _Tally()
    start = time.perf_counter()
    for p in patches:
        n = int(p.index.numel())
        if n == 0:
            continue
        tally.compared += n
        if params is None:
            continue
        now = params[p.param]
        if (now.data_ptr() == p.flat.data_ptr() and now.numel() == p.flat.numel()
                and now.element_size() == p.flat.element_size()):
            continue
        tally.mismatches += n
        if tally.first is None:
            tally.first = (f"{p.param} (scattered): the engine reads another storage than the one the live apply "
                           f"wrote ({n} elements; data_ptr {now.data_ptr():#x}, written {p.flat.data_ptr():#x})")
    tally.seconds += time.perf_counter() - start
    return tally


def check_derived(derivations: Mapping, patches: list, seed: list[int], tally: Optional[_Tally] = None,
                  layers: int = DERIVED_LAYERS_PER_CHECK) -> _Tally:
    """The derived state (``live.mapping.derived``) of ``layers`` layers drawn from ``seed`` among those
    ``patches`` wrote (after a reload, no patches: among all), against a re-derivation."""
    from .mapping.derived import check as check_rules

    tally = tally or _Tally()
    names = sorted({p.param for p in patches} & set(derivations)) if patches else sorted(derivations)
    if len(names) > layers:
        names = [names[int(k)] for k in np.random.default_rng(seed).choice(len(names), size=layers, replace=False)]
    compared, bad, first = check_rules(derivations, [_Named(n) for n in names])
    tally.compared += compared
    tally.mismatches += bad
    tally.first = tally.first or first
    return tally


class _Named(NamedTuple):
    param: str


# --- one rank's check after an update ----------------------------------------------------------------


def check_update(
    rank: str, cmap: Optional[CoordinateMap], params: Mapping[str, torch.Tensor],
    read_tensor: Optional[Callable[[str], torch.Tensor]], *, version: int, counter: int,
    patches: Iterable = (), per_tensor: int = SAMPLE_PER_TENSOR, max_tensors: Optional[int] = None,
    still_valid: Callable[[], bool] = lambda: True, prepared: Optional[PreparedSample] = None,
    started: Optional[float] = None,
) -> RankCheck:
    """One rank's check after an update to ``version`` (see the module docstring).

    ``params``: the engine's parameters now (every gather reads through them).
    ``prepared``: the sample's expected values, read at staging (then ``read_tensor`` is not
    used and nothing is read from the checkpoint). ``read_tensor`` None and nothing prepared:
    the checkpoint is not checked (only the scattered elements). ``still_valid``: False when the
    checkpoint changed during the check: the sample then counts for nothing (a pull's new bytes
    are not a mismatch of this version). ``started``: when the caller's part of the check began
    (it counts in ``check_s``)."""
    start = time.perf_counter() if started is None else started
    patches = list(patches)
    scattered = check_scattered(patches, params=params or None)
    if cmap is not None and cmap.derivations:  # counted with the scattered elements' verdict, not their number
        derived = check_derived(cmap.derivations, patches, sample_seed(version, counter, rank))
        scattered.derived_compared = derived.compared
        scattered.mismatches += derived.mismatches
        scattered.first = scattered.first or derived.first
    if prepared is not None:
        return _result(rank, scattered, prepared.compare(params or None), prepared.checked, prepared.unchecked,
                       start, "", prepared_s=prepared.read_s, before_pause=prepared.before_pause)
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
            why: str, prepared_s: float = 0.0, before_pause: Optional[_Tally] = None) -> RankCheck:
    before = before_pause.compared if before_pause else 0  # equal there (the rest waits for the pause)
    sampled = (sample.compared if sample else 0) + before
    mismatches = scattered.mismatches + (sample.mismatches if sample else 0)
    first = scattered.first or (sample.first if sample else None)
    check_s = time.perf_counter() - start
    return RankCheck(
        rank=rank, verified_elements=scattered.compared + scattered.derived_compared + sampled - mismatches,
        mismatches=mismatches,
        sampled_elements=sampled, scattered_elements=scattered.compared, checked_params=checked,
        not_checkable_params=unchecked, check_s=check_s, scattered_check_s=scattered.seconds,
        sample_check_s=check_s - scattered.seconds, sample_prepared_s=prepared_s,
        sample_read_in_pause=sampled > 0 and not prepared_s, detail=first or why,
        sampled_before_pause=before, sample_before_pause_s=before_pause.seconds if before_pause else 0.0,
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


# --- the checkpoint's headers, read once per identity of its files --------------------------------


def files_key(checkpoint_dir: str) -> tuple:
    """What the cached headers depend on: every safetensors and JSON file of the dir, by name,
    device, inode, size and modification time (a file replaced, rewritten or resized changes it)."""
    out = []
    with os.scandir(checkpoint_dir) as entries:
        for e in entries:
            if e.name.endswith((".safetensors", ".json")) and e.is_file():
                st = e.stat()
                out.append((e.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


class ReaderCache:
    """One ``CheckpointReader`` per checkpoint dir, reused only while ``files_key`` is unchanged:
    a stale reader (a seed dir replaced, a reseed) is never used."""

    def __init__(self) -> None:
        self._readers: dict[str, tuple[tuple, CheckpointReader]] = {}
        self.opened = 0  # readers built (each one reads every shard header)

    def reader(self, checkpoint_dir: str) -> CheckpointReader:
        key = files_key(checkpoint_dir)
        held = self._readers.get(checkpoint_dir)
        if held is not None and held[0] == key:
            return held[1]
        reader = CheckpointReader(checkpoint_dir)
        self.opened += 1
        if files_key(checkpoint_dir) == key:  # not changed while its headers were read
            self._readers = {checkpoint_dir: (key, reader)}  # one dir at a time: its maps are freed
        return reader


# --- the scheduler side: what LiveApplyState calls -------------------------------------------------


@dataclass
class _Prepared:
    """What one staging prepared for the check after its commit."""

    version: int
    local_dir: str
    patches: list  # the staged update's own list: the commit passes the same object
    target_key: tuple  # the identity whose bytes the sample was read from (live.identity)
    sample: Optional[PreparedSample]  # None: the pause reads one


class UpdateChecker:
    """One rank's checks: prepared at staging, run after a commit or a reload.

    ``state``: the rank's ``live.state.LiveApplyState`` (its rank, map, live version, params)."""

    def __init__(self) -> None:
        self.readers = ReaderCache()
        self._prepared: Optional[_Prepared] = None
        self.prepare_reason = ""  # why the last staging prepared no sample

    def prepare_steps(self, state: Any, staged: Any) -> Iterator[None]:
        """At staging, while the engine serves (loop slices): the sample of ``staged``'s target
        version read from its verified local checkpoint.
        Never raises: without a prepared sample the check reads the checkpoint inside the
        pause, as a reload's does."""
        import weightsync.puller.positions as positions

        from .identity import key_of_held

        self._prepared = None
        target = getattr(staged, "target", None)
        if target is None:
            self.prepare_reason = "the staged update names no identity"
            return
        want, local_dir = target.key(), staged.local_checkpoint_dir

        def dir_holds_target() -> bool:
            return key_of_held(positions.held_version(local_dir)) == want

        sample = None
        try:
            per_tensor, max_tensors = sample_size()
            cmap = state.cmap
            if cmap is None or not cmap.proven or per_tensor <= 0:
                self.prepare_reason = "no proven coordinate map, or the sample is off"
            elif not dir_holds_target():
                self.prepare_reason = "the local checkpoint does not name the staged version"
            else:
                reader = self.readers.reader(local_dir)
                sample = yield from prepare_sample_steps(
                    cmap, state.params(), values_through(reader.tensor),
                    sample_seed(staged.to_version, next(_counter), state.rank), per_tensor, max_tensors)
                if not dir_holds_target():  # bytes of another version may have been read
                    sample, self.prepare_reason = None, "the local checkpoint changed while the sample was read"
                else:
                    yield
                    sample.settle_before_pause(state.params())
                    self.prepare_reason = ""
            self._prepared = _Prepared(staged.to_version, local_dir, staged.patches, want, sample)
        except Exception as exc:
            self.prepare_reason = f"preparing the check failed: {type(exc).__name__}: {exc}"

    def _take_prepared(self, state: Any, local_dir: str, version: int, patches: Any) -> Optional[_Prepared]:
        """What staging prepared for exactly this commit (the same staged patches, the version
        the weights now claim), once; None otherwise."""
        held, self._prepared = self._prepared, None
        live = state.live
        if (held is None or held.patches is not patches or held.version != version or held.local_dir != local_dir
                or live is None or live.key() != held.target_key):
            return None
        return held

    def after_update(self, state: Any, local_dir: str, version: int, patches: Any = ()) -> RankCheck:
        """Inside the pause, once the rank holds ``version`` (a commit of ``patches``, or a reload
        of ``local_dir``): the written storages still the engine's, and the sample, prepared at
        staging when it was (else read now, through the cached headers). Never raises: a check
        that fails replies ``failed`` (every rank then reloads, as after a mismatch)."""
        started = time.perf_counter()
        try:
            prepared = self._take_prepared(state, local_dir, version, patches)
            if prepared is None or prepared.sample is None:
                return check_after_update(state, local_dir, version, patches, readers=self.readers, started=started)
            return check_update(state.rank, state.cmap, state.params(), None, version=version, counter=0,
                                patches=patches, prepared=prepared.sample, started=started)
        except Exception as exc:
            return RankCheck(rank=state.rank, failed=True, detail=f"the check failed: {type(exc).__name__}: {exc}")


def check_after_update(state, local_dir: str, version: int, patches: Iterable = (),
                       readers: Optional[ReaderCache] = None, started: Optional[float] = None) -> RankCheck:
    """The check of ``live.state.LiveApplyState`` ``state`` once it holds ``version`` (after a
    commit or a reload from ``local_dir``), the sample read now; never raises (a check that fails
    says so). ``readers``: cached headers (a fresh reader otherwise)."""
    import weightsync.puller.positions as positions

    from .identity import key_of_held

    try:
        live = state.live
        want = live.key() if live is not None and live.version == version else None

        def dir_holds_version() -> bool:
            held = positions.held_version(local_dir)
            return want is not None and held is not None and key_of_held(held) == want and not state.pull_is_running()

        per_tensor, max_tensors = sample_size()
        read = None
        if per_tensor > 0 and dir_holds_version():
            read = (readers.reader(local_dir) if readers is not None else CheckpointReader(local_dir)).tensor
        return check_update(state.rank, state.cmap, state.params(), read, version=version, counter=next(_counter),
                            patches=patches, per_tensor=per_tensor, max_tensors=max_tensors,
                            still_valid=dir_holds_version, started=started)
    except Exception as exc:
        return RankCheck(rank=state.rank, failed=True, detail=f"the check failed: {type(exc).__name__}: {exc}")
