"""Gathering HF tensors from a real megatron-core GPTModel on CPU processes with gloo.

The test spawns real ranks (TP=2 x PP=2 = 4 processes, and TP=2 x PP=1 for a forward pass);
each loads a tiny Qwen3 HF checkpoint into Megatron, gathers it back as HF tensors, and the
parent compares them with the transformers state dict byte for byte. The TP=2 run also checks
Megatron's logits against transformers' on the same weights, so a layout bug that load and
gather share (and would cancel in a round trip) still fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_support import full_vocab_logits, make_tied_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, tp: int, pp: int, hf_dir: str, out_dir: str, extra: dict | None = None) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")
    cfg = json.dumps(dict(world=world, tp=tp, pp=pp, port=port, hf_dir=hf_dir, out_dir=out_dir, **(extra or {})))
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), cfg], env=env, cwd=str(REPO),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    logs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        logs.append(out)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks failed {failed}:\n" + "\n".join(l[-3000:] for l in logs)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    d = tmp_path_factory.mktemp("hf")
    make_tiny_qwen3(d / "ckpt", seed=3)
    return str(d / "ckpt")


@pytest.fixture(scope="module")
def wrong_shape_hf(tiny_hf, tmp_path_factory):
    """The tiny checkpoint with one tensor's shape changed (as a wrong --hf-checkpoint would)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("hf_bad") / "ckpt"
    shutil.copytree(tiny_hf, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    fname = index["weight_map"][name]
    tensors = load_file(str(d / fname))
    tensors[name] = tensors[name][:-8].contiguous()
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    return str(d)


def _gathered(out_dir: Path) -> dict:
    from safetensors.torch import load_file

    merged = {}
    for f in sorted(out_dir.glob("gathered-rank*.safetensors")):
        part = load_file(str(f))
        assert not (merged.keys() & part.keys()), "a tensor was published by two source ranks"
        merged.update(part)
    return merged


def _assert_bytes_equal(gathered: dict, reference: dict) -> None:
    assert sorted(gathered) == sorted(reference)
    for name, ref in reference.items():
        got = gathered[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert got.contiguous().view(-1).view(__import__("torch").uint8).equal(
            ref.contiguous().view(-1).view(__import__("torch").uint8)), f"{name} differs"


def test_tp2_pp2_gather_equals_transformers_state_dict_byte_for_byte(tiny_hf, wrong_shape_hf, tmp_path):
    from testbed.tiny_qwen3 import load_model

    _run_ranks(4, 2, 2, tiny_hf, str(tmp_path), {"bad_hf_dir": wrong_shape_hf})
    reference = {k: v for k, v in load_model(tiny_hf).state_dict().items()}
    _assert_bytes_equal(_gathered(tmp_path), reference)
    # Two source ranks (one per PP stage) wrote; TP rank 1 of each stage kept nothing.
    assert len(list(tmp_path.glob("gathered-rank*.safetensors"))) == 2
    # A shape mismatch fails every rank together, naming the tensor.
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "model.layers.1.mlp.up_proj.weight" in seen["bad_checkpoint_error"]
        assert "shape" in seen["bad_checkpoint_error"]


def test_tp2_megatron_logits_match_transformers_on_the_gathered_weights(tiny_hf, tmp_path):
    import torch

    from testbed.tiny_qwen3 import load_model

    _run_ranks(2, 2, 1, tiny_hf, str(tmp_path), {"perturb": True})
    gathered = _gathered(tmp_path)
    model = load_model(tiny_hf).float()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in gathered.items()}, strict=True)
    ids = torch.tensor(json.loads((tmp_path / "ids.json").read_text()))
    with torch.no_grad():
        ref = model(ids).logits
    mega = torch.load(tmp_path / "logits.pt")
    assert mega.shape == ref.shape
    torch.testing.assert_close(mega, ref, atol=2e-3, rtol=2e-3)
    # The perturbation moved the weights away from the checkpoint, so this is not a no-op check.
    base = load_model(tiny_hf).state_dict()
    assert any(not torch.equal(base[k], gathered[k]) for k in base)


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory):
    """A tiny Qwen3 with tied input/output embeddings (no lm_head.weight in the checkpoint)."""
    return make_tied_tiny_qwen3(tmp_path_factory.mktemp("hf_tied") / "ckpt")


def test_tied_embeddings_on_two_pp_stages_are_published_once(tied_hf, tmp_path):
    _run_ranks(2, 1, 2, tied_hf, str(tmp_path), {"break_tied_copy": True})
    gathered = _gathered(tmp_path)  # asserts no tensor came from two source ranks
    from safetensors.torch import load_file

    per_rank = {f.name: set(load_file(str(f))) for f in tmp_path.glob("gathered-rank*.safetensors")}
    assert "model.embed_tokens.weight" in per_rank["gathered-rank0.safetensors"]
    assert "model.embed_tokens.weight" not in per_rank["gathered-rank1.safetensors"]
    reference = {}
    for f in Path(tied_hf).glob("*.safetensors"):
        reference.update(load_file(str(f)))
    _assert_bytes_equal(gathered, reference)
    # When the two stages' copies drift apart, every rank fails together, naming the tensor.
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "model.embed_tokens.weight" in seen["tied_drift_error"] and "differ" in seen["tied_drift_error"]


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top-2) in bf16."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = tmp_path_factory.mktemp("hf_moe") / "ckpt"
    torch.manual_seed(7)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False, initializer_range=0.3)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d))
    return str(d)


def test_ep2_moe_experts_are_gathered_under_their_global_ids(moe_hf, tmp_path):
    from safetensors.torch import load_file

    _run_ranks(2, 1, 1, moe_hf, str(tmp_path), {"ep": 2})
    reference = {}
    for f in Path(moe_hf).glob("*.safetensors"):
        reference.update(load_file(str(f)))
    # One source rank (TP 0, DP 0) gathers every expert from both EP ranks; the router, kept in
    # fp32 by Megatron here, is cast back to the checkpoint's bf16.
    assert [f.name for f in tmp_path.glob("gathered-rank*.safetensors")] == ["gathered-rank0.safetensors"]
    _assert_bytes_equal(_gathered(tmp_path), reference)


@pytest.fixture(scope="module")
def mqa_hf(tmp_path_factory):
    """The tiny Qwen3 with one KV head for its four query heads (fewer KV groups than TP=2 ranks)."""
    from testbed.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("hf_mqa") / "ckpt", seed=6, num_key_value_heads=1)


def test_one_kv_head_at_tp2_publishes_the_trainers_weights(mqa_hf, tmp_path):
    """A KV group straddling the TP ranks is published exactly: the version pulled from disk equals
    the q/k/v cut by hand from the ranks' raw linear_qkv shards, and Megatron's logits equal
    transformers' on the published bytes."""
    import torch

    from testbed.tiny_qwen3 import load_model, read_state_dict
    from weightsync import pull

    _run_ranks(2, 2, 1, mqa_hf, str(tmp_path), {"perturb": True, "publish": str(tmp_path / "shared")})
    seen = json.loads((tmp_path / "rank0.json").read_text())
    local = tmp_path / "engine" / "ckpt"
    assert pull(str(local), mqa_hf, seen["source_dir"], seen["version"]).applied_version == seen["version"]
    published = read_state_dict(local)
    _assert_bytes_equal(published, _gathered(tmp_path))
    # Independently of hf_mapping: Megatron cut [q0 q1 q2 q3 k v] (16 rows each) into two row blocks.
    params = [torch.load(tmp_path / f"params-rank{r}.pt") for r in range(2)]
    for layer in range(2):
        qkv = torch.cat([p[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] for p in params]).bfloat16()
        assert params[0][f"decoder.layers.{layer}.self_attention.linear_qkv.weight"].shape[0] == 48
        for proj, rows in (("q", slice(0, 64)), ("k", slice(64, 80)), ("v", slice(80, 96))):
            got = published[f"model.layers.{layer}.self_attn.{proj}_proj.weight"]
            assert torch.equal(got.view(torch.int16), qkv[rows].contiguous().view(torch.int16)), (layer, proj)
    model = load_model(mqa_hf).float()
    model.load_state_dict({k: v.float() for k, v in published.items()}, strict=True)
    ids = torch.tensor(json.loads((tmp_path / "ids.json").read_text()))
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), ref, atol=2e-3, rtol=2e-3)
    base = read_state_dict(mqa_hf)
    assert not torch.equal(base["model.layers.0.self_attn.k_proj.weight"], published["model.layers.0.self_attn.k_proj.weight"])


@pytest.fixture(scope="module")
def four_layer_hf(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("hf_4l") / "ckpt", seed=8, num_hidden_layers=4)


def test_virtual_pipeline_chunks_are_gathered_under_their_global_layers(four_layer_hf, tmp_path):
    """PP=2 x VPP=2: rank 0 holds layers 0 and 2 in two model chunks, rank 1 layers 1 and 3."""
    _run_ranks(2, 1, 2, four_layer_hf, str(tmp_path), {"vpp": 2})
    from safetensors.torch import load_file

    reference = {}
    for f in Path(four_layer_hf).glob("*.safetensors"):
        reference.update(load_file(str(f)))
    _assert_bytes_equal(_gathered(tmp_path), reference)
    rank0 = set(load_file(str(tmp_path / "gathered-rank0.safetensors")))
    assert {n.split(".")[2] for n in rank0 if n.startswith("model.layers.")} == {"0", "2"}


MTP_STATIC = ["model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]


@pytest.fixture(scope="module")
def mtp_hf(tmp_path_factory):
    """A tiny GLM-4.5-style MoE whose checkpoint carries one MTP layer (HF layer 2, after the 2 decoder
    layers), with the embedding and head copies DeepSeek-V3 and GLM-4.5 checkpoints keep there."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    d = tmp_path_factory.mktemp("hf_mtp") / "ckpt"
    cfg = Glm4MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
                        max_position_embeddings=128, initializer_range=0.3, num_nextn_predict_layers=1)
    torch.manual_seed(21)
    Glm4MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d))
    path = d / "model.safetensors"
    t = load_file(str(path))
    g = torch.Generator().manual_seed(22)
    for n in [n for n in t if n.startswith("model.layers.1.")]:
        t[n.replace("model.layers.1.", "model.layers.2.")] = (t[n].float() + torch.randn(t[n].shape, generator=g)).to(t[n].dtype)
    for n, shape in (("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("eh_proj.weight", (32, 64)),
                     ("shared_head.norm.weight", (32,))):
        t[f"model.layers.2.{n}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    t["model.layers.2.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    t["model.layers.2.shared_head.head.weight"] = t["lm_head.weight"].clone()
    save_file(t, str(path), metadata={"format": "pt"})
    return str(d)


def test_mtp_layers_are_gathered_as_the_checkpoints_layer_after_the_last_and_its_copies_kept_static(mtp_hf, tmp_path):
    """TP=2: the MTP layer (its own norms and projection, its MoE layer and expert_bias) round-trips to
    HF layer 2; the embedding and head copies there, which no parameter produces, are refused until
    listed static, then keep the seed's bytes."""
    _run_ranks(2, 2, 1, mtp_hf, str(tmp_path), {"mtp": 1, "static": MTP_STATIC})
    from safetensors.torch import load_file

    reference = load_file(str(Path(mtp_hf) / "model.safetensors"))
    gathered = _gathered(tmp_path)
    _assert_bytes_equal(gathered, reference)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in gathered
    for rank in range(2):
        error = json.loads((tmp_path / f"rank{rank}.json").read_text())["static_missing"]
        assert all(n in error for n in MTP_STATIC) and "--update-weight-static-tensors" in error, error


# --- the rank process ---------------------------------------------------------------------------


def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from miles_updater.gather import GatherError, HFWeightGatherer, load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu

    init_distributed_cpu(rank, cfg["world"], cfg["port"], tp=cfg["tp"], pp=cfg["pp"], ep=cfg.get("ep", 1),
                         vpp=cfg.get("vpp"))
    from megatron.core import parallel_state as ps

    out = Path(cfg["out_dir"])
    if cfg.get("vpp"):  # virtual pipeline chunks: gather them back and stop
        chunks = [build_gpt_model(cfg["hf_dir"], vp_stage=i) for i in range(cfg["vpp"])]
        load_hf_checkpoint(chunks, cfg["hf_dir"])
        tensors = HFWeightGatherer(chunks, cfg["hf_dir"]).gather()
        save_file({n: torch.frombuffer(bytearray(t.data.tobytes()), dtype=torch.bfloat16).reshape(t.shape)
                   for n, t in tensors.items()}, str(out / f"gathered-rank{rank}.safetensors"))
        dist.barrier()
        return
    model = build_gpt_model(cfg["hf_dir"], mtp_num_layers=cfg.get("mtp", 0))
    load_hf_checkpoint([model], cfg["hf_dir"])
    if cfg.get("perturb"):
        # Move every weight by a name-seeded amount (identical on TP ranks for replicated
        # params), rounded to bf16 so the bf16 gather loses nothing the fp32 forward uses.
        with torch.no_grad():
            for i, (name, p) in enumerate(model.named_parameters()):
                g = torch.Generator().manual_seed(1000 + i + 17 * ps.get_tensor_model_parallel_rank()
                                                  * int(getattr(p, "tensor_model_parallel", False)))
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
                p.copy_(p.bfloat16().float())
    gatherer = HFWeightGatherer([model], cfg["hf_dir"], static_tensors=cfg.get("static", ()))
    tensors = gatherer.gather()
    if tensors:
        from miles_updater.gather import ST_TO_TORCH

        torch_tensors = {
            n: torch.frombuffer(bytearray(t.data.tobytes()), dtype=ST_TO_TORCH[t.dtype]).reshape(t.shape)
            for n, t in tensors.items()
        }
        save_file(torch_tensors, str(out / f"gathered-rank{rank}.safetensors"))
    seen = {"staging_nbytes": gatherer.staging_nbytes()}
    if cfg.get("static"):
        try:
            HFWeightGatherer([model], cfg["hf_dir"])
            seen["static_missing"] = ""
        except GatherError as e:
            seen["static_missing"] = str(e)
    if cfg.get("bad_hf_dir"):
        try:
            HFWeightGatherer([model], cfg["bad_hf_dir"]).gather()
            seen["bad_checkpoint_error"] = ""
        except GatherError as e:
            seen["bad_checkpoint_error"] = str(e)
    if cfg.get("break_tied_copy"):
        if ps.is_pipeline_last_stage():
            with torch.no_grad():
                model.output_layer.weight[0, 0] += 1.0
        try:
            HFWeightGatherer([model], cfg["hf_dir"]).gather()
            seen["tied_drift_error"] = ""
        except GatherError as e:
            seen["tied_drift_error"] = str(e)
    if cfg.get("publish"):
        from miles_updater.args import DiskDeltaConfig
        from miles_updater.updater import DiskDeltaWeightUpdater

        config = DiskDeltaConfig(source_dir=cfg["publish"], local_checkpoint_dir=str(out / "unused"),
                                 hf_checkpoint=cfg["hf_dir"])
        updater = DiskDeltaWeightUpdater(config, [model])
        updater.start()
        seen.update(source_dir=updater.source_dir, version=updater.update_weights(update_engines=False).version)
        updater.close()
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"params-rank{rank}.pt")
    if cfg["pp"] == 1 and not cfg.get("ep") and not cfg.get("mtp"):
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (1, 12))
        logits = full_vocab_logits(model, ids, cfg["tp"])
        if rank == 0:
            torch.save(logits, out / "logits.pt")
            (out / "ids.json").write_text(json.dumps(ids.tolist()))
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
