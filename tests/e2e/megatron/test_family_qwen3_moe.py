"""Qwen3-MoE through a converter passed as the hook (``--update-weight-converter
qwen3moe_converter.make_converter``: a user's converter, stateful, written apart from our mapping), end to
end on this CPU: real Megatron at TP=2 with EP=2 (ETP=1) on gloo.

- the unchanged weights gather back to the seed's bytes through that converter;
- v1 equals the converter's output on an independent gather of the trainer's weights, and pulls
  bit-exact;
- Megatron's logits equal transformers' on the published checkpoint;
- sglang's own ``Qwen3MoeForCausalLM`` (live allow-list; built in process: its MoE layers do not run on
  this CPU) loads every published tensor, and a live patch equals a reload bit for bit.
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
CONVERTER = "qwen3moe_converter.make_converter"


def make_tiny_qwen3_moe(out: Path) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False, initializer_range=0.3,
                         max_position_embeddings=128)
    return write_tiny_checkpoint(Qwen3MoeForCausalLM, cfg, out, 19)


family, published = family_fixtures("qwen3_moe", make_tiny_qwen3_moe, tp=2, ep=2, etp=1, converter=CONVERTER)


def test_qwen3_moe_through_a_users_converter_gathers_the_unchanged_weights_back_to_the_seeds_bytes(family):
    _, _, seen = family
    assert seen[0]["converter"] == "Qwen3MoeConverter"
    assert_roundtrip_is_the_seed(family)


def test_qwen3_moe_v1_equals_the_users_converter_on_an_independent_gather_and_pulls_bit_exact(family, published):
    from types import SimpleNamespace

    from qwen3moe_converter import make_converter

    seed, out, _ = family
    conv = make_converter(SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=16))
    moved = check_v1_and_list_moved(seed, out, published, conv)
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"} <= set(moved)


def test_megatrons_qwen3_moe_logits_equal_transformers_on_the_published_checkpoint(family, published):
    _, out, seen = family
    assert_megatron_logits_equal_transformers(out, published, seen[0]["ids"])


def test_sglangs_qwen3_moe_class_loads_every_published_tensor_and_patches_live_equal_to_a_reload(published):
    load_in_sglangs_class(published, "Qwen3MoeForCausalLM")


def test_miles_own_qwen3moe_converter_on_an_independent_gather_equals_what_we_published(family, tmp_path):
    """Facts carry over: miles' ``convert_qwen3moe_to_hf`` (skipped without ``MILES_RL_DIR``) on the same
    trainer weights gives the bytes v1 holds."""
    from types import SimpleNamespace

    seed, out, seen = family
    args = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, num_layers=2)
    assert_miles_converter_equals_published("qwen3moe", args, seed, out, seen, tmp_path / "local")
