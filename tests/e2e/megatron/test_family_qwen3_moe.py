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

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_support import (  # noqa: E402
    differing, independent_gather, miles_converter, read_dir, run_family, transformers_logits)

pytestmark = pytest.mark.slow
CONVERTER = "qwen3moe_converter.make_converter"


def make_tiny_qwen3_moe(out: Path) -> str:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False, initializer_range=0.3,
                         max_position_embeddings=128)
    torch.manual_seed(19)
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(path)).items()}
    g = torch.Generator().manual_seed(20)
    for n in tensors:  # norms start at 1: give every tensor real bytes
        if n.endswith("norm.weight"):
            tensors[n] = (tensors[n].float() + torch.randn(tensors[n].shape, generator=g) * 0.3).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    seed = make_tiny_qwen3_moe(root / "seed")
    out = root / "run"
    seen = run_family(seed, str(out), tp=2, ep=2, etp=1, converter=CONVERTER)
    return seed, out, seen


@pytest.fixture(scope="module")
def published(family, tmp_path_factory):
    import shutil

    from weightsync import pull

    seed, _, seen = family
    local = tmp_path_factory.mktemp("qwen3_moe_local") / "ckpt"
    assert pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"]).applied_version == seen[0]["version"]
    for f in Path(seed).iterdir():
        if f.suffix != ".safetensors" and not (local / f.name).exists():  # config, tokenizer
            shutil.copy(f, local / f.name)
    return local


def test_qwen3_moe_through_a_users_converter_gathers_the_unchanged_weights_back_to_the_seeds_bytes(family):
    from safetensors.torch import load_file

    seed, out, seen = family
    assert seen[0]["converter"] == "Qwen3MoeConverter"
    gathered = {}
    for f in sorted(out.glob("roundtrip-rank*.safetensors")):
        gathered.update(load_file(str(f)))
    assert differing(gathered, read_dir(seed)) == []


def test_qwen3_moe_v1_equals_the_users_converter_on_an_independent_gather_and_pulls_bit_exact(family, published):
    from types import SimpleNamespace

    from miles_updater.gather import read_hf_specs
    from qwen3moe_converter import make_converter

    seed, out, seen = family
    conv = make_converter(SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=16))
    want = independent_gather(str(out), 2, conv, read_hf_specs(seed))
    got = read_dir(published)
    assert differing(got, want) == []
    moved = differing(got, read_dir(seed))
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"} <= set(moved)


def test_megatrons_qwen3_moe_logits_equal_transformers_on_the_published_checkpoint(family, published):
    import torch

    _, out, seen = family
    ref = transformers_logits(str(published), seen[0]["ids"])
    torch.testing.assert_close(torch.load(out / "logits.pt"), ref, atol=2e-3, rtol=2e-3)


def test_sglangs_qwen3_moe_class_loads_every_published_tensor_and_patches_live_equal_to_a_reload(published):
    from testbed.sglang_cpu import cpu_server_env, find_free_port, server_python

    child = Path(__file__).resolve().parents[1] / "live_models_child.py"
    done = subprocess.run([server_python(), str(child), str(find_free_port()), f"published={published}"],
                          capture_output=True, text=True, timeout=600, env=cpu_server_env(),
                          cwd=str(Path(__file__).resolve().parents[3]))
    assert done.returncode == 0, done.stderr[-4000:]
    out = next(iter(json.loads(done.stdout.strip().splitlines()[-1]).values()))
    assert "error" not in out, out.get("traceback", out)
    assert out["class"] == "Qwen3MoeForCausalLM" and out["scope"] is None
    assert out["unused_tensors"] == [] and out["proven"] and not out["reload_only_tensors"], out
    assert out["written"] == out["changed"] > 0 and out["differ_from_reload"] == []


def test_miles_own_qwen3moe_converter_on_an_independent_gather_equals_what_we_published(family, tmp_path):
    """Facts carry over: miles' ``convert_qwen3moe_to_hf`` (skipped without ``MILES_RL_DIR``) on the same
    trainer weights gives the bytes v1 holds."""
    from types import SimpleNamespace

    from miles_updater.gather import read_hf_specs
    from weightsync import pull

    seed, out, seen = family
    conv = miles_converter("qwen3moe", SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, num_layers=2))
    want = independent_gather(str(out), 2, conv, read_hf_specs(seed))
    local = tmp_path / "local"
    pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"])
    assert differing(read_dir(local), want) == []
