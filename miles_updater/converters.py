"""The Megatron -> HF converter hook: its contract, our own mapping as one, and the flag that picks one.

Role: ``HFWeightGatherer`` does every collective (TP all-gather, EP gather) and hands each
parameter, whole, to one converter; the converter only renames and re-slices. So a trainer's
own converter (miles' or slime's ``convert_to_hf``, or any function with the same shape) can
publish every family its framework trains, and the gather still checks the result against
``--hf-checkpoint``.

The contract (``MegatronToHF``):
- called on source ranks only, after every rank finished that parameter's collectives; once per
  parameter per gather, in the same module order every sync (a converter that pairs tensors
  across calls, as slime's MLA ``q_a_proj``/``kv_a_proj_with_mqa``, relies on it);
- ``name`` is the *global* Megatron name without wrapper prefixes: ``decoder.layers.{global
  layer}.…``, routed experts as ``….mlp.experts.linear_fc{1,2}.weight{global expert}``, MTP as
  ``mtp.layers.{i}.…``, the routers' ``expert_bias`` buffers included;
- ``tensor`` is the full TP=1 tensor: shards concatenated on their partition dim in rank order, a
  gated ``linear_fc1`` (weight or bias) as ``[gate of all ranks; up of all ranks]``, vocab padding
  kept (the gather trims what the converter leaves), the training dtype; read-only;
- it returns ``(hf_name, tensor)`` pairs, possibly none, possibly for a name an earlier call
  started; an optional ``reset()`` is called before every gather (and after planning).
The converter never runs a collective.

Invariant: ``BuiltinConverter`` on the full tensors gives exactly what ``hf_mapping.to_hf`` gives
on the shards.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from typing import Any, Callable, Iterable

import torch

from .hf_mapping import AttentionLayout, MappingError, mtp_names, to_hf

log = logging.getLogger(__name__)

MegatronToHF = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
CONVERTER_CHOICES = ("builtin", "trainer")  # or an import path pkg.mod.fn


class ConverterError(ValueError):
    """A converter spec that cannot be bound (the message names the fix)."""


def hf_model_type(hf_checkpoint: str) -> str:
    """The checkpoint's ``model_type`` (config.json), '' when it has none."""
    try:
        with open(os.path.join(hf_checkpoint, "config.json")) as f:
            return str(json.load(f).get("model_type") or "")
    except (OSError, ValueError):
        return ""


class BuiltinConverter:
    """``hf_mapping`` as the hook: Qwen2/2.5, Qwen3 (dense and MoE), Llama, GLM-4.5-style MoE and
    DeepSeek-V3-style MLA names, and their MTP layers (HF layer ``num_layers + i``, as DeepSeek-V3 and
    GLM-4.5 checkpoints number them).

    Stateless: every Megatron parameter maps to its HF tensors on its own (a full tensor is one
    shard, so the same qkv and gate/up splits apply).
    """

    def __init__(self, att: AttentionLayout, *, tied_embeddings: bool, model_type: str = "",
                 num_layers: int | None = None):
        self.att = att
        self.tied_embeddings = tied_embeddings
        self.model_type = model_type
        self.num_layers = num_layers

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.num_layers is not None and name.startswith("mtp."):
            decoder, own = mtp_names(name, self.num_layers)
            if own is not None:
                return [(own, tensor)]
            name = decoder or name
        return to_hf(name, [tensor], None, self.att, tied_embeddings=self.tied_embeddings,
                     family=self.model_type)

    def __repr__(self) -> str:
        return f"builtin({self.model_type or 'qwen/llama'})"


def _import_path(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    if not module:
        raise ConverterError(f"--update-weight-converter {path!r} is not an import path; expected "
                             f"'builtin', 'trainer' or 'package.module.function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConverterError(f"--update-weight-converter {path!r} cannot be imported: {type(e).__name__}: {e}") from e


def _trainer_convert_to_hf() -> tuple[str, Any, Any]:
    """(framework, its convert_to_hf, its module) for miles or slime, whichever is importable."""
    tried = []
    for framework in ("miles", "slime"):
        modname = f"{framework}.backends.megatron_utils.megatron_to_hf"
        try:
            mod = importlib.import_module(modname)
            return framework, mod.convert_to_hf, mod
        except Exception as e:  # noqa: BLE001 - an absent or broken framework: try the next one
            tried.append(f"{modname}: {type(e).__name__}: {e}")
    raise ConverterError("--update-weight-converter trainer needs miles or slime importable; " + "; ".join(tried))


class TrainerConverter:
    """The host framework's ``convert_to_hf(args, model_name, name, param, quantization_config)``,
    bound as the actors of miles and slime bind it.

    ``model_name`` is ``args.model_name`` or the HF config class's name, lower-cased (their
    dispatch keys); names get the ``module.module.`` prefix their converters strip; slime's FP8
    scales stay in the checkpoint's format (``transform_ue8m0=False``, as its HF saver passes), and
    ``reset`` clears slime's cross-call cache (``_cached_tensors``).
    """

    def __init__(self, args: Any, hf_checkpoint: str, *, framework=None, convert_to_hf=None, module=None):
        if convert_to_hf is None:
            framework, convert_to_hf, module = _trainer_convert_to_hf()
        self.framework = framework
        self._convert = convert_to_hf
        self._module = module
        self.args = args
        hf_config = _hf_config(hf_checkpoint)
        self.model_name = getattr(args, "model_name", None) or type(hf_config).__name__.lower()
        self.quantization_config = getattr(hf_config, "quantization_config", None)

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        kw = {"transform_ue8m0": False} if self.framework == "slime" else {}
        return list(self._convert(self.args, self.model_name, "module.module." + name, tensor,
                                  self.quantization_config, **kw))

    def reset(self) -> None:
        cache = getattr(self._module, "_cached_tensors", None)
        if hasattr(cache, "clear"):
            cache.clear()

    def __repr__(self) -> str:
        return f"trainer({self.framework}:{self.model_name})"


def _hf_config(hf_checkpoint: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_checkpoint)


def resolve_converter(spec: str | MegatronToHF | None, *, args: Any = None, hf_checkpoint: str,
                      att: AttentionLayout, tied_embeddings: bool, num_layers: int | None = None) -> MegatronToHF:
    """The converter a flag value names: ``builtin`` (default), ``trainer``, ``pkg.mod.fn`` (called
    as ``fn(args)``, it returns the converter), or a converter itself."""
    if spec is None or spec == "builtin":
        return BuiltinConverter(att, tied_embeddings=tied_embeddings, model_type=hf_model_type(hf_checkpoint),
                                num_layers=num_layers)
    if callable(spec):
        return spec
    if spec == "trainer":
        return TrainerConverter(args, hf_checkpoint)
    factory = _import_path(spec)
    conv = factory(args)
    if not callable(conv):
        raise ConverterError(f"--update-weight-converter {spec}: {spec}(args) returned {type(conv).__name__}, "
                             f"not a callable (name, tensor) -> [(hf_name, tensor), ...]")
    return conv


def converter_label(conv: Any) -> str:
    return repr(conv) if isinstance(conv, (BuiltinConverter, TrainerConverter)) else getattr(
        conv, "__qualname__", type(conv).__qualname__)


__all__ = ["BuiltinConverter", "CONVERTER_CHOICES", "ConverterError", "MappingError", "MegatronToHF",
           "TrainerConverter", "converter_label", "hf_model_type", "resolve_converter"]
