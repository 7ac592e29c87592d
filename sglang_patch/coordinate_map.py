"""Where each checkpoint element lives in this rank's engine parameters, learnt from the model's
own ``load_weights`` and then proven against the live weights.

Build (``build_coordinate_map``, once per engine lifetime, on a thread off the scheduler loop):
``model.load_weights`` is driven with *probe* tensors (uninitialised ``torch.empty`` of each
checkpoint tensor's shape and dtype) under a ``TorchDispatchMode`` that is active on the
building thread only. Every ``copy_`` from a view of a probe (or of a plain copy of one) into a
view of a parameter is recorded as one ``Placement``: an affine box (sizes, offset, strides) in
the checkpoint tensor's element space and the same box in the parameter's. Writes into
parameters are never executed (the live weights are untouched); constant fills (the padded
vocab rows) are dropped. The map is O(copy operations), not O(elements): TP narrowing, fused
qkv / gate_up, padded vocab, tied embeddings and per-expert MoE copies are all just boxes.

Anything the recorder cannot follow makes the map refuse rather than guess:
- a parameter written by anything but a probe copy or a constant fill -> reload-only param;
- a probe read by an op that is neither a view nor a plain copy -> reload-only checkpoint tensor.

Proof (``prove_map``, or ``prove_map_steps`` in steps of ``PROOF_STEP_ELEMENTS`` for the
scheduler thread; O(model) once, while serving): every mapped parameter is rebuilt from a
checkpoint that holds the version the live weights hold (the seed dir at start-up) and compared
bit for bit with the live parameter on every mapped element. A parameter the engine transformed
after loading (CPU AMX packing, an MoE weight shuffle, a quantized re-layout, a derived cache),
one that two checkpoint elements land on, or one that is not contiguous fails and becomes
reload-only, with its reason. Only proven parameters are ever patched live.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, NamedTuple, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .live_stage import CARRIER, Placement
from .loop_slices import drain

log = logging.getLogger(__name__)

aten = torch.ops.aten

TORCH_DTYPE_OF = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
# numpy cannot hold bf16: such tensors are read as same-width integers and reinterpreted.
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TensorSpec(NamedTuple):
    """A checkpoint tensor as the map needs it: its name, shape and safetensors dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class CoordinateMap:
    """The placements of one rank, and what must be reloaded rather than patched (with why)."""

    placements: dict[str, list[Placement]] = field(default_factory=dict)  # checkpoint tensor -> boxes
    reload_only_tensors: dict[str, str] = field(default_factory=dict)
    reload_only_params: dict[str, str] = field(default_factory=dict)
    unused_tensors: set[str] = field(default_factory=set)  # the loader ignores them on this rank
    proven_params: set[str] = field(default_factory=set)
    proven: bool = False
    proof_reason: str = "not proven yet"
    build_s: float = 0.0
    proof_s: float = 0.0
    mapped_elements: int = 0  # parameter elements the checkpoint writes on this rank

    def placements_into(self, param: str) -> list[Placement]:
        return [p for ps in self.placements.values() for p in ps if p.param == param]

    def nbytes(self) -> int:
        """Host memory held by the map (the placements and the name tables), in bytes."""
        total = sys.getsizeof(self.placements)
        for name, ps in self.placements.items():
            total += sys.getsizeof(name) + sys.getsizeof(ps)
            for p in ps:
                total += sys.getsizeof(p) + sum(sys.getsizeof(x) for x in p[2:]) + 8 * 3 * len(p.sizes)
        for d in (self.reload_only_tensors, self.reload_only_params):
            total += sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())
        return total

    def placement_count(self) -> int:
        return sum(len(ps) for ps in self.placements.values())

    def why_reload_only(self, tensor: str) -> Optional[str]:
        """Why a change to checkpoint tensor ``tensor`` cannot be patched live, or None."""
        if tensor in self.reload_only_tensors:
            return f"checkpoint tensor {tensor} is reload-only: {self.reload_only_tensors[tensor]}"
        for p in self.placements.get(tensor, ()):
            if p.param in self.reload_only_params:
                return f"parameter {p.param} (loaded from {tensor}) is reload-only: {self.reload_only_params[p.param]}"
            if p.param not in self.proven_params:
                return f"parameter {p.param} (loaded from {tensor}) is not proven against the live weights"
        return None

    def summary(self) -> dict:
        return {
            "placements": self.placement_count(),
            "tensors": len(self.placements),
            "reload_only_tensors": dict(self.reload_only_tensors),
            "reload_only_params": dict(self.reload_only_params),
            "proven_params": len(self.proven_params),
            "proven": self.proven,
            "proof_reason": self.proof_reason,
            "mapped_elements": self.mapped_elements,
            "build_s": round(self.build_s, 4),
            "proof_s": round(self.proof_s, 4),
            "nbytes": self.nbytes(),
        }


# --- build ----------------------------------------------------------------------------------


class _Origin(NamedTuple):
    """How a tracked storage's elements relate to one checkpoint tensor.

    Storage element ``offset + i . strides`` (multi-index ``i`` over ``sizes``) holds checkpoint
    element ``hf_offset + i . hf_strides``. A probe: its own shape, contiguous, identity.
    """

    tensor: str
    itemsize: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    hf_offset: int
    hf_strides: tuple[int, ...]

    @property
    def is_identity(self) -> bool:
        return self.offset == self.hf_offset and self.strides == self.hf_strides


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _decompose(offset: int, sizes: tuple[int, ...], strides: tuple[int, ...]) -> Optional[list[int]]:
    """The multi-index of storage element ``offset`` in a dense layout, or None if it is not one."""
    index = [0] * len(sizes)
    rest = offset
    for d in sorted(range(len(sizes)), key=lambda d: -strides[d]):
        if sizes[d] <= 1 or strides[d] <= 0:
            continue
        i = rest // strides[d]
        if i >= sizes[d]:
            return None
        index[d] = i
        rest -= i * strides[d]
    return index if rest == 0 else None


def _hf_box(origin: _Origin, t: torch.Tensor) -> Optional[tuple[int, tuple[int, ...]]]:
    """``(hf_offset, hf_strides)`` of view ``t`` of a tracked storage, or None if not affine."""
    if t.element_size() != origin.itemsize:
        return None
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if any(n > 1 and s == 0 for n, s in zip(sizes, strides)):
        return None  # a broadcast: one checkpoint element in several places
    if origin.is_identity:
        return t.storage_offset() - origin.offset + origin.hf_offset, strides
    index = _decompose(t.storage_offset() - origin.offset, origin.sizes, origin.strides)
    if index is None:
        return None
    hf_offset = origin.hf_offset + sum(i * h for i, h in zip(index, origin.hf_strides))
    hf_strides = []
    for n, s in zip(sizes, strides):
        if n <= 1:
            hf_strides.append(0)
            continue
        for d in sorted(range(len(origin.sizes)), key=lambda d: -origin.strides[d]):
            od = origin.strides[d]
            if origin.sizes[d] > 1 and od > 0 and s % od == 0 and index[d] + (s // od) * (n - 1) < origin.sizes[d]:
                hf_strides.append((s // od) * origin.hf_strides[d])
                break
        else:
            return None
    return hf_offset, tuple(hf_strides)


def _squeeze(sizes: tuple[int, ...], *stride_lists: tuple[int, ...]) -> tuple:
    keep = [d for d, n in enumerate(sizes) if n != 1]
    return (tuple(sizes[d] for d in keep),) + tuple(tuple(s[d] for d in keep) for s in stride_lists)


class _ParamSlot(NamedTuple):
    name: str
    offset: int
    numel: int


_CONSTANT_FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
_PLAIN_COPIES = {aten.clone.default, aten._to_copy.default, aten.contiguous.default}


class _Recorder(TorchDispatchMode):
    """Records probe -> parameter copies; never lets a write reach a parameter."""

    def __init__(self, params: Mapping[str, torch.Tensor], result: CoordinateMap) -> None:
        super().__init__()
        self.result = result
        self.origins: dict[int, _Origin] = {}
        self.slots: dict[int, list[_ParamSlot]] = {}
        for name, p in params.items():
            ptr = p.untyped_storage().data_ptr()
            self.slots.setdefault(ptr, []).append(_ParamSlot(name, p.storage_offset(), p.numel()))
        self.touched_params: set[str] = set()

    def track_probe(self, spec: TensorSpec, probe: torch.Tensor) -> None:
        shape = tuple(probe.shape)
        strides = _contiguous_strides(shape)
        if probe.numel():
            self.origins[probe.untyped_storage().data_ptr()] = _Origin(
                spec.name, probe.element_size(), shape, strides, 0, 0, strides
            )

    def _param_of(self, t: torch.Tensor) -> Optional[str]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
            return None
        slots = self.slots.get(t.untyped_storage().data_ptr())
        if not slots:
            return None
        off = t.storage_offset()
        for s in slots:
            if s.offset <= off < s.offset + s.numel:
                return s.name
        return None

    def _origin_of(self, t: Any) -> Optional[_Origin]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
            return None
        return self.origins.get(t.untyped_storage().data_ptr())

    def _record_copy(self, dst: torch.Tensor, src: Any, param: str) -> None:
        origin = self._origin_of(src)
        if origin is None:
            self._refuse_param(param, "written by copy_ from a tensor that is not a view of a checkpoint tensor")
            return
        box = _hf_box(origin, src)
        if box is None:
            self._refuse_param(param, f"written from a non-affine view of checkpoint tensor {origin.tensor}")
            self._refuse_tensor(origin.tensor, f"copied into {param} through a non-affine view")
            return
        src_sizes, src_strides = _squeeze(tuple(src.shape), box[1])
        dst_sizes, dst_strides = _squeeze(tuple(dst.shape), tuple(dst.stride()))
        if src_sizes != dst_sizes:
            self._refuse_param(param, f"copy_ broadcasts {origin.tensor} {tuple(src.shape)} into {tuple(dst.shape)}")
            self._refuse_tensor(origin.tensor, f"broadcast into {param}")
            return
        slot_offset = next(s.offset for s in self.slots[dst.untyped_storage().data_ptr()] if s.name == param)
        self.result.placements.setdefault(origin.tensor, []).append(
            Placement(origin.tensor, param, dst_sizes, box[0], src_strides, dst.storage_offset() - slot_offset, dst_strides)
        )
        self.touched_params.add(param)

    def _refuse_param(self, param: str, reason: str) -> None:
        self.result.reload_only_params.setdefault(param, reason)

    def _refuse_tensor(self, tensor: str, reason: str) -> None:
        self.result.reload_only_tensors.setdefault(tensor, reason)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            param = self._param_of(dst)
            if param is not None:
                self._record_copy(dst, src, param)
                return dst  # never write the live weights
            out = func(*args, **kwargs)
            origin = self._origin_of(src)
            if origin is None:
                if dst.numel() and dst.device.type != "meta":
                    self.origins.pop(dst.untyped_storage().data_ptr(), None)
            elif self._origin_of(dst) is None and dst.numel() == src.numel():
                self._track_copy_of(origin, src, dst)
            return out
        written = self._written_args(func, args, kwargs)
        for t in written:
            param = self._param_of(t)
            if param is not None:
                if func not in _CONSTANT_FILLS:
                    self._refuse_param(param, f"written by {func} while loading")
                return t  # never write the live weights
        inputs = [a for a in _tensors_in(args, kwargs) if a.numel() and a.device.type != "meta"]
        tracked = [o for o in (self._origin_of(a) for a in inputs) if o is not None]
        out = func(*args, **kwargs)
        in_ptrs = {a.untyped_storage().data_ptr() for a in inputs}
        fresh = [t for t in _tensors_in((out,), {}) if t.numel() and t.device.type != "meta"
                 and t.untyped_storage().data_ptr() not in in_ptrs]
        for t in fresh:  # new storage: whatever was tracked at that address before is gone
            self.origins.pop(t.untyped_storage().data_ptr(), None)
        for t in written:  # an untracked write into a tracked scratch: it no longer mirrors a checkpoint tensor
            if not tracked and t.numel() and t.device.type != "meta":
                self.origins.pop(t.untyped_storage().data_ptr(), None)
        if not tracked or not fresh:
            return out  # views keep their storage's origin
        if func in _PLAIN_COPIES and len(tracked) == 1 and len(fresh) == 1 and isinstance(args[0], torch.Tensor):
            self._track_copy_of(tracked[0], args[0], fresh[0])
            return out
        for o in tracked:
            self._refuse_tensor(o.tensor, f"read by {func} while loading (not a view or a plain copy)")
        return out

    def _track_copy_of(self, origin: _Origin, src: torch.Tensor, dst: torch.Tensor) -> None:
        box = _hf_box(origin, src)
        if box is None or tuple(src.shape) != tuple(dst.shape):
            return
        self.origins[dst.untyped_storage().data_ptr()] = _Origin(
            origin.tensor, dst.element_size(), tuple(dst.shape), tuple(dst.stride()), dst.storage_offset(), box[0], box[1]
        )

    @staticmethod
    def _written_args(func, args, kwargs) -> list:
        out = []
        try:
            schema_args = func._schema.arguments
        except AttributeError:
            return out
        for i, a in enumerate(schema_args):
            info = a.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(_tensors_in((value,), {}))
        return out


def _tensors_in(args, kwargs) -> Iterator[torch.Tensor]:
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def build_coordinate_map(
    model: torch.nn.Module,
    specs: Iterable[TensorSpec],
    *,
    load_weights: Optional[Callable[[Iterable[tuple[str, torch.Tensor]]], Any]] = None,
) -> CoordinateMap:
    """Learn this rank's placements by driving ``model.load_weights`` with probe tensors.

    Runs on the calling thread only (dispatch modes are thread-local): generation on the
    scheduler thread is unaffected, and no parameter is written.
    """
    start = time.perf_counter()
    result = CoordinateMap()
    params = {name: p.data for name, p in model.named_parameters()}
    recorder = _Recorder(params, result)
    specs = list(specs)

    def probes() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in specs:
            dtype = TORCH_DTYPE_OF.get(spec.dtype)
            if dtype is None:
                result.reload_only_tensors[spec.name] = f"dtype {spec.dtype} has no torch equivalent here"
                continue
            probe = torch.empty(spec.shape, dtype=dtype)
            recorder.track_probe(spec, probe)
            yield spec.name, probe

    with torch.no_grad(), recorder:
        (load_weights or model.load_weights)(probes())
    for name, p in params.items():
        if name in recorder.touched_params and not p.is_contiguous():
            result.reload_only_params.setdefault(name, "not contiguous in memory")
    placed = set(result.placements) | set(result.reload_only_tensors)
    result.unused_tensors = {s.name for s in specs} - placed
    result.mapped_elements = sum(int(np.prod(p.sizes, dtype=np.int64)) for ps in result.placements.values() for p in ps)
    result.build_s = time.perf_counter() - start
    return result


# --- proof ----------------------------------------------------------------------------------


def as_int_bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers, so that comparisons are bit for bit (NaN, -0.0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(INT_OF_WIDTH[t.element_size()])


PROOF_STEP_ELEMENTS = 1 << 18  # elements per step of prove_map_steps: about a millisecond


def prove_map(
    cmap: CoordinateMap,
    live_params: Mapping[str, torch.Tensor],
    read_tensor: Callable[[str], torch.Tensor],
    *,
    still_valid: Callable[[], bool] = lambda: True,
) -> bool:
    """Check every mapped parameter against the live weights, element by element.

    Args:
        live_params: the engine's parameters, holding the same version as ``read_tensor``.
        read_tensor: checkpoint tensor by name (a zero-copy view of the file is fine).
        still_valid: False once the live weights changed during the proof (it is then void).

    Returns:
        True when the proof completed (``cmap.proven_params`` and ``reload_only_params`` set);
        False when ``still_valid`` said the weights moved (nothing recorded).
    """
    return bool(drain(prove_map_steps(cmap, live_params, read_tensor, still_valid=still_valid)))


def prove_map_steps(
    cmap: CoordinateMap,
    live_params: Mapping[str, torch.Tensor],
    read_tensor: Callable[[str], torch.Tensor],
    *,
    still_valid: Callable[[], bool] = lambda: True,
) -> Generator[None, None, bool]:
    """``prove_map`` in steps of at most ``PROOF_STEP_ELEMENTS`` elements (its return value is
    the generator's), so the scheduler thread can run it between loop iterations."""
    start = time.perf_counter()
    by_param: dict[str, list[Placement]] = {}
    for ps in cmap.placements.values():
        for p in ps:
            by_param.setdefault(p.param, []).append(p)
    proven: set[str] = set()
    failed: dict[str, str] = {}
    cache: dict[str, torch.Tensor] = {}
    for name, placements in by_param.items():
        if name in cmap.reload_only_params:
            continue
        live = live_params[name]
        reason = yield from _prove_param(live, placements, lambda t: cache.setdefault(t, read_tensor(t)))
        cache.clear()
        if reason is None:
            proven.add(name)
        else:
            failed[name] = reason
    if not still_valid():
        return False
    cmap.proven_params = proven
    for name, reason in failed.items():
        cmap.reload_only_params.setdefault(name, reason)
    cmap.proven = True
    cmap.proof_s = time.perf_counter() - start
    cmap.proof_reason = f"{len(proven)} parameter(s) proven, {len(cmap.reload_only_params)} reload-only"
    return True


def _prove_param(
    live: torch.Tensor, placements: list[Placement], tensor: Callable[[str], torch.Tensor]
) -> Generator[None, None, Optional[str]]:
    if not live.is_contiguous():
        return "not contiguous in memory"
    flat = live.detach().reshape(-1)
    if flat.device.type == "cpu":
        live_cpu = flat
    else:  # a device parameter comes to host memory a step at a time, not in one long copy
        live_cpu = torch.empty(flat.numel(), dtype=flat.dtype)
        for a in range(0, flat.numel(), PROOF_STEP_ELEMENTS):
            live_cpu[a : a + PROOF_STEP_ELEMENTS].copy_(flat[a : a + PROOF_STEP_ELEMENTS])
            yield
    expected = torch.empty_like(live_cpu)
    hits = torch.zeros(live_cpu.numel(), dtype=torch.int8)
    for p in placements:
        src = tensor(p.tensor).reshape(-1)
        box = src.as_strided(p.sizes, p.src_strides, src.storage_offset() + p.src_offset)
        into = expected.as_strided(p.sizes, p.dst_strides, p.dst_offset)
        counted = hits.as_strided(p.sizes, p.dst_strides, p.dst_offset)
        if not p.sizes:  # a scalar box
            into.copy_(box)
            counted.add_(1)
            continue
        rows = max(1, PROOF_STEP_ELEMENTS // max(1, math.prod(p.sizes[1:])))
        for a in range(0, p.sizes[0], rows):
            into[a : a + rows].copy_(box[a : a + rows])
            counted[a : a + rows].add_(1)
            yield
    overlaps = differ = mapped = 0
    expected_bits, live_bits = as_int_bits(expected), as_int_bits(live_cpu)
    for a in range(0, live_cpu.numel(), PROOF_STEP_ELEMENTS):
        b = a + PROOF_STEP_ELEMENTS
        h = hits[a:b]
        mask = h > 0
        if int(h.max()) > 1:
            overlaps += int(torch.count_nonzero(h > 1))
        mapped += int(torch.count_nonzero(mask))
        differ += int(torch.count_nonzero((expected_bits[a:b] != live_bits[a:b]) & mask))
        yield
    if overlaps:
        return f"{overlaps} element(s) are written by more than one checkpoint element"
    if differ:
        return (
            f"live values differ from the checkpoint on {differ} of {mapped} mapped element(s): "
            "transformed after loading (e.g. repacked, shuffled, quantized or derived)"
        )
    return None


# --- reading checkpoint tensors ---------------------------------------------------------------


def tensor_from_file(path: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only, zero-copy view of one safetensors tensor (through a numpy memmap)."""
    torch_dtype = TORCH_DTYPE_OF[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    count = nbytes // itemsize
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    arr = np.memmap(path, dtype=CARRIER[itemsize], mode="r", offset=offset, shape=(count,))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: nobody writes through it
        t = torch.from_numpy(arr)
    return t.view(torch_dtype).reshape(shape)


class CheckpointReader:
    """Checkpoint tensors by name from a local HF checkpoint dir (headers read once)."""

    def __init__(self, checkpoint_dir: str) -> None:
        from weightsync.manifest import checkpoint_weight_files
        from weightsync.safetensors_io import local_tensor_table

        self.checkpoint_dir = checkpoint_dir
        self.table = local_tensor_table(checkpoint_dir, checkpoint_weight_files(checkpoint_dir))

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, tuple(e.shape), e.dtype) for name, (_, e) in sorted(self.table.items())]

    def tensor(self, name: str) -> torch.Tensor:
        path, e = self.table[name]
        return tensor_from_file(path, e.offset, e.nbytes, e.dtype, tuple(e.shape))

