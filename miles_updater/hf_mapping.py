"""Megatron-core parameter names and layouts <-> Hugging Face Qwen2/3 / Llama (dense and MoE), GLM-4.5-style
MoE and DeepSeek-V3-style MLA.

Role: pure tensor bookkeeping, no collectives. ``to_hf`` turns one Megatron parameter, given as
its list of tensor-parallel shards (rank order), into the HF tensors it stands for;
``from_hf`` is the inverse used to load ``--hf-checkpoint`` into a Megatron model.

Layouts (which split works per shard and which on the concatenation, and why):
- ``linear_qkv`` holds, for each query group, its q heads then one k head then one v head
  (``[g, q_per_group + 2, head_dim, hidden]``). Tensor parallelism cuts that tensor into TP equal
  row blocks. With at least as many groups as TP ranks a block holds whole groups, but with fewer
  (GQA/MQA: e.g. 1 KV head at TP=2) a group straddles ranks (Megatron all-gathers the activations
  in its forward instead of replicating KV heads), so the shards are concatenated first and q/k/v
  split from the whole tensor: one rule for both layouts.
- ``linear_fc1`` of a gated MLP holds ``[gate; up]`` *within each shard*; the full tensor is
  ``[gate_0; up_0; gate_1; up_1; ...]``, so gate/up are split per shard before concatenating.
- Row-parallel weights (``linear_proj``, ``linear_fc2``) concatenate along dim 1.
- Vocab-parallel embeddings/output layers may carry padding rows; callers trim to the HF shape.

Invariant: ``to_hf(from_hf(x)) == x`` bit for bit for every supported name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class MappingError(ValueError):
    """A Megatron parameter has no known HF counterpart (or the shapes cannot match)."""


@dataclass(frozen=True)
class AttentionLayout:
    """What splitting ``linear_qkv`` needs: heads per group and head size."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def describe(self) -> str:
        return (f"{self.num_attention_heads} attention heads in {self.num_query_groups} KV group(s) "
                f"of head_dim {self.head_dim}")

    @classmethod
    def from_megatron_config(cls, config) -> "AttentionLayout":
        groups = config.num_query_groups or config.num_attention_heads
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        return cls(config.num_attention_heads, groups, head_dim)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")

# Names whose mapping is a plain rename (after tensor-parallel concatenation, if any).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused norm
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE fused norm
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    # a buffer, not a parameter: sigmoid routing's per-expert bias (GLM-4.5, DeepSeek-V3)
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
# Families whose checkpoint names the shared experts in the plural (one ``shared_experts`` MLP).
_PLURAL_SHARED = ("glm4_moe", "glm4_moe_lite", "deepseek_v2", "deepseek_v3", "kimi_k2")
# Multi-latent attention: plain renames (Megatron's up/down projections keep HF's row layouts).
_MLA_FAMILIES = ("glm4_moe_lite", "deepseek_v2", "deepseek_v3", "kimi_k2")
_MLA_RENAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",  # TE fused norm
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",  # TE fused norm
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def is_expert_param(local_name: str) -> bool:
    """Expert weights are split over the expert-parallel and expert-tensor-parallel groups."""
    return ".mlp.experts." in local_name


def expert_local_index(local_name: str) -> int | None:
    """The local expert number in a Megatron expert parameter name (None if not an expert)."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return None
    rest = m.group(2)
    for rx, idx in ((_LOCAL_EXPERT_RE, 1), (_GROUPED_EXPERT_RE, 2)):
        e = rx.match(rest)
        if e:
            return int(e.group(idx))
    return None


def _cat(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def _split_qkv(shards: list[torch.Tensor], att: AttentionLayout) -> tuple[torch.Tensor, ...]:
    full = _cat(shards, 0)  # rank order gives the unsplit rows whether or not a group straddles ranks
    tail = tuple(full.shape[1:])  # (hidden,) for a weight, () for a bias
    per = att.q_per_group + 2
    rows, expected = full.shape[0], att.num_query_groups * per * att.head_dim
    if rows != expected or att.num_attention_heads % att.num_query_groups:
        raise MappingError(
            f"linear_qkv gathered from {len(shards)} tensor-parallel shard(s) has {rows} rows, expected "
            f"{att.num_query_groups} query group(s) x (q_per_group {att.q_per_group} + 2) x head_dim "
            f"{att.head_dim} = {expected} (layout: {att.describe()}); the attention layout does not match the model")
    g = full.reshape(att.num_query_groups, per, att.head_dim, *tail)
    q = g[:, : att.q_per_group].reshape(-1, *tail)
    k = g[:, att.q_per_group].reshape(-1, *tail)
    v = g[:, att.q_per_group + 1].reshape(-1, *tail)
    return q, k, v


def _split_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return _cat(list(gates), 0), _cat(list(ups), 0)


_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")


def to_hf(
    name: str,
    shards: list[torch.Tensor],
    partition_dim: int | None,
    att: AttentionLayout,
    *,
    global_layer: int | None = None,
    global_expert: int | None = None,
    tied_embeddings: bool = False,
    family: str = "",
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one Megatron parameter given as its TP shards in rank order.

    Args:
        name: the parameter name inside one model chunk (``module.`` prefixes removed), with
            the chunk-local layer number.
        shards: the tensor-parallel shards (one element when the parameter is not split).
        partition_dim: the dimension the shards split (None when replicated).
        att: the attention layout (for ``linear_qkv``).
        global_layer: the global (0-based) layer number of this chunk-local layer.
        global_expert: the global expert number of an expert parameter.
        tied_embeddings: the model ties input and output embeddings (``output_layer`` then maps
            to ``model.embed_tokens.weight``).
        family: the checkpoint's ``model_type`` where its names differ from Qwen's (GLM-4.5 and
            DeepSeek's plural ``shared_experts``, MLA projections).

    Raises:
        MappingError: the name is not one this mapping knows.
    """
    names = to_hf_names(name, att, global_layer=global_layer, global_expert=global_expert,
                        tied_embeddings=tied_embeddings, family=family)
    rest = _layer_rest(name)
    if rest in _QKV:
        parts: tuple[torch.Tensor, ...] = _split_qkv(shards, att)
    elif len(names) == 2:  # linear_fc1 of a dense MLP, a shared expert or an expert: [gate; up]
        parts = _split_gate_up(shards)
    elif any(rx.match(rest) for rx in (_LOCAL_EXPERT_RE, _GROUPED_EXPERT_RE)):  # expert linear_fc2
        parts = (_cat(shards, 1),)
    else:
        parts = (_cat(shards, partition_dim) if partition_dim is not None else shards[0],)
    return list(zip(names, parts))


def _layer_rest(name: str) -> str:
    """The part of a layer parameter's name after ``decoder.layers.N.`` ('' for others)."""
    m = _LAYER_RE.match(name)
    return m.group(2) if m else ""


def from_hf(
    name: str,
    hf: dict[str, torch.Tensor],
    att: AttentionLayout,
    *,
    global_layer: int | None = None,
    global_expert: int | None = None,
    tied_embeddings: bool = False,
    family: str = "",
) -> torch.Tensor:
    """The full (unsplit) Megatron tensor for ``name`` from HF tensors (the inverse of ``to_hf``).

    ``hf`` maps HF names to tensors (a lazy mapping works: only the needed keys are read).
    For ``linear_fc1`` the result is the *TP=1* layout ``[gate; up]``; use
    ``shard_for_rank`` to cut a rank's shard, which re-interleaves correctly.
    """
    outs = to_hf_names(name, att, global_layer=global_layer, global_expert=global_expert,
                       tied_embeddings=tied_embeddings, family=family)
    tensors = [hf[n] for n in outs]
    if _layer_rest(name) in _QKV:
        q, k, v = tensors
        tail = tuple(q.shape[1:])
        g = att.num_query_groups
        qg = q.reshape(g, att.q_per_group, att.head_dim, *tail)
        kg = k.reshape(g, 1, att.head_dim, *tail)
        vg = v.reshape(g, 1, att.head_dim, *tail)
        return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)
    if len(tensors) == 2:  # gate/up
        return torch.cat(tensors, dim=0)
    return tensors[0]


def to_hf_names(
    name: str,
    att: AttentionLayout | None = None,
    *,
    global_layer: int | None = None,
    global_expert: int | None = None,
    tied_embeddings: bool = False,
    family: str = "",
) -> list[str]:
    """The HF names ``to_hf`` emits for ``name``, in the same order, without any tensor."""
    if name in _GLOBAL_RENAMES:
        if name == "output_layer.weight" and tied_embeddings:
            return ["model.embed_tokens.weight"]
        return [_GLOBAL_RENAMES[name]]
    m = _LAYER_RE.match(name)
    if not m:
        raise MappingError(f"no HF name for Megatron parameter {name!r}")
    layer = int(m.group(1)) if global_layer is None else global_layer
    rest = m.group(2)
    pre = f"model.layers.{layer}."
    if family in _MLA_FAMILIES and rest in _MLA_RENAMES:
        return [pre + _MLA_RENAMES[rest]]
    if rest in _LAYER_RENAMES:
        if family in _PLURAL_SHARED and rest == "mlp.shared_experts.linear_fc2.weight":
            return [pre + "mlp.shared_experts.down_proj.weight"]
        return [pre + _LAYER_RENAMES[rest]]
    if rest in _QKV:
        kind = rest.rsplit(".", 1)[1]
        return [pre + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        shared = "mlp.shared_experts." if family in _PLURAL_SHARED else "mlp.shared_expert."
        return [pre + shared + "gate_proj.weight", pre + shared + "up_proj.weight"]
    for rx, which_group in ((_LOCAL_EXPERT_RE, 2), (_GROUPED_EXPERT_RE, 1)):
        e = rx.match(rest)
        if e:
            fc = e.group(which_group)
            expert = int(e.group(3 - which_group)) if global_expert is None else global_expert
            ep = pre + f"mlp.experts.{expert}."
            if fc == "linear_fc1":
                return [ep + "gate_proj.weight", ep + "up_proj.weight"]
            return [ep + "down_proj.weight"]
    raise MappingError(f"no HF name for Megatron parameter {name!r} (layer part {rest!r})")


_MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_INNER = ("mtp_model_layer.", "transformer_layer.")  # megatron-core 0.19 / older


def mtp_names(name: str, num_layers: int) -> tuple[str | None, str | None]:
    """An MTP parameter as (its decoder-layer name, or its own HF name), with HF layer ``num_layers + i``
    as DeepSeek-V3 and GLM-4.5 checkpoints number MTP layers; (None, None) for other names."""
    m = _MTP_RE.match(name)
    if not m:
        return None, None
    layer, rest = num_layers + int(m.group(1)), m.group(2)
    if rest in _MTP_OWN:
        return None, f"model.layers.{layer}.{rest}"
    if rest == "final_layernorm.weight":
        return None, f"model.layers.{layer}.shared_head.norm.weight"
    for inner in _MTP_INNER:
        if rest.startswith(inner):
            return f"decoder.layers.{layer}.{rest[len(inner):]}", None
    return None, None


def shard_for_rank(name: str, full: torch.Tensor, partition_dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Cut this rank's shard from a full TP=1 Megatron tensor (gate/up re-interleaved per shard)."""
    if partition_dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]
