"""GLM-4.5-style MoE (a dense first layer, shared experts, sigmoid routing with a per-expert bias, q/k
norms, q/k/v biases, partial rotary), end to end on this CPU: real Megatron at TP=2 with EP=2 (experts
not TP-split: ETP=1) on gloo publishes through the builtin converter.

- the unchanged weights, the routers' ``expert_bias`` buffers included, gather back to the seed's
  bytes (``e_score_correction_bias`` in fp32 as GLM ships it);
- v1 equals the converter's output on an independent gather of the trainer's weights and buffers,
  and pulls bit-exact;
- Megatron's logits equal transformers' on the published checkpoint;
- sglang's own ``Glm4MoeForCausalLM`` (live allow-list; its MoE layers do not run on this CPU, so it
  is built in process) loads every published tensor, and a live patch equals a reload bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_support import (  # noqa: E402
    assert_megatron_logits_equal_transformers, assert_miles_converter_equals_published, assert_roundtrip_is_the_seed,
    check_v1_and_list_moved, family_fixtures, load_in_sglangs_class, write_tiny_checkpoint)

pytestmark = pytest.mark.slow
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def make_tiny_glm4_moe(out: Path) -> str:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.3, num_nextn_predict_layers=0,
    )
    # norms start at 1, biases at 0; the router's bias in fp32, as GLM-4.5's checkpoints keep it
    return write_tiny_checkpoint(Glm4MoeForCausalLM, cfg, out, 13, bumped=("norm.weight", "_proj.bias"),
                                 expert_bias=BIAS)


family, published = family_fixtures("glm4_moe", make_tiny_glm4_moe, tp=2, ep=2, etp=1)


def test_glm4_moe_at_tp2_ep2_gathers_the_unchanged_weights_and_expert_bias_back_to_the_seeds_bytes(family):
    assert_roundtrip_is_the_seed(family, fp32=BIAS)


def test_glm4_moe_v1_equals_the_converter_on_an_independent_gather_and_pulls_bit_exact(family, published):
    from miles_updater.converters import BuiltinConverter
    from miles_updater.hf_mapping import AttentionLayout

    seed, out, _ = family
    conv = BuiltinConverter(AttentionLayout(4, 2, 16), tied_embeddings=False, model_type="glm4_moe")
    moved = check_v1_and_list_moved(seed, out, published, conv)
    assert BIAS in moved and "model.layers.1.mlp.shared_experts.gate_proj.weight" in moved


def test_megatrons_glm4_moe_logits_equal_transformers_on_the_published_checkpoint(family, published):
    _, out, seen = family
    assert_megatron_logits_equal_transformers(out, published, seen[0]["ids"])


def test_sglangs_glm4_moe_class_loads_every_published_tensor_and_patches_live_equal_to_a_reload(published):
    out = load_in_sglangs_class(published, "Glm4MoeForCausalLM")
    assert BIAS in out["placements"]


def test_miles_own_glm4moe_converter_on_an_independent_gather_equals_what_we_published(family, tmp_path):
    """Facts carry over: miles' ``convert_glm4moe_to_hf`` (skipped without ``MILES_RL_DIR``) on the same
    trainer weights gives the bytes v1 holds."""
    from types import SimpleNamespace

    seed, out, seen = family
    args = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, num_layers=2)
    assert_miles_converter_equals_published("glm4moe", args, seed, out, seen, tmp_path / "local")
