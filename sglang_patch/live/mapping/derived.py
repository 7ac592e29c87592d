"""Tensors a loader derives after its copies, re-derived exactly in the pause: MLA's ``w_kc``/``w_vc``.

sglang's DeepSeek-V2/V3 and GLM-4 MoE Lite (GLM-4.7-Flash) loaders end with
``DeepseekV2WeightLoaderMixin.post_load_weights``, which splits each MLA attention layer's
``kv_b_proj.weight`` (``[heads x (qk_nope + v), kv_lora]``) into ``w_kc`` (``[heads, qk_nope,
kv_lora]``) and ``w_vc`` (``[heads, kv_lora, v]``), two plain tensors the forward (and the CUDA
graphs it captured) reads. A live patch of ``kv_b_proj`` alone would leave them stale, so such a
layer is live only under this rule:

- *Recognised at map time* (``derivable_params``): the model's ``post_load_weights`` is the mixin's,
  sglang takes the unquantized path (``kv_b_proj`` a plain bf16/fp16/fp32 weight: no AWQ
  ``qweight``, no weight scale, the unquantized linear method, no tensor ``w_scale``, no DeepGEMM
  bmm) and none of the platform branches that change the result (ROCm gfx95 aiter, NPU, MUSA).
  Reads of ``kv_b_proj`` inside ``post_load_weights`` of the storage-free copy are then the
  derivation, not a refusal (``coordinate_map``); any other read still makes it reload-only.
- *Proven against the live weights* (``prove_steps``, at the map's proof): ``w_kc``/``w_vc`` must be
  plain tensors of the expected shapes, dtype and device, and equal, bit for bit, to the split of
  the live ``kv_b_proj``. Anything else makes that ``kv_b_proj`` reload-only, with the reason.
- *Re-derived in the pause* (``refresh``): after the scatter wrote ``kv_b_proj``, and again after a
  rollback restored it: ``copy_`` from views of ``kv_b_proj`` into the existing ``w_kc``/``w_vc``
  storage (pointers unchanged, nothing allocated, no undo log: the result is a function of the
  restored source). sglang's reload does the same (``bind_or_assign``: ``copy_`` into the old
  tensor), so the bytes are a reload's.
"""

from __future__ import annotations

import sys
from typing import Any, Generator, Iterable, Mapping, Optional

import torch

from .coordinate_map import as_int_bits
from .differ import DifferFlags

MIXIN_POST_LOAD = "DeepseekV2WeightLoaderMixin.post_load_weights"
DERIVABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# sglang's platform flags (in the mixin's module) under which the split is not a plain copy
PLATFORM_BRANCHES = ("_use_aiter_gfx95", "_is_npu", "_is_musa")


def _post_load_of(model: Any) -> Optional[Any]:
    fn = getattr(type(model), "post_load_weights", None)
    return fn if getattr(fn, "__qualname__", "") == MIXIN_POST_LOAD else None


def _mla_layers(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    for path, m in model.named_modules():
        if "w_kc" in m.__dict__ and isinstance(getattr(m, "kv_b_proj", None), torch.nn.Module):
            yield path, m


def why_layer_not_derivable(attn: torch.nn.Module) -> Optional[str]:
    """Why sglang's split of this layer's ``kv_b_proj`` is not the plain one this rule repeats."""
    kv_b = attn.kv_b_proj
    weight = getattr(kv_b, "weight", None)
    if hasattr(kv_b, "qweight") or not isinstance(weight, torch.Tensor):
        return "kv_b_proj is AWQ-quantized (its split dequantizes)"
    if weight.dtype not in DERIVABLE_DTYPES:
        return f"kv_b_proj is {weight.dtype} (a quantized split requantizes)"
    for scale in ("weight_scale", "weight_scale_inv"):
        if hasattr(kv_b, scale):
            return f"kv_b_proj has a {scale} (a quantized split requantizes)"
    method = type(getattr(kv_b, "quant_method", None)).__name__
    if method not in ("UnquantizedLinearMethod", "NoneType"):
        return f"kv_b_proj is loaded by {method}, not the unquantized linear method"
    if isinstance(getattr(attn, "w_scale", None), torch.Tensor) or getattr(attn, "use_deep_gemm_bmm", False):
        return "the layer keeps a w_scale or a DeepGEMM layout of w_kc/w_vc"
    for attr in ("qk_nope_head_dim", "v_head_dim"):
        if not isinstance(getattr(attn, attr, None), int):
            return f"the attention module has no integer {attr}"
    for attr in ("w_kc_qrep", "q_b_proj_qrep_weight"):
        if getattr(attn, attr, None) is not None:
            return f"{attr} (--dcp-replicate-q-proj) is gathered from the derived weights once"
    return None


def derivable_params(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(derivable, not)``: ``kv_b_proj`` parameter -> its attention module's path, for the layers
    this rule re-derives; and parameter -> why not, for the other MLA layers."""
    ok: dict[str, str] = {}
    refused: dict[str, str] = {}
    post_load = _post_load_of(model)
    module = sys.modules.get(getattr(post_load, "__module__", ""), None)
    platform = None
    if post_load is not None:
        missing = [f for f in PLATFORM_BRANCHES if not hasattr(module, f)]
        on = [f for f in PLATFORM_BRANCHES if getattr(module, f, False)]
        if missing or on:
            platform = f"sglang's split takes a platform branch ({', '.join(on) or 'unknown: ' + ', '.join(missing)})"
    for path, attn in _mla_layers(model):
        param = f"{path}.kv_b_proj.weight"
        if post_load is None:
            refused[param] = (f"{type(model).__name__}'s post_load_weights is not sglang's "
                              f"{MIXIN_POST_LOAD}: no derivation rule for its w_kc/w_vc")
            continue
        why = platform or why_layer_not_derivable(attn)
        if why is None:
            ok[param] = path
        else:
            refused[param] = f"w_kc/w_vc are derived from it after loading and cannot be re-derived live: {why}"
    return ok, refused


class MlaDerivation:
    """One layer's ``w_kc``/``w_vc`` as views of its live ``kv_b_proj`` (bound at the proof)."""

    def __init__(self, path: str, attn: torch.nn.Module) -> None:
        self.path = path
        self.attn = attn
        self.kv_b = attn.kv_b_proj.weight
        self.w_kc = attn.w_kc
        self.w_vc = attn.w_vc
        self.kv_b_ptr = self.kv_b.data_ptr()
        self.scratch: Optional[CompareScratch] = None  # shared, set once the proof bound every layer
        nope, v = attn.qk_nope_head_dim, attn.v_head_dim
        # sglang: w.unflatten(0, (-1, nope + v)).split([nope, v], dim=1); w_vc transposed
        split = self.kv_b.detach().unflatten(0, (-1, nope + v))
        self.src_kc = split[:, :nope, :]
        self.src_vc = split[:, nope:, :].transpose(1, 2)

    @staticmethod
    def why_not_bindable(attn: torch.nn.Module) -> Optional[str]:
        kv_b = attn.kv_b_proj.weight
        nope, v = attn.qk_nope_head_dim, attn.v_head_dim
        if kv_b.dim() != 2 or kv_b.shape[0] % (nope + v):
            return f"kv_b_proj has shape {tuple(kv_b.shape)}, not [heads x {nope + v}, kv_lora]"
        heads, rank = kv_b.shape[0] // (nope + v), kv_b.shape[1]
        for name, shape in (("w_kc", (heads, nope, rank)), ("w_vc", (heads, rank, v))):
            t = attn.__dict__.get(name)
            if type(t) is not torch.Tensor:
                return f"{name} is {type(t).__name__}, not a plain tensor"
            if tuple(t.shape) != shape or t.dtype != kv_b.dtype or t.device != kv_b.device:
                return (f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, not {shape} {kv_b.dtype} "
                        f"on {kv_b.device} (the split of kv_b_proj)")
        return None

    def why_not_current(self) -> Optional[str]:
        """Why the bound views no longer name the tensors the forward reads (cheap: identities)."""
        attn = self.attn
        if attn.__dict__.get("w_kc") is not self.w_kc or attn.__dict__.get("w_vc") is not self.w_vc:
            return f"{self.path}.w_kc/w_vc were replaced since the proof"
        if attn.kv_b_proj.weight is not self.kv_b or self.kv_b.data_ptr() != self.kv_b_ptr:
            return f"{self.path}.kv_b_proj.weight was replaced since the proof"
        return None

    def derive(self) -> None:
        """Into the existing storage (CUDA graphs captured these pointers); no allocation."""
        self.w_kc.copy_(self.src_kc)
        self.w_vc.copy_(self.src_vc)

    def mismatches(self) -> tuple[int, int]:
        """``(elements that differ from a re-derivation, elements compared)``, bit for bit; into
        the shared ``scratch`` once the proof made it (the pause's check allocates nothing)."""
        differ = 0
        for got, want in ((self.w_kc, self.src_kc), (self.w_vc, self.src_vc)):
            if self.scratch is not None:
                differ += self.scratch.differing(got, want)
            else:
                differ += int(torch.count_nonzero(as_int_bits(got) != as_int_bits(want)))
        return differ, self.w_kc.numel() + self.w_vc.numel()


class CompareScratch:
    """What comparing a derived tensor with its re-derivation writes into, made once at the proof
    and shared by every layer: per device the flags of ``differ.DifferFlags`` and their scratch
    (at most ``differ.CHUNK`` int64, or one row of the largest tensor), not one buffer per layer.
    No reduction on the way (a CUDA reduction takes a workspace inside the pause); the elements
    that differ are counted only once the flags say some do."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        sizes: dict[torch.device, tuple[int, int]] = {}
        for t in tensors:
            n, row = sizes.get(t.device, (0, 1))
            sizes[t.device] = (max(n, t.numel()), max(row, t[0].numel() if t.dim() and t.shape[0] else 1))
        self.flags = {d: DifferFlags(d, 1, n, row) for d, (n, row) in sizes.items()}

    def differing(self, got: torch.Tensor, want: torch.Tensor) -> int:
        """Elements of ``got`` whose bits differ from ``want``'s (same shape and device)."""
        flags = self.flags[got.device]
        flags.reset()
        flags.mark(0, as_int_bits(got), as_int_bits(want))
        if not bool(flags.differing()[0]):
            return 0
        return int(torch.count_nonzero(as_int_bits(got) != as_int_bits(want)))  # some differ: this allocates


def prove_steps(model: torch.nn.Module, derived_params: Mapping[str, str],
                names: Iterable[str]) -> Generator[None, None, dict[str, Any]]:
    """For each proven ``kv_b_proj`` parameter in ``names``: its bound ``MlaDerivation`` when the live
    ``w_kc``/``w_vc`` are bit for bit its split, else why not (a string). One layer per step."""
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for name in names:
        path = derived_params[name]
        attn = modules.get(path)
        why = "the attention module is gone" if attn is None else MlaDerivation.why_not_bindable(attn)
        if why is None:
            d = MlaDerivation(path, attn)
            differ, compared = d.mismatches()
            if differ:
                why = (f"the live w_kc/w_vc of {path} differ from the split of its kv_b_proj on {differ} of "
                       f"{compared} element(s): sglang derived them another way")
            else:
                out[name] = d
        if why is not None:
            out[name] = f"w_kc/w_vc are derived from it after loading and the rule is not proven: {why}"
        yield
    bound = [d for d in out.values() if isinstance(d, MlaDerivation)]
    scratch = CompareScratch(t for d in bound for t in (d.w_kc, d.w_vc))
    for d in bound:
        d.scratch = scratch
    return out


def prover(model: torch.nn.Module):
    """``prove_derived`` for ``coordinate_map.prove_map_steps`` on this live model."""
    return lambda derived_params, names: prove_steps(model, derived_params, names)


def why_stale(derivations: Mapping[str, MlaDerivation], patches: Iterable) -> Optional[str]:
    """Why a rule of a parameter ``patches`` write no longer names the live tensors, or None."""
    for p in patches:
        d = derivations.get(p.param)
        why = d.why_not_current() if d is not None else None
        if why is not None:
            return why
    return None


def refresh(derivations: Mapping[str, MlaDerivation], patches: Iterable, fence: Any = None) -> int:
    """Re-derive every layer whose ``kv_b_proj`` a patch wrote (``patch.ParamPatch``); the count.

    ``fence`` (``live.scatter.device.PauseFence``, the staged update's): the copies are ordered with the
    forward's stream and waited for, as the scatter's are (an asynchronous error raises here)."""
    rules = [d for d in (derivations.get(p.param) for p in patches) if d is not None] if derivations else []
    if not rules:
        return 0
    if fence is not None:
        fence.begin_writes()
    for d in rules:
        d.derive()
    if fence is not None:
        fence.end_writes()
        fence.wait()
    return len(rules)


def check(derivations: Mapping[str, MlaDerivation], patches: Iterable) -> tuple[int, int, Optional[str]]:
    """``(compared, mismatches, first)``: the re-derived layers of ``patches`` against a re-derivation."""
    compared = bad = 0
    first = None
    for p in patches:
        d = derivations.get(p.param)
        if d is None:
            continue
        differ, n = d.mismatches()
        compared += n
        bad += differ
        if differ and first is None:
            first = f"{d.path}.w_kc/w_vc: {differ} element(s) differ from the split of kv_b_proj"
    return compared, bad, first
