"""Where each checkpoint element lives in this rank's engine parameters, learnt from the model's
own ``load_weights`` and then proven against the live weights.

Build (``build_coordinate_map``, once per engine lifetime, on a thread off the scheduler loop):
the loader runs on a *storage-free copy* of the module tree (``storage_free_copy``: every
parameter, buffer and tensor attribute a meta tensor of the same shape), never on the serving
model, so whatever a loader does besides copying (post-load compute, ``param.data`` swaps,
attributes it sets) happens on the copy. It is driven with meta *probe* tensors of each
checkpoint tensor's shape and dtype (no memory) under a ``TorchDispatchMode`` active on the
building thread only. Every ``copy_`` from a view of a probe (or of a plain copy of one) into a
view of a parameter is recorded as one ``Placement``: an affine box (sizes, offset, strides) in
the checkpoint tensor's element space and the same box in the parameter's. Writes into
parameters are never executed; constant fills (the padded vocab rows) are dropped. The map is
O(copy operations), not O(elements): TP narrowing, fused qkv / gate_up, padded vocab, tied
embeddings and per-expert MoE copies are all just boxes, and a copy from a ``torch.cat`` of
checkpoint tensors along rows (MLA's fused ``q_a_proj`` + ``kv_a_proj_with_mqa``) one box per part.

The map covers exactly what it can follow; everything else is reload-only, with its reason:
- a parameter written by anything but a probe copy or a constant fill;
- a checkpoint tensor read by an op that is neither a view nor a plain copy, read as a number
  (``.item()``: sglang's ``default_weight_loader`` fills one-element parameters that way), loaded
  into a buffer, kept as a module attribute, or read without reaching any parameter;
- a parameter whose value the loader reads (a parameter copied from it, a tensor derived after
  the copies), unless the read is inside ``post_load_weights`` and a rule of ``live.mapping.derived``
  re-derives that state live (MLA's ``w_kc``/``w_vc`` from an unquantized ``kv_b_proj``), proven
  against the live weights with the map.
A checkpoint tensor the loader never looks at is "unused": a reload ignores it too.

Proof (``prove_map``, or ``prove_map_steps`` in steps of ``PROOF_STEP_ELEMENTS`` for the
scheduler thread; O(model) time, O(step) host memory): every mapped element of every parameter
is compared bit for bit with the checkpoint that holds the version the live weights hold (the
seed dir at start-up), one block at a time. A parameter the engine transformed after loading
(CPU AMX packing, an MoE weight shuffle, a quantized re-layout, a derived cache), one that two
checkpoint elements land on, or one that is not contiguous fails and becomes reload-only, with
its reason. Only proven parameters are ever patched live. ``ProofAttempts`` bounds how often
the proof repeats after reloads (one at a time, one per checkpoint identity).
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, NamedTuple, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..loop_slices import drain
from .stage import CARRIER, Placement

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
    live_writes: set[str] = field(default_factory=set)  # serving parameters the loader tried to write (never executed)
    proven: bool = False
    proof_reason: str = "not proven yet"
    build_s: float = 0.0
    proof_s: float = 0.0
    mapped_elements: int = 0  # parameter elements the checkpoint writes on this rank
    # parameters that post_load_weights derives other state from, under a rule (``live.mapping.derived``):
    # parameter -> the module holding that state; live only once ``derivations`` holds its proven rule
    derived_params: dict[str, str] = field(default_factory=dict)
    derivations: dict[str, Any] = field(default_factory=dict)  # parameter -> bound rule (set by the proof)

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
            if p.param in self.derived_params:
                rule = self.derivations.get(p.param)
                why = "its derived state has no proven rule" if rule is None else rule.why_not_current()
                if why is not None:
                    return f"parameter {p.param} (loaded from {tensor}) is reload-only: {why}"
        return None

    def summary(self) -> dict:
        return {
            "placements": self.placement_count(),
            "tensors": len(self.placements),
            "reload_only_tensors": dict(self.reload_only_tensors),
            "reload_only_params": dict(self.reload_only_params),
            "proven_params": len(self.proven_params),
            "unused_tensors": len(self.unused_tensors),
            "learnt_on": "a storage-free copy of the module tree (meta tensors)",
            "proven": self.proven,
            "proof_reason": self.proof_reason,
            "mapped_elements": self.mapped_elements,
            "derived": {p: self.derived_params[p] for p in sorted(self.derivations)},
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


def _sid(t: torch.Tensor) -> int:
    """Which storage ``t`` views: the storage object's address, which meta tensors (all at data
    pointer 0) have too, and which every view of one storage shares."""
    return t.untyped_storage()._cdata


class _Slot(NamedTuple):
    name: str
    offset: int
    numel: int
    kind: str  # "param": a parameter of the copy; "buffer": other state of the copy; "live": the serving model's


_CONSTANT_FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
_PLAIN_COPIES = {aten.clone.default, aten._to_copy.default, aten.contiguous.default}
# reads that turn tensor data into a Python value (.item(), bool(t), torch.equal): a meta tensor
# has no data, and a value read this way is never a copy the map can follow
_DATA_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
# ops that take a tensor's shape, dtype and device only, never its values
_SHAPE_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}


class _Recorder(TorchDispatchMode):
    """Records probe -> parameter copies on the storage-free copy; never lets a write reach a
    parameter, and refuses every other way a checkpoint tensor or a parameter's value is used."""

    def __init__(self, params: Mapping[str, torch.Tensor], result: CoordinateMap, *,
                 buffers: Optional[Mapping[str, torch.Tensor]] = None,
                 live: Optional[Mapping[str, torch.Tensor]] = None,
                 derivable: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {})) -> None:
        super().__init__()
        self.result = result
        # inside post_load_weights (``deriving``), a read of a ``derivable[0]`` parameter is the
        # derivation a rule repeats (``live.mapping.derived``); ``derivable[1]``: why the others cannot be
        self.derivable, self.not_derivable = derivable
        self.deriving = False
        self.origins: dict[int, _Origin] = {}
        # storage -> its segments: a torch.cat of checkpoint tensors along dim 0 (sglang fuses
        # q_a_proj and kv_a_proj_with_mqa so), each segment an origin in the same storage
        self.stacks: dict[int, list[_Origin]] = {}
        self.slots: dict[int, list[_Slot]] = {}
        for kind, tensors in (("param", params), ("buffer", buffers or {}), ("live", live or {})):
            for name, p in tensors.items():
                if p.numel():
                    self.slots.setdefault(_sid(p), []).append(_Slot(name, p.storage_offset(), p.numel(), kind))
        self.touched_params: set[str] = set()
        self.read_tensors: set[str] = set()  # checkpoint tensors any op looked at
        self.probes: list[torch.Tensor] = []  # meta: they hold no memory

    def track_probe(self, spec: TensorSpec, probe: torch.Tensor) -> None:
        shape = tuple(probe.shape)
        strides = _contiguous_strides(shape)
        if probe.numel():
            self.origins[_sid(probe)] = _Origin(spec.name, probe.element_size(), shape, strides, 0, 0, strides)
            self.probes.append(probe)  # alive until the build ends: no later storage reuses its address

    def _slot_of(self, t: Any) -> Optional[_Slot]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        slots = self.slots.get(_sid(t))
        if not slots:
            return None
        off = t.storage_offset()
        for s in slots:
            if s.offset <= off < s.offset + s.numel:
                return s
        return None

    def _origin_of(self, t: Any) -> Optional[_Origin]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        return self.origins.get(_sid(t))

    def _stack_of(self, t: Any) -> list[_Origin]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return []
        return self.stacks.get(_sid(t), [])

    def _forget(self, t: torch.Tensor) -> None:
        self.origins.pop(_sid(t), None)
        self.stacks.pop(_sid(t), None)

    def _track_cat(self, args, kwargs, out: torch.Tensor, tracked: list[_Origin]) -> None:
        """``out = torch.cat(parts, 0)`` of views of checkpoint tensors: one segment per part, each
        an affine origin in ``out``'s storage; any other cat reads its inputs (refused)."""
        parts = [t for t in args[0] if t.numel()]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        segments: list[_Origin] = []
        row = 0
        ok = out.dim() > 0 and dim % out.dim() == 0 and out.is_contiguous() and out.numel()
        for t in parts if ok else ():
            origin = self._origin_of(t)
            box = _hf_box(origin, t) if origin is not None else None
            if box is None or t.dtype != out.dtype or tuple(t.shape[1:]) != tuple(out.shape[1:]):
                ok = False
                break
            segments.append(_Origin(origin.tensor, out.element_size(), tuple(t.shape), tuple(out.stride()),
                                    out.storage_offset() + row * out.stride(0), box[0], box[1]))
            row += t.shape[0]
        if not ok or row != out.shape[0]:
            for o in tracked:
                self._refuse_tensor(o.tensor, "read by aten.cat in a layout the map cannot follow")
            return
        self.stacks[_sid(out)] = segments
        self.probes.append(out)  # alive until the build ends: no later storage reuses its address

    def _record_stack_copy(self, dst: torch.Tensor, src: torch.Tensor, param: str, segments: list[_Origin]) -> None:
        """A copy from a view of a cat's output: cut, along dim 0, into one copy per segment."""
        rows = src.shape[0] if src.dim() else 0
        s0 = src.stride(0) if src.dim() else 0
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(src.shape[1:], src.stride()[1:]) if n)
        covered = 0
        if tuple(src.shape) == tuple(dst.shape) and rows and s0 >= span:
            off = src.storage_offset()
            for o in segments:
                lo, hi = o.offset, o.offset + math.prod(o.sizes)
                first = max(0, -((off - lo) // s0))  # ceil((lo - off) / s0)
                end = min(rows, (hi - span - off) // s0 + 1)
                if first < end:
                    self._record_copy(dst[first:end], src[first:end], param, origin=o)
                    covered += end - first
        if covered != rows:
            self._refuse_param(param, "written from a cat of checkpoint tensors in a way the map cannot cut")
            for o in segments:
                self._refuse_tensor(o.tensor, f"copied into {param} through a cat the map cannot cut")

    def _record_copy(self, dst: torch.Tensor, src: Any, param: str, origin: Optional[_Origin] = None) -> None:
        if origin is None and self._stack_of(src):
            self._record_stack_copy(dst, src, param, self._stack_of(src))
            return
        origin = origin or self._origin_of(src)
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
        slot_offset = next(s.offset for s in self.slots[_sid(dst)] if s.name == param)
        self.result.placements.setdefault(origin.tensor, []).append(
            Placement(origin.tensor, param, dst_sizes, box[0], src_strides, dst.storage_offset() - slot_offset, dst_strides)
        )
        self.touched_params.add(param)

    def _refuse_param(self, param: str, reason: str) -> None:
        self.result.reload_only_params.setdefault(param, reason)

    def _refuse_tensor(self, tensor: str, reason: str) -> None:
        self.result.reload_only_tensors.setdefault(tensor, reason)

    def _write_into(self, slot: _Slot, func: Any, sources: list[_Origin]) -> None:
        """A write by ``func`` into a parameter or buffer (never executed). ``sources``: the
        checkpoint tensors among its inputs."""
        if slot.kind == "live":
            self.result.live_writes.add(slot.name)
            self._refuse_param(slot.name, f"the loader wrote the serving model's parameter ({func}) while the map was learnt")
        elif slot.kind == "buffer":
            for o in sources:
                self._refuse_tensor(o.tensor, f"loaded into {slot.name}, state that is not a parameter (live apply patches parameters only)")
        elif sources:  # a fill from a checkpoint value: one element read as a number, not a copy
            self._refuse_param(slot.name, f"written by {func} from checkpoint tensor {sources[0].tensor}")
            for o in sources:
                self._refuse_tensor(o.tensor, f"written into {slot.name} by {func}, not a copy")
        elif func not in _CONSTANT_FILLS:
            self._refuse_param(slot.name, f"written by {func} while loading")

    def _refuse_reads_of_params(self, func: Any, args, kwargs, written: list) -> None:
        """A parameter whose value an op reads while loading (not a view, not the op's own
        output) feeds state a live patch would leave stale: another parameter copied from it,
        or a tensor derived after the copies (DeepSeek's MLA ``w_kc``/``w_vc`` from ``kv_b_proj``)."""
        written_ids = {id(t) for t in written}
        for t in _tensors_in(args, kwargs):
            if id(t) in written_ids:
                continue
            slot = self._slot_of(t)
            if slot is not None and slot.kind == "param":
                if self.deriving and slot.name in self.derivable:
                    self.result.derived_params[slot.name] = self.derivable[slot.name]
                    continue
                if self.deriving and slot.name in self.not_derivable:
                    self._refuse_param(slot.name, self.not_derivable[slot.name])
                    continue
                self._refuse_param(slot.name, f"its value is read by {func} while loading: state derived from it "
                                              "(a copy into another parameter, a post-load cache) would go stale")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:
            out = func(*args, **kwargs)
            self._forget(out)
            return out
        inputs = [a for a in _tensors_in(args, kwargs) if a.numel()]
        tracked = [o for o in (self._origin_of(a) for a in inputs) if o is not None]
        tracked += [o for a in inputs for o in self._stack_of(a)]
        self.read_tensors.update(o.tensor for o in tracked)
        if func is aten.cat.default and tracked and not any(self._slot_of(a) for a in inputs):
            out = func(*args, **kwargs)
            self._forget(out)
            self._track_cat(args, kwargs, out, tracked)
            return out
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            self._refuse_reads_of_params(func, (src,), {}, [])
            slot = self._slot_of(dst)
            if slot is not None:
                if slot.kind == "param":
                    self._record_copy(dst, src, slot.name)
                else:
                    self._write_into(slot, func, [o for o in (self._origin_of(src),) if o is not None]
                                     + self._stack_of(src))
                return dst  # never write a parameter
            out = func(*args, **kwargs)
            for o in self._stack_of(src):
                self._refuse_tensor(o.tensor, "copied out of a cat into a tensor that is not a parameter")
            origin = self._origin_of(src)
            if origin is None:
                if dst.numel():
                    self._forget(dst)
            elif self._origin_of(dst) is None and dst.numel() == src.numel():
                self._track_copy_of(origin, src, dst)
            return out
        written = self._written_args(func, args, kwargs)
        if not getattr(func, "is_view", False):  # a view of a parameter reads nothing yet
            self._refuse_reads_of_params(func, args, kwargs, written)
        for t in written:
            slot = self._slot_of(t)
            if slot is not None:
                self._write_into(slot, func, [o for o in tracked if o is not self._origin_of(t)])
                return t  # never write a parameter
        if func in _DATA_READS and any(a.device.type == "meta" for a in inputs):
            if any(a.device.type == "meta" and self._origin_of(a) is None and not self._stack_of(a) for a in inputs):
                # the branch the loader takes may depend on a value that a storage-free copy lacks
                raise MapNotLearnable(f"the loader reads the value of a parameter or other state ({func}) while "
                                      "loading; the map cannot be learnt without the serving model's data")
            for o in tracked:
                self._refuse_tensor(o.tensor, f"read as a value by {func} (e.g. .item() of a one-element tensor "
                                              "filled into a parameter): no copy to map")
            return _placeholder(func, inputs)
        out = func(*args, **kwargs)
        if func in _DATA_READS:
            for o in tracked:
                self._refuse_tensor(o.tensor, f"read as a value by {func}: no copy to map")
            return out
        in_sids = {_sid(a) for a in inputs}
        outs = [t for t in _tensors_in((out,), {}) if t.numel()]
        fresh = [t for t in outs if _sid(t) not in in_sids]
        for t in fresh:  # new storage: whatever was tracked at that address before is gone
            self._forget(t)
        for t in written:
            for o in self._stack_of(t):
                self._refuse_tensor(o.tensor, f"changed in place by {func} while loading")
            if t.numel():
                self.stacks.pop(_sid(t), None)
            changed = self._origin_of(t)
            if changed is not None:  # computed in place: it no longer mirrors its checkpoint tensor
                self._refuse_tensor(changed.tensor, f"changed in place by {func} while loading")
                self.origins.pop(_sid(t), None)
        if not tracked:
            return out
        if func in _PLAIN_COPIES and len(tracked) == 1 and len(fresh) == 1 and isinstance(args[0], torch.Tensor):
            self._track_copy_of(tracked[0], args[0], fresh[0])
            return out
        if not written and outs and not fresh:
            return out  # views (and other aliases) keep their storage's origin
        for o in tracked:
            self._refuse_tensor(o.tensor, f"read by {func} while loading (not a view or a plain copy)")
        return out

    def _track_copy_of(self, origin: _Origin, src: torch.Tensor, dst: torch.Tensor) -> None:
        box = _hf_box(origin, src)
        if box is None or tuple(src.shape) != tuple(dst.shape):
            self._refuse_tensor(origin.tensor, "copied through a layout the map cannot follow")
            return
        self.origins[_sid(dst)] = _Origin(
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


def _placeholder(func: Any, inputs: list) -> Any:
    """What a data read of a meta tensor returns while learning (its tensors are refused)."""
    if func is aten._local_scalar_dense.default:
        dtype = inputs[0].dtype if inputs else torch.float32
        return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
    return func is aten.equal.default  # equal: "the same"; is_nonzero: False


def _tensors_in(args, kwargs) -> Iterator[torch.Tensor]:
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


# --- the storage-free copy ----------------------------------------------------------------------


class MapNotLearnable(RuntimeError):
    """The map cannot be learnt without touching the serving model (live apply reloads, saying this)."""


class StorageFreeCopyError(MapNotLearnable):
    """The module tree could not be copied without storage."""


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def storage_free_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree whose parameters, buffers and tensor attributes are meta
    tensors of the same shapes, strides and dtypes (no memory), sharing everything else.

    A loader run on it (``load_weights``, its weight loaders, a ``post_load_weights``) sees the
    same structure and attributes, and anything it computes, swaps (``param.data = ...``) or
    stores lands on the copy, never on the serving model. Bound methods kept on modules or
    parameters (sglang's ``param.weight_loader``) are re-bound to the copy of their module.
    """
    memo: dict[int, Any] = {}

    def param(p: torch.nn.Parameter) -> torch.nn.Parameter:
        if id(p) not in memo:
            new = torch.nn.Parameter(_meta_like(p), requires_grad=False)
            if type(p) is not torch.nn.Parameter:
                try:
                    new.__class__ = type(p)
                except TypeError as exc:
                    raise StorageFreeCopyError(f"parameter type {type(p).__name__} cannot be copied: {exc}") from exc
            new.__dict__.update(p.__dict__)
            memo[id(p)] = new
        return memo[id(p)]

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return param(t)
        if id(t) not in memo:
            memo[id(t)] = _meta_like(t)
        return memo[id(t)]

    def module(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new = copy.copy(m)
        memo[id(m)] = new
        new.__dict__["_parameters"] = {k: (param(v) if v is not None else None) for k, v in m._parameters.items()}
        new.__dict__["_buffers"] = {k: (tensor(v) if v is not None else None) for k, v in m._buffers.items()}
        new.__dict__["_modules"] = {k: (module(v) if v is not None else None) for k, v in m._modules.items()}
        return new

    def rebind(value: Any) -> Any:
        if isinstance(value, torch.nn.Module):
            return module(value)
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, types.MethodType) and isinstance(value.__self__, torch.nn.Module):
            return types.MethodType(value.__func__, module(value.__self__))
        if type(value) in (list, tuple) and any(isinstance(v, (torch.nn.Module, torch.Tensor, types.MethodType)) for v in value):
            return type(value)(rebind(v) for v in value)
        return value

    try:
        root = module(model)
        for new in list(root.modules()):
            for k, v in list(new.__dict__.items()):
                if k not in ("_parameters", "_buffers", "_modules"):
                    new.__dict__[k] = rebind(v)
        for p in [memo[id(p)] for p in model.parameters() if id(p) in memo]:
            for k, v in list(p.__dict__.items()):
                p.__dict__[k] = rebind(v)
    except StorageFreeCopyError:
        raise
    except Exception as exc:
        raise StorageFreeCopyError(f"{type(exc).__name__}: {exc}") from exc
    return root


def build_coordinate_map(model: torch.nn.Module, specs: Iterable[TensorSpec],
                         derivable: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {})) -> CoordinateMap:
    """Learn this rank's placements by driving ``load_weights`` of a storage-free copy of
    ``model`` (``storage_free_copy``) with storage-free probe tensors.

    Nothing runs on the serving model: its parameters are never written (a write that reaches
    one anyway is not executed and makes that parameter reload-only), and whatever the loader
    computes or swaps afterwards lands on the copy. Runs on the calling thread only (dispatch
    modes are thread-local), so generation on the scheduler thread is unaffected.

    ``derivable`` (``live.mapping.derived.derivable_params``): parameters whose reads inside the model's
    ``post_load_weights`` are a derivation a rule repeats live (``derived_params``), and why the
    others' are not; without it every such read makes the parameter reload-only.

    Raises:
        MapNotLearnable: the module tree cannot be copied without storage, or the loader needs the
            data of something that has none there (no map: every update reloads, saying why).
    """
    start = time.perf_counter()
    result = CoordinateMap()
    shadow = storage_free_copy(model)
    params = {name: p for name, p in shadow.named_parameters()}
    buffers = {f"buffer {name}": b for name, b in shadow.named_buffers()}
    live = {name: p.data for name, p in model.named_parameters()}
    recorder = _Recorder(params, result, buffers=buffers, live=live, derivable=derivable)
    specs = list(specs)
    _mark_post_load(shadow, recorder)

    def probes() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in specs:
            dtype = TORCH_DTYPE_OF.get(spec.dtype)
            if dtype is None:
                result.reload_only_tensors[spec.name] = f"dtype {spec.dtype} has no torch equivalent here"
                continue
            probe = torch.empty(spec.shape, dtype=dtype, device="meta")
            recorder.track_probe(spec, probe)
            yield spec.name, probe

    storages = {name: _sid(p) for name, p in params.items()}
    with torch.no_grad(), recorder:
        shadow.load_weights(probes())
    _refuse_kept_probes(shadow, recorder)
    for name, p in shadow.named_parameters():
        origin = recorder._origin_of(p)
        if origin is not None:  # param.data = the checkpoint tensor: no copy, and a reload re-points it
            recorder._refuse_tensor(origin.tensor, f"became the storage of parameter {name} (no copy)")
            recorder._refuse_param(name, f"its storage was replaced by checkpoint tensor {origin.tensor} while loading")
        elif name in storages and _sid(p) != storages[name]:
            recorder._refuse_param(name, "its storage was replaced while loading (a param.data swap): a reload re-points it")
    for name, p in params.items():
        if name in recorder.touched_params and not p.is_contiguous():
            result.reload_only_params.setdefault(name, "not contiguous in memory")
    for name in recorder.read_tensors - set(result.placements) - set(result.reload_only_tensors):
        result.reload_only_tensors[name] = "read by the loader but copied into no parameter (state live apply cannot patch)"
    placed = set(result.placements) | set(result.reload_only_tensors)
    result.unused_tensors = {s.name for s in specs} - placed  # never looked at: a reload ignores them too
    result.mapped_elements = sum(int(np.prod(p.sizes, dtype=np.int64)) for ps in result.placements.values() for p in ps)
    result.build_s = time.perf_counter() - start
    return result


def _mark_post_load(shadow: torch.nn.Module, recorder: _Recorder) -> None:
    """The copy's ``post_load_weights`` (an attribute of the copy only) marks its reads as a
    derivation's (``_Recorder.deriving``)."""
    post_load = getattr(shadow, "post_load_weights", None)
    if not callable(post_load):
        return

    def marked(*args, **kwargs):
        recorder.deriving = True
        try:
            return post_load(*args, **kwargs)
        finally:
            recorder.deriving = False

    shadow.__dict__["post_load_weights"] = marked


def _refuse_kept_probes(shadow: torch.nn.Module, recorder: _Recorder) -> None:
    """A checkpoint tensor (or a copy of one) that the loader kept as a module attribute is
    state no parameter patch reaches: reload-only."""
    for mod_name, m in shadow.named_modules():
        for k, v in m.__dict__.items():
            for t in _tensors_in((v,), {}) if isinstance(v, (torch.Tensor, list, tuple)) else ():
                for origin in [recorder._origin_of(t)] + recorder._stack_of(t):
                    if origin is not None:
                        recorder._refuse_tensor(origin.tensor, f"kept by the loader as {mod_name or 'model'}.{k}")


# --- proof ----------------------------------------------------------------------------------


def as_int_bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers, so that comparisons are bit for bit (NaN, -0.0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(INT_OF_WIDTH[t.element_size()])


PROOF_STEP_ELEMENTS = 1 << 18  # elements per step of prove_map_steps: about a millisecond
# placements of one parameter that interleave in memory (rare: none in the allow-listed models)
# are checked for overlaps with a one-byte counter over their span, at most this many elements
OVERLAP_SPAN_LIMIT = 1 << 24


def prove_map(
    cmap: CoordinateMap,
    live_params: Mapping[str, torch.Tensor],
    read_tensor: Callable[[str], torch.Tensor],
    *,
    still_valid: Callable[[], bool] = lambda: True,
    prove_derived: Optional[Callable[[Mapping[str, str], list], Generator[None, None, dict]]] = None,
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
    return bool(drain(prove_map_steps(cmap, live_params, read_tensor, still_valid=still_valid,
                                      prove_derived=prove_derived)))


def prove_map_steps(
    cmap: CoordinateMap,
    live_params: Mapping[str, torch.Tensor],
    read_tensor: Callable[[str], torch.Tensor],
    *,
    still_valid: Callable[[], bool] = lambda: True,
    prove_derived: Optional[Callable[[Mapping[str, str], list], Generator[None, None, dict]]] = None,
) -> Generator[None, None, bool]:
    """``prove_map`` in steps of at most ``PROOF_STEP_ELEMENTS`` elements (its return value is
    the generator's), so the scheduler thread can run it between loop iterations.

    Host memory is bounded by the step, not by the model: each step compares one block of one
    placement (the checkpoint's values cast to the parameter's dtype, and the live block, brought
    to the host when the parameter lives on a device); nothing the size of a parameter is held.

    ``prove_derived(derived_params, names)`` (``live.mapping.derived.prover``): for the proven parameters
    of ``cmap.derived_params``, each one's bound rule, or why it is not proven (a string). A
    derived parameter without one is reload-only.
    """
    start = time.perf_counter()
    by_param: dict[str, list[Placement]] = {}
    for ps in cmap.placements.values():
        for p in ps:
            by_param.setdefault(p.param, []).append(p)
    proven: set[str] = set()
    failed: dict[str, str] = {}
    for name, placements in by_param.items():
        if name in cmap.reload_only_params:
            continue
        reason = yield from _prove_param(live_params[name], placements, read_tensor)
        if reason is None:
            proven.add(name)
        else:
            failed[name] = reason
    derivations: dict[str, Any] = {}
    derived = sorted(proven & set(cmap.derived_params))
    rules = (yield from prove_derived(cmap.derived_params, derived)) if prove_derived is not None and derived else {}
    for name in derived:
        rule = rules.get(name, "its value is read by post_load_weights and no rule re-derives that state")
        if isinstance(rule, str):
            proven.discard(name)
            failed[name] = rule
        else:
            derivations[name] = rule
    if not still_valid():
        return False
    cmap.derivations = derivations
    cmap.proven_params = proven
    for name, reason in failed.items():
        cmap.reload_only_params.setdefault(name, reason)
    cmap.proven = True
    cmap.proof_s = time.perf_counter() - start
    cmap.proof_reason = f"{len(proven)} parameter(s) proven, {len(cmap.reload_only_params)} reload-only"
    return True


def _span(p: Placement) -> tuple[int, int]:
    """The first and last parameter element a placement's box touches."""
    lo = p.dst_offset + sum(min(0, (n - 1) * s) for n, s in zip(p.sizes, p.dst_strides))
    hi = p.dst_offset + sum(max(0, (n - 1) * s) for n, s in zip(p.sizes, p.dst_strides))
    return lo, hi


def _is_injective(p: Placement) -> bool:
    """A sufficient test that no two elements of the box land on one parameter element: each
    stride (smallest first) steps past everything the smaller ones reach."""
    reach = 0
    for n, s in sorted(((n, abs(s)) for n, s in zip(p.sizes, p.dst_strides) if n > 1), key=lambda x: x[1]):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _overlap_steps(placements: list[Placement]) -> Generator[None, None, Optional[str]]:
    """Why two checkpoint elements may land on one parameter element, or None when none can."""
    for p in placements:
        if not _is_injective(p):
            return f"the box of {p.tensor} folds onto itself (strides {p.dst_strides})"
    spans = sorted((_span(p), i) for i, p in enumerate(placements))
    groups: list[list[int]] = []
    reach = -1
    for (lo, hi), i in spans:
        if lo > reach:
            groups.append([])
        groups[-1].append(i)
        reach = max(reach, hi)
    for group in groups:
        if len(group) < 2:
            continue  # disjoint spans: nothing to count
        lo = min(_span(placements[i])[0] for i in group)
        hi = max(_span(placements[i])[1] for i in group)
        if hi - lo + 1 > OVERLAP_SPAN_LIMIT:
            return (f"{len(group)} placements interleave over {hi - lo + 1} elements, more than the overlap "
                    f"check's bound of {OVERLAP_SPAN_LIMIT}")
        hits = torch.zeros(hi - lo + 1, dtype=torch.int8)
        for i in group:
            p = placements[i]
            counted = hits.as_strided(p.sizes, p.dst_strides, p.dst_offset - lo)
            for (piece,) in _pieces((counted,), PROOF_STEP_ELEMENTS):
                piece.add_(1)
                yield
        overlaps = int(torch.count_nonzero(hits > 1))
        if overlaps:
            return f"{overlaps} element(s) are written by more than one checkpoint element"
    return None


def _pieces(views: tuple, limit: int) -> Iterator[tuple]:
    """Equal-shaped views cut, together, into blocks of at most ``limit`` elements."""
    first = views[0]
    if first.dim() == 0 or first.numel() <= limit:
        yield views
        return
    inner = math.prod(first.shape[1:])
    if inner <= limit:
        rows = max(1, limit // max(1, inner))
        for a in range(0, first.shape[0], rows):
            yield tuple(v[a : a + rows] for v in views)
        return
    for a in range(first.shape[0]):
        yield from _pieces(tuple(v[a] for v in views), limit)


def _prove_param(
    live: torch.Tensor, placements: list[Placement], tensor: Callable[[str], torch.Tensor]
) -> Generator[None, None, Optional[str]]:
    if not live.is_contiguous():
        return "not contiguous in memory"
    reason = yield from _overlap_steps(placements)
    if reason is not None:
        return reason
    flat = live.detach().reshape(-1)
    differ = mapped = 0
    for p in placements:
        src = tensor(p.tensor).reshape(-1)
        box = src.as_strided(p.sizes, p.src_strides, src.storage_offset() + p.src_offset)
        dst = flat.as_strided(p.sizes, p.dst_strides, flat.storage_offset() + p.dst_offset)
        for want, got in _pieces((box, dst), PROOF_STEP_ELEMENTS):
            expected = torch.empty(tuple(want.shape), dtype=flat.dtype)
            expected.copy_(want)  # the cast a load does
            if got.device.type != "cpu":
                got = got.to("cpu")
            mapped += expected.numel()
            differ += int(torch.count_nonzero(as_int_bits(expected) != as_int_bits(got)))
            yield
    if differ:
        return (
            f"live values differ from the checkpoint on {differ} of {mapped} mapped element(s): "
            "transformed after loading (e.g. repacked, shuffled, quantized or derived)"
        )
    return None


class ProofAttempts:
    """When the map is proven again after a reload: one proof at a time, and at most one per
    distinct local checkpoint identity (a version voided by a weight change is not proven again
    when it is reloaded; a new version is). Bounds the proof's cost when updates keep reloading.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried: set = set()
        self._running = False

    def begin(self, identity: Any) -> Optional[str]:
        """None: start the proof (call ``end`` when it is over); else why not."""
        with self._lock:
            if self._running:
                return "a proof is already running"
            if identity in self._tried:
                return "a proof was already tried against this checkpoint identity"
            self._tried.add(identity)
            self._running = True
            return None

    def end(self) -> None:
        with self._lock:
            self._running = False

    @property
    def tried(self) -> int:
        return len(self._tried)


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
        from weightsync.format.manifest import checkpoint_weight_files
        from weightsync.format.safetensors_io import local_tensor_table

        self.checkpoint_dir = checkpoint_dir
        self.table = local_tensor_table(checkpoint_dir, checkpoint_weight_files(checkpoint_dir))

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, tuple(e.shape), e.dtype) for name, (_, e) in sorted(self.table.items())]

    def tensor(self, name: str) -> torch.Tensor:
        path, e = self.table[name]
        return tensor_from_file(path, e.offset, e.nbytes, e.dtype, tuple(e.shape))

