"""The trainer's converter as a hook, on real Megatron ranks (gloo): TP=1 x PP=2, a tiny tied Qwen3.

One run of two ranks (one per pipeline stage, each a source rank) does, in order:
- the builtin mapping as the hook, a converter that cannot run on meta tensors (planned from one real
  gather instead), and a stateful converter that holds a layer's ``o_proj`` back
  until its ``linear_qkv`` arrives (as slime's MLA converter pairs ``q_a_proj`` with ``kv_a_proj``) and
  names stage 1's tied output layer ``lm_head.weight`` (as miles' converters do, tied or not): both give
  the checkpoint's bytes (the weights are the checkpoint's);
- faults of the converter, each injected into one gather and then removed: it raises on stage 1
  only, emits an unknown name, a wrong shape, a name twice, ``lm_head`` for the tied checkpoint,
  never releases a held tensor. Every rank must raise a ``GatherError`` naming it, and the next
  gather must give the checkpoint's bytes again;
- an FP8 checkpoint (one F8_E4M3 weight with its scale) with a vision tensor no parameter
  produces: refused until that tensor is listed static, then published through the updater with
  a quantizing converter; bf16 for the F8 tensor is refused; the pulled version holds the
  converter's F8 bytes and the seed's vision bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_support import bytes_equal, free_port, make_tied_tiny_qwen3, read_dir, run_gloo_ranks  # noqa: E402

FP8_NAME = "model.layers.0.mlp.down_proj.weight"
VISION = "model.visual.proj.weight"
FAULTS = {  # mode -> what every rank's error must name
    "raise_on_stage1": ["rank 1", "injected converter failure", "decoder.final_layernorm.weight"],
    "unknown_name": ["model.layers.0.mlp.down_proj.weigth", "is not in --hf-checkpoint"],
    "wrong_shape": ["model.layers.0.mlp.down_proj.weight", "gathered shape [64, 255]", "[64, 256]"],
    "twice": ["model.layers.0.post_attention_layernorm.weight", "emitted twice"],
    "lm_head_tied": ["lm_head.weight", "ties its embeddings"],
    "withhold": ["never emitted", "model.layers.0.self_attn.o_proj.weight", "half-emitted"],
}


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory):
    return make_tied_tiny_qwen3(tmp_path_factory.mktemp("hf_tied") / "ckpt")


def quantize_e4m3(t):
    """Per-tensor FP8: (values, scale_inv) as a converter that quantizes for the rollout would emit."""
    import torch

    scale = (t.float().abs().amax() / 448.0).clamp(min=1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.reshape(1).float()


@pytest.fixture(scope="module")
def fp8_hf(tied_hf, tmp_path_factory):
    """The tied checkpoint with layer 0's down_proj in F8_E4M3 (+ its scale) and a vision tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("hf_fp8") / "ckpt"
    shutil.copytree(tied_hf, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][FP8_NAME]
    tensors = load_file(str(d / fname))
    q, s = quantize_e4m3(tensors[FP8_NAME])
    tensors[FP8_NAME], tensors[FP8_NAME + "_scale_inv"] = q, s
    tensors[VISION] = torch.randn(8, 8).to(torch.bfloat16)
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    for n in (FP8_NAME + "_scale_inv", VISION):
        index["weight_map"][n] = fname
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(d)


@pytest.fixture(scope="module")
def run(tied_hf, fp8_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("hook") / "out"
    seen, _ = run_gloo_ranks(__file__, dict(hf_dir=tied_hf, fp8_dir=fp8_hf, out_dir=str(out), port=free_port()), ranks=2)
    return out, seen


def _gathered(out: Path, label: str) -> dict:
    merged = {}
    for r in range(2):
        part = _read_one(out / f"{label}-rank{r}.safetensors")
        assert not (merged.keys() & part.keys()), "a tensor was published by two source ranks"
        merged.update(part)
    return merged


def _read_one(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.exists() else {}


@pytest.mark.parametrize("label", ["builtin", "pairing", "after_faults", "no_meta"])
def test_a_converter_hook_publishes_every_checkpoint_tensor_once_with_its_bytes(run, tied_hf, label):
    out, _ = run
    gathered, reference = _gathered(out, label), read_dir(tied_hf)
    assert sorted(gathered) == sorted(reference)
    assert [n for n in reference if not bytes_equal(gathered[n], reference[n])] == []
    # the tied output layer of stage 1 maps to the embedding: published once, by stage 0
    assert "model.embed_tokens.weight" in _read_one(out / f"{label}-rank0.safetensors")


@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_a_faulty_converter_fails_every_rank_naming_the_cause_and_the_next_gather_works(run, mode):
    out, seen = run
    for rank, s in enumerate(seen):
        error = s["faults"][mode]
        assert error.startswith("GatherError: weight gather failed"), (rank, error)
        for part in FAULTS[mode]:
            assert part in error, (rank, mode, part, error)
    # each fault was followed by a gather with the cause gone; the last one's bytes are checked above
    assert all(s["recovered"][mode] for s in seen)


def test_a_converter_emitting_an_unknown_name_is_refused_at_planning_on_every_rank(run):
    _, seen = run
    for s in seen:
        assert "the model emits tensors --hf-checkpoint lacks" in s["plan_unknown"]
        assert "model.norm.weigth" in s["plan_unknown"]


def test_a_checkpoint_tensor_no_parameter_produces_is_refused_unless_listed_static(run):
    _, seen = run
    for s in seen:
        assert VISION in s["static_missing"] and "--update-weight-static-tensors" in s["static_missing"]


def test_fp8_tensors_arrive_in_the_checkpoints_dtype_and_static_tensors_keep_the_seeds_bytes(run, fp8_hf, tmp_path):
    import torch

    from weightsync import pull

    out, seen = run
    s = seen[0]
    assert "bfloat16 for a F8_E4M3 checkpoint tensor" in s["fp8_bf16_error"], s["fp8_bf16_error"]
    assert seen[1]["fp8_bf16_error"] == s["fp8_bf16_error"]
    local = tmp_path / "engine"
    assert pull(str(local), fp8_hf, s["source_dir"], s["version"]).applied_version == s["version"]
    pulled, seed = read_dir(local), read_dir(fp8_hf)
    assert sorted(pulled) == sorted(seed)
    assert pulled[FP8_NAME].dtype == torch.float8_e4m3fn
    # the converter's output on an independent copy of the trainer's weights (stage 0 saved them)
    params = torch.load(out / "params-rank0.pt")
    q, scale = quantize_e4m3(params["decoder.layers.0.mlp.linear_fc2.weight"])
    assert bytes_equal(pulled[FP8_NAME], q) and bytes_equal(pulled[FP8_NAME + "_scale_inv"], scale)
    assert not bytes_equal(pulled[FP8_NAME], seed[FP8_NAME])  # the step moved it
    assert bytes_equal(pulled[VISION], seed[VISION])
    assert s["static"] == [VISION] and seen[1]["static"] == []
    # v2, a delta after a sparse step: the F8 tensor's changed bytes travel the delta codec as bytes
    local2 = tmp_path / "engine2"
    assert pull(str(local2), fp8_hf, s["source_dir"], s["version2"]).applied_version == s["version2"]
    pulled2 = read_dir(local2)
    q2, scale2 = quantize_e4m3(torch.load(out / "params2-rank0.pt")["decoder.layers.0.mlp.linear_fc2.weight"])
    assert bytes_equal(pulled2[FP8_NAME], q2) and bytes_equal(pulled2[FP8_NAME + "_scale_inv"], scale2)
    assert not bytes_equal(pulled2[FP8_NAME], pulled[FP8_NAME]) and bytes_equal(pulled2[VISION], seed[VISION])
    assert s["kind2"] == "delta", s["kind2"]


# --- the rank process ---------------------------------------------------------------------------


class FaultyConverter:
    """The builtin mapping, or a stateful pairing converter, with one fault switched on at a time."""

    def __init__(self, builtin, pp_rank: int, pairing: bool = False):
        self.builtin, self.pp_rank, self.pairing = builtin, pp_rank, pairing
        self.mode = None
        self.held: dict[str, list] = {}
        self.resets = 0

    def reset(self) -> None:
        self.held.clear()
        self.resets += 1

    def __call__(self, name, t):
        out = list(self.builtin(name, t))
        m = self.mode
        if m == "raise_on_stage1" and self.pp_rank == 1 and name == "decoder.final_layernorm.weight":
            raise RuntimeError("injected converter failure")
        if name == "decoder.layers.0.mlp.linear_fc2.weight":
            if m == "unknown_name":
                out = [(n.replace("weight", "weigth"), x) for n, x in out]
            if m == "wrong_shape":
                out = [(n, x[:, :-1]) for n, x in out]
        if m == "twice" and name == "decoder.layers.0.mlp.linear_fc2.weight":
            out += list(self.builtin("decoder.layers.0.pre_mlp_layernorm.weight", t.new_ones(t.shape[0])))
        if m == "lm_head_tied" and name == "embedding.word_embeddings.weight":
            out.append(("lm_head.weight", t))
        if self.pairing and name == "output_layer.weight":
            return [("lm_head.weight", t)]  # as miles' and slime's converters name it, tied or not
        if self.pairing or m == "withhold":
            layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
            # Megatron registers linear_proj before linear_qkv: hold o_proj back until q/k/v arrive
            if name.endswith("self_attention.linear_proj.weight"):
                self.held[layer] = out
                return []
            if name.endswith("self_attention.linear_qkv.weight") and m != "withhold":
                return self.held.pop(layer) + out
        return out


def _save(tensors: dict, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from miles_updater.gather import ST_TO_TORCH

    if tensors:
        save_file({n: torch.frombuffer(bytearray(t.data.tobytes()), dtype=ST_TO_TORCH[t.dtype]).reshape(t.shape)
                   for n, t in tensors.items()}, str(path))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the parent's assertions
        return f"{type(e).__name__}: {e}"
    return ""


def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from miles_updater.args import DiskDeltaConfig
    from miles_updater.converters import BuiltinConverter
    from miles_updater.gather import HFWeightGatherer, load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater

    init_distributed_cpu(rank, 2, cfg["port"], tp=1, pp=2)
    out = Path(cfg["out_dir"])
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    probe = HFWeightGatherer([model], cfg["hf_dir"])
    builtin = probe.converter
    assert isinstance(builtin, BuiltinConverter)
    seen: dict = {"faults": {}, "recovered": {}}

    _save(probe.gather(), out / f"builtin-rank{rank}.safetensors")
    pairing = FaultyConverter(builtin, rank, pairing=True)
    _save(HFWeightGatherer([model], cfg["hf_dir"], converter=pairing).gather(), out / f"pairing-rank{rank}.safetensors")

    def no_meta(name, t):  # as a converter with a GPU quantizing kernel: it cannot run on meta tensors
        if t.is_meta:
            raise NotImplementedError("no meta kernel")
        return builtin(name, t)

    _save(HFWeightGatherer([model], cfg["hf_dir"], converter=no_meta).gather(), out / f"no_meta-rank{rank}.safetensors")

    conv = FaultyConverter(builtin, rank)
    gatherer = HFWeightGatherer([model], cfg["hf_dir"], converter=conv)
    good = None
    for mode in sorted(FAULTS):
        conv.mode = mode
        seen["faults"][mode] = _error(gatherer.gather)
        conv.mode = None
        good = gatherer.gather()
        seen["recovered"][mode] = True
    _save(good, out / f"after_faults-rank{rank}.safetensors")

    def misnamed(name, t):
        return [(n.replace("model.norm.weight", "model.norm.weigth"), x) for n, x in builtin(name, t)]

    seen["plan_unknown"] = _error(lambda: HFWeightGatherer([model], cfg["hf_dir"], converter=misnamed))

    fp8 = {"bf16": False}

    def quantizing(name, t):
        pairs = []
        for n, x in builtin(name, t):
            if n == FP8_NAME and not fp8["bf16"]:
                q, s = _quantize(x)
                pairs += [(n, q), (n + "_scale_inv", s)]
            elif n == FP8_NAME:
                pairs.append((n, x.bfloat16()))  # the fault: a bf16 tensor for the F8 one
            else:
                pairs.append((n, x))
        return pairs

    seen["static_missing"] = _error(lambda: HFWeightGatherer([model], cfg["fp8_dir"], converter=quantizing))
    config = DiskDeltaConfig(source_dir=str(out / "shared"), local_checkpoint_dir=str(out / "unused"),
                             hf_checkpoint=cfg["fp8_dir"], static_tensors=("model.visual.*",))
    updater = DiskDeltaWeightUpdater(config, [model], converter=quantizing)
    updater.start()
    move_decoder_weights(model, 1)
    fp8["bf16"] = True
    seen["fp8_bf16_error"] = _error(lambda: updater.update_weights(update_engines=False))
    fp8["bf16"] = False
    seen.update(source_dir=updater.source_dir, version=updater.update_weights(update_engines=False).version,
                static=updater.gatherer.plan.static)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"params-rank{rank}.pt")
    move_decoder_weights(model, 2, fraction=0.01)  # a sparse step: v2 is a delta, the F8 bytes go through the codec
    m2 = updater.update_weights(update_engines=False)
    seen.update(version2=m2.version, kind2=getattr(m2, "kind", None))
    updater.close()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"params2-rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()


def move_decoder_weights(model, step: int, fraction: float = 1.0) -> None:
    """An "optimizer step" of the decoder layers, on ``fraction`` of each one's elements (the tied
    embedding copies stay equal, as Megatron's embedding-group all-reduce keeps them)."""
    import torch

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.startswith("decoder.layers."):
                g = torch.Generator().manual_seed(10_000 * step + i)
                flat = p.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
                flat[idx] += torch.randn(idx.numel(), generator=g) * 0.05


def _quantize(t):
    return quantize_e4m3(t)


if __name__ == "__main__":
    cfg = json.loads(sys.argv[2])
    _worker(int(sys.argv[1]), cfg)
