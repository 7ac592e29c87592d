"""GLM-4.7-Flash-style MoE "lite" (MLA with q/kv LoRA, a dense first layer, shared experts, sigmoid routing
with a per-expert bias; slime's delta-sync example family), end to end on this CPU: real Megatron at TP=2
with EP=2 (ETP=1) on gloo publishes through the builtin converter.

- the unchanged weights, the routers' ``expert_bias`` buffers included, gather back to the seed's bytes;
- v1 equals the converter's output on an independent gather, and pulls bit-exact;
- Megatron's logits equal transformers' on the published checkpoint;
- sglang's own ``Glm4MoeLiteForCausalLM`` (live allow-list; built in process) loads every published
  tensor, ``w_kc``/``w_vc`` are derived, and a live patch equals a reload bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_support import (  # noqa: E402
    differing, independent_gather, miles_converter, read_dir, run_family, transformers_logits)

pytestmark = pytest.mark.slow
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def make_tiny_glm4_moe_lite(out: Path) -> str:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    cfg = Glm4MoeLiteConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        rope_interleave=True, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.3,
    )
    torch.manual_seed(17)
    Glm4MoeLiteForCausalLM(cfg).save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(path)).items()}
    g = torch.Generator().manual_seed(18)
    for n in tensors:  # norms start at 1: give every tensor real bytes
        if n.endswith("norm.weight"):
            tensors[n] = (tensors[n].float() + torch.randn(tensors[n].shape, generator=g) * 0.3).to(torch.bfloat16)
    tensors[BIAS] = torch.randn(4, generator=g) * 0.1  # fp32, as GLM-4.7-Flash keeps it
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe_lite")
    seed = make_tiny_glm4_moe_lite(root / "seed")
    out = root / "run"
    seen = run_family(seed, str(out), tp=2, ep=2, etp=1)
    return seed, out, seen


@pytest.fixture(scope="module")
def published(family, tmp_path_factory):
    import shutil

    from weightsync import pull

    seed, _, seen = family
    local = tmp_path_factory.mktemp("glm4_moe_lite_local") / "ckpt"
    assert pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"]).applied_version == seen[0]["version"]
    for f in Path(seed).iterdir():
        if f.suffix != ".safetensors" and not (local / f.name).exists():  # config, tokenizer
            shutil.copy(f, local / f.name)
    return local


def test_glm4_moe_lite_at_tp2_ep2_gathers_the_unchanged_weights_and_expert_bias_back_to_the_seeds_bytes(family):
    from safetensors.torch import load_file

    seed, out, _ = family
    gathered = {}
    for f in sorted(out.glob("roundtrip-rank*.safetensors")):
        gathered.update(load_file(str(f)))
    assert differing(gathered, read_dir(seed)) == []
    assert gathered[BIAS].dtype.is_floating_point and str(gathered[BIAS].dtype) == "torch.float32"


def test_glm4_moe_lite_v1_equals_the_converter_on_an_independent_gather_and_pulls_bit_exact(family, published):
    from miles_updater.converters import BuiltinConverter
    from miles_updater.gather import read_hf_specs
    from miles_updater.hf_mapping import AttentionLayout

    seed, out, seen = family
    conv = BuiltinConverter(AttentionLayout(4, 4, 16), tied_embeddings=False, model_type="glm4_moe_lite")
    want = independent_gather(str(out), 2, conv, read_hf_specs(seed))
    got = read_dir(published)
    assert differing(got, want) == []
    moved = differing(got, read_dir(seed))
    assert BIAS in moved and "model.layers.1.mlp.shared_experts.gate_proj.weight" in moved
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"} <= set(moved)


def test_megatrons_glm4_moe_lite_logits_equal_transformers_on_the_published_checkpoint(family, published):
    import torch

    _, out, seen = family
    ref = transformers_logits(str(published), seen[0]["ids"])
    torch.testing.assert_close(torch.load(out / "logits.pt"), ref, atol=2e-3, rtol=2e-3)


def test_sglangs_glm4_moe_lite_class_loads_every_published_tensor_and_patches_live_equal_to_a_reload(published):
    from testbed.sglang_cpu import cpu_server_env, find_free_port, server_python

    child = Path(__file__).resolve().parents[1] / "live_models_child.py"
    done = subprocess.run([server_python(), str(child), str(find_free_port()), f"published={published}"],
                          capture_output=True, text=True, timeout=600, env=cpu_server_env(),
                          cwd=str(Path(__file__).resolve().parents[3]))
    assert done.returncode == 0, done.stderr[-4000:]
    out = next(iter(json.loads(done.stdout.strip().splitlines()[-1]).values()))
    assert "error" not in out, out.get("traceback", out)
    assert out["class"] == "Glm4MoeLiteForCausalLM" and out["scope"] is None
    assert out["unused_tensors"] == [] and out["proven"] and not out["reload_only_tensors"], out
    assert BIAS in out["placements"]
    assert out["placements"]["model.layers.0.self_attn.q_a_proj.weight"] == 1  # fused with kv_a_proj_with_mqa
    assert set(out["derivations"]) == {f"model.layers.{k}.self_attn.kv_b_proj.weight" for k in (0, 1)}
    assert out["written"] == out["changed"] > 0 and out["differ_from_reload"] == []


def test_miles_deepseekv3_converter_which_miles_uses_for_glm4_moe_lite_equals_what_we_published(family, tmp_path):
    """Facts carry over: miles' ``convert_deepseekv3_to_hf`` (skipped without ``MILES_RL_DIR``) on the same
    trainer weights gives the bytes v1 holds."""
    from types import SimpleNamespace

    from miles_updater.gather import read_hf_specs
    from weightsync import pull

    seed, out, seen = family
    conv = miles_converter("deepseekv3", SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, num_layers=2, q_lora_rank=16))
    want = independent_gather(str(out), 2, conv, read_hf_specs(seed))
    local = tmp_path / "local"
    pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"])
    assert differing(read_dir(local), want) == []
