"""DeepSeek-V3-style MLA (q and kv LoRA projections with their norms, Megatron's local MLA implementation;
a dense first layer, shared experts, sigmoid routing with a per-expert bias), end to end on this CPU: real
Megatron at TP=2 with EP=2 (ETP=1) on gloo publishes through the builtin converter.

- the unchanged weights, the routers' ``expert_bias`` buffers included, gather back to the seed's bytes;
- v1 equals the converter's output on an independent gather of the trainer's weights and buffers,
  and pulls bit-exact;
- Megatron's logits equal transformers' on the published checkpoint;
- sglang's own ``DeepseekV3ForCausalLM`` (live allow-list; built in process: its MoE and MLA kernels
  do not run on this CPU) loads every published tensor (``q_a_proj`` and ``kv_a_proj_with_mqa`` fused
  by its loader), ``w_kc``/``w_vc`` are derived, and a live patch equals a reload bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_support import (  # noqa: E402
    TINY_MLA_CONFIG, assert_megatron_logits_equal_transformers, assert_miles_converter_equals_published,
    assert_roundtrip_is_the_seed, check_v1_and_list_moved, family_fixtures, load_in_sglangs_class,
    write_tiny_checkpoint)

pytestmark = pytest.mark.slow
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def make_tiny_deepseek_v3(out: Path) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # the bias in fp32, as DeepSeek-V3's checkpoints keep it
    return write_tiny_checkpoint(DeepseekV3ForCausalLM, DeepseekV3Config(**TINY_MLA_CONFIG), out, 17, expert_bias=BIAS)


family, published = family_fixtures("deepseek_v3", make_tiny_deepseek_v3, tp=2, ep=2, etp=1)


def test_mla_at_tp2_ep2_gathers_the_unchanged_weights_and_expert_bias_back_to_the_seeds_bytes(family):
    assert_roundtrip_is_the_seed(family, fp32=BIAS)


def test_mla_v1_equals_the_converter_on_an_independent_gather_and_pulls_bit_exact(family, published):
    from miles_updater.converters import BuiltinConverter
    from miles_updater.hf_mapping import AttentionLayout

    seed, out, _ = family
    conv = BuiltinConverter(AttentionLayout(4, 4, 16), tied_embeddings=False, model_type="deepseek_v3")
    moved = check_v1_and_list_moved(seed, out, published, conv)
    assert BIAS in moved and "model.layers.1.mlp.shared_experts.gate_proj.weight" in moved
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"} <= set(moved)


def test_megatrons_mla_logits_equal_transformers_on_the_published_checkpoint(family, published):
    _, out, seen = family
    assert_megatron_logits_equal_transformers(out, published, seen[0]["ids"])


def test_sglangs_deepseek_v3_class_loads_every_published_mla_tensor_and_patches_live_equal_to_a_reload(published):
    out = load_in_sglangs_class(published, "DeepseekV3ForCausalLM")
    assert BIAS in out["placements"]
    assert out["placements"]["model.layers.0.self_attn.q_a_proj.weight"] == 1  # fused with kv_a_proj_with_mqa
    assert set(out["derivations"]) == {f"model.layers.{k}.self_attn.kv_b_proj.weight" for k in (0, 1)}


def test_miles_own_deepseekv3_converter_on_an_independent_gather_equals_what_we_published(family, tmp_path):
    """Facts carry over: miles' ``convert_deepseekv3_to_hf`` (skipped without ``MILES_RL_DIR``) on the same
    trainer weights gives the bytes v1 holds."""
    from types import SimpleNamespace

    seed, out, seen = family
    args = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, num_layers=2, q_lora_rank=16)
    assert_miles_converter_equals_published("deepseekv3", args, seed, out, seen, tmp_path / "local")
