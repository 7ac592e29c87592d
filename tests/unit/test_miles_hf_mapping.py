"""Megatron <-> HF name and layout mapping, as pure tensor bookkeeping (no collectives).

For every kind of parameter, HF tensors -> Megatron full tensor -> TP shards -> HF tensors must
give back the same bytes, for Qwen3 (q/k norms) and Llama-style GQA (with a qkv bias), at TP 1, 2, 4.
"""

from __future__ import annotations

import pytest
import torch

from miles_updater.hf_mapping import AttentionLayout, MappingError, from_hf, shard_for_rank, to_hf, to_hf_names

ATT = AttentionLayout(num_attention_heads=8, num_query_groups=4, head_dim=4)
H, FFN = 32, 48

CASES = {
    # megatron name: (partition_dim or None, {hf name: shape})
    "decoder.layers.0.self_attention.linear_qkv.weight": (0, {
        "model.layers.0.self_attn.q_proj.weight": (32, H), "model.layers.0.self_attn.k_proj.weight": (16, H),
        "model.layers.0.self_attn.v_proj.weight": (16, H)}),
    "decoder.layers.0.self_attention.linear_qkv.bias": (0, {
        "model.layers.0.self_attn.q_proj.bias": (32,), "model.layers.0.self_attn.k_proj.bias": (16,),
        "model.layers.0.self_attn.v_proj.bias": (16,)}),
    "decoder.layers.0.self_attention.linear_proj.weight": (1, {"model.layers.0.self_attn.o_proj.weight": (H, 32)}),
    "decoder.layers.0.mlp.linear_fc1.weight": (0, {
        "model.layers.0.mlp.gate_proj.weight": (FFN, H), "model.layers.0.mlp.up_proj.weight": (FFN, H)}),
    "decoder.layers.0.mlp.linear_fc2.weight": (1, {"model.layers.0.mlp.down_proj.weight": (H, FFN)}),
    "decoder.layers.0.self_attention.q_layernorm.weight": (None, {"model.layers.0.self_attn.q_norm.weight": (4,)}),
    "decoder.layers.0.input_layernorm.weight": (None, {"model.layers.0.input_layernorm.weight": (H,)}),
    "decoder.layers.0.pre_mlp_layernorm.weight": (None, {"model.layers.0.post_attention_layernorm.weight": (H,)}),
    "embedding.word_embeddings.weight": (0, {"model.embed_tokens.weight": (64, H)}),
    "output_layer.weight": (0, {"lm_head.weight": (64, H)}),
    "decoder.final_layernorm.weight": (None, {"model.norm.weight": (H,)}),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_to_megatron_shards_to_hf_is_byte_exact(name, tp):
    pdim, shapes = CASES[name]
    g = torch.Generator().manual_seed(hash(name) % 1000)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    full = from_hf(name, hf, ATT)
    shards = [shard_for_rank(name, full, pdim, r, tp) for r in range(tp)]
    back = dict(to_hf(name, shards, pdim, ATT))
    assert list(back) == to_hf_names(name, ATT) == list(shapes)
    for n, t in hf.items():
        assert torch.equal(back[n].view(torch.int16), t.view(torch.int16)), n


def test_qkv_layout_interleaves_q_heads_then_k_then_v_per_group():
    q = torch.arange(32 * 1).reshape(32, 1).float()
    k = 100 + torch.arange(16).reshape(16, 1).float()
    v = 200 + torch.arange(16).reshape(16, 1).float()
    full = from_hf("decoder.layers.0.self_attention.linear_qkv.weight", {
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v}, ATT)
    # Group 0: q heads 0,1 (rows 0-7), k head 0 (rows 100-103), v head 0 (rows 200-203).
    assert full[:16, 0].tolist() == list(range(8)) + [100, 101, 102, 103] + [200, 201, 202, 203]


def test_layers_and_experts_are_renumbered_to_global_ids():
    names = to_hf_names("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", ATT,
                        global_layer=7, global_expert=5)
    assert names == ["model.layers.7.mlp.experts.5.gate_proj.weight", "model.layers.7.mlp.experts.5.up_proj.weight"]
    assert to_hf_names("decoder.layers.0.mlp.experts.linear_fc2.weight3", ATT, global_expert=11) == [
        "model.layers.0.mlp.experts.11.down_proj.weight"]
    assert to_hf_names("decoder.layers.2.mlp.router.weight", ATT) == ["model.layers.2.mlp.gate.weight"]


def test_tied_output_layer_maps_to_the_embedding():
    assert to_hf_names("output_layer.weight", ATT, tied_embeddings=True) == ["model.embed_tokens.weight"]


def test_unknown_parameter_is_refused_with_its_name():
    with pytest.raises(MappingError, match="decoder.layers.0.mystery.weight"):
        to_hf_names("decoder.layers.0.mystery.weight", ATT)
    with pytest.raises(MappingError, match="rows"):
        to_hf("decoder.layers.0.self_attention.linear_qkv.weight", [torch.zeros(30, 4)], 0, ATT)


@pytest.mark.parametrize("groups,tp", [(1, 2), (1, 4), (2, 4)])
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_fewer_kv_groups_than_tp_ranks_gather_back_byte_exact(groups, tp, kind):
    # Megatron cuts linear_qkv into TP equal row blocks even when a KV group straddles ranks.
    att = AttentionLayout(num_attention_heads=8, num_query_groups=groups, head_dim=4)
    name = f"decoder.layers.0.self_attention.linear_qkv.{kind}"
    tail = (H,) if kind == "weight" else ()
    g = torch.Generator().manual_seed(groups * 10 + tp)
    hf = {f"model.layers.0.self_attn.{p}_proj.{kind}": torch.randn((rows, *tail), generator=g).to(torch.bfloat16)
          for p, rows in (("q", 32), ("k", 4 * groups), ("v", 4 * groups))}
    full = from_hf(name, hf, att)
    shards = [shard_for_rank(name, full, 0, r, tp) for r in range(tp)]
    assert shards[0].shape[0] < (att.q_per_group + 2) * att.head_dim  # a group really straddles ranks
    back = dict(to_hf(name, shards, 0, att))
    for n, t in hf.items():
        assert torch.equal(back[n].view(torch.int16), t.view(torch.int16)), n


def test_a_qkv_that_does_not_fit_the_layout_is_refused_naming_the_layout():
    att = AttentionLayout(num_attention_heads=8, num_query_groups=1, head_dim=4)
    with pytest.raises(MappingError, match=r"8 attention heads in 1 KV group\(s\) of head_dim 4") as e:
        to_hf("decoder.layers.0.self_attention.linear_qkv.weight", [torch.zeros(18, 4), torch.zeros(18, 4)], 0, att)
    assert "36 rows, expected" in str(e.value) and "= 40" in str(e.value)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_builtin_converter_on_the_full_tensor_equals_the_mapping_on_the_shards(name, tp):
    """The hook gets full TP=1 tensors ([gate of every rank; up of every rank] for a gated fc1)."""
    from miles_updater.converters import BuiltinConverter

    pdim, shapes = CASES[name]
    g = torch.Generator().manual_seed(hash(name) % 1000)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    shards = [shard_for_rank(name, from_hf(name, hf, ATT), pdim, r, tp) for r in range(tp)]
    if pdim is None:
        full = shards[0]
    elif name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(shards, pdim)
    hook = dict(BuiltinConverter(ATT, tied_embeddings=False)(name, full))
    assert list(hook) == list(shapes)
    for n, t in dict(to_hf(name, shards, pdim, ATT)).items():
        assert torch.equal(hook[n].view(torch.int16), t.view(torch.int16)), n


FAMILY_NAMES = [
    # (family, megatron name, hf names)
    ("glm4_moe", "decoder.layers.3.mlp.router.expert_bias", ["model.layers.3.mlp.gate.e_score_correction_bias"]),
    ("qwen3_moe", "decoder.layers.3.mlp.router.expert_bias", ["model.layers.3.mlp.gate.e_score_correction_bias"]),
    ("glm4_moe", "decoder.layers.3.mlp.shared_experts.linear_fc1.weight",
     ["model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"]),
    ("glm4_moe", "decoder.layers.3.mlp.shared_experts.linear_fc2.weight",
     ["model.layers.3.mlp.shared_experts.down_proj.weight"]),
    ("qwen2_moe", "decoder.layers.3.mlp.shared_experts.linear_fc2.weight",
     ["model.layers.3.mlp.shared_expert.down_proj.weight"]),
    ("glm4_moe", "decoder.layers.3.self_attention.q_layernorm.weight", ["model.layers.3.self_attn.q_norm.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.q_layernorm.weight",
     ["model.layers.3.self_attn.q_a_layernorm.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_q_down_proj.weight",
     ["model.layers.3.self_attn.q_a_proj.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_q_up_proj.weight",
     ["model.layers.3.self_attn.q_b_proj.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_q_proj.weight", ["model.layers.3.self_attn.q_proj.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_kv_down_proj.weight",
     ["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.kv_layernorm.weight",
     ["model.layers.3.self_attn.kv_a_layernorm.weight"]),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_kv_up_proj.weight",
     ["model.layers.3.self_attn.kv_b_proj.weight"]),
    ("glm4_moe_lite", "decoder.layers.3.self_attention.linear_kv_up_proj.weight",
     ["model.layers.3.self_attn.kv_b_proj.weight"]),
    ("deepseek_v3", "decoder.layers.3.mlp.experts.linear_fc2.weight17", ["model.layers.3.mlp.experts.17.down_proj.weight"]),
]


@pytest.mark.parametrize("family,name,hf", FAMILY_NAMES)
def test_each_familys_megatron_names_map_to_its_checkpoint_names(family, name, hf):
    assert to_hf_names(name, ATT, family=family) == hf


def test_mla_names_are_refused_for_a_family_without_mla():
    with pytest.raises(MappingError):
        to_hf_names("decoder.layers.0.self_attention.linear_kv_up_proj.weight", ATT, family="qwen3")


MTP_NAMES = [
    ("mtp.layers.0.enorm.weight", ["model.layers.4.enorm.weight"]),
    ("mtp.layers.0.hnorm.weight", ["model.layers.4.hnorm.weight"]),
    ("mtp.layers.0.eh_proj.weight", ["model.layers.4.eh_proj.weight"]),
    ("mtp.layers.0.final_layernorm.weight", ["model.layers.4.shared_head.norm.weight"]),
    ("mtp.layers.1.mtp_model_layer.input_layernorm.weight", ["model.layers.5.input_layernorm.weight"]),
    ("mtp.layers.0.transformer_layer.mlp.router.expert_bias", ["model.layers.4.mlp.gate.e_score_correction_bias"]),
    ("mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc2.weight3", ["model.layers.4.mlp.experts.3.down_proj.weight"]),
]


@pytest.mark.parametrize("name,hf", MTP_NAMES)
def test_mtp_layers_map_after_the_decoders_layers_as_deepseek_and_glm_checkpoints_number_them(name, hf):
    from miles_updater.converters import BuiltinConverter

    conv = BuiltinConverter(ATT, tied_embeddings=False, model_type="glm4_moe", num_layers=4)
    assert [n for n, _ in conv(name, torch.zeros(4))] == hf
