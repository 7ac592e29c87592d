"""Shared harness of the per-family tests: real Megatron ranks on gloo publish a tiny checkpoint of one
family through a converter, and the parent checks the version against an independent gather.

Role: ``run_family`` starts one process per rank (this file's ``__main__``). Each rank builds the
family's GPTModel, loads the seed checkpoint, gathers it back unchanged (``roundtrip``), moves every
weight (bf16-rounded, identical where Megatron replicates it), publishes v1 with
``DiskDeltaWeightUpdater`` and the converter, saves its raw parameters (with their partition dims),
publishes v2 after a sparse step (a delta an engine applies live) and, at PP=1, Megatron's logits
for v1. ``independent_gather`` rebuilds the
full tensors from those raw parameters by itself (no ``gather.py`` code) and runs the converter on
them: what v1 must hold.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from megatron_support import (  # noqa: E402
    bytes_equal, free_port, full_vocab_logits, move_weights, read_dir, run_gloo_ranks)

GATED_FC1 = re.compile(r"linear_fc1\.(weight|bias)$")
LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def run_family(hf_dir: str, out_dir: str, *, tp: int = 2, pp: int = 1, ep: int = 1, etp: int | None = None,
               converter: str = "builtin", logits: bool = True) -> list[dict]:
    cfg = dict(hf_dir=hf_dir, out_dir=out_dir, port=free_port(), tp=tp, pp=pp, ep=ep, etp=etp,
               converter=converter, logits=logits, world=tp * pp)
    seen, _ = run_gloo_ranks(__file__, cfg, ranks=tp * pp)
    return seen


def differing(got: dict, want: dict) -> list[str]:
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:10]
    return [n for n in want if not bytes_equal(got[n], want[n])]


def independent_gather(out_dir: str, world: int, converter, specs: dict) -> dict:
    """The HF tensors v1 must hold, from the ranks' raw parameters (PP=1; TP, and EP with ETP=1).

    Shards of one parameter are concatenated in TP rank order on their partition dim, a gated
    ``linear_fc1`` as [every rank's gate; every rank's up]; EP rank r's local expert k is global
    expert r * n_local + k; then the converter, vocab rows trimmed, cast to the checkpoint's dtype.
    """
    import torch

    from miles_updater.gather import ST_TO_TORCH

    ranks = [torch.load(Path(out_dir) / f"params-rank{r}.pt") for r in range(world)]
    meta = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
    full: dict[str, torch.Tensor] = {}
    for name, info in meta[0]["params"].items():
        m = LOCAL_EXPERT.match(name)
        if m:  # not TP-split (ETP=1): one tensor per EP rank
            prefix, local, fc, kind = m.groups()
            for r in range(world):
                n_local, ep_rank = meta[r]["n_local_experts"], meta[r]["ep_rank"]
                full[f"{prefix}{fc}.{kind}{ep_rank * n_local + int(local)}"] = ranks[r][name]
            continue
        shards = [ranks[r][name] for r in range(world)]
        if info["pdim"] is None:
            full[name] = shards[0]
        elif GATED_FC1.search(name):
            halves = [s.chunk(2, dim=0) for s in shards]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            full[name] = torch.cat(shards, dim=info["pdim"])
    if hasattr(converter, "reset"):
        converter.reset()
    out = {}
    for name, t in full.items():
        for hf, x in converter(name, t):
            spec = specs[hf]
            if x.shape[0] > spec.shape[0] and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                x = x[: spec.shape[0]]
            out[hf] = x.to(ST_TO_TORCH[spec.dtype]).contiguous()
    return out


def transformers_logits(model_dir: str, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


# the tiny MLA checkpoint both MLA families share (DeepSeek-V3 and GLM-4.7-Flash's lite MoE): q/kv LoRA, a
# dense first layer, shared experts, sigmoid routing with a per-expert bias
TINY_MLA_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    rope_interleave=True, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.3,
)


def write_tiny_checkpoint(model_cls, cfg, out: Path, seed: int, *, bumped=("norm.weight",),
                          expert_bias: str | None = None) -> str:
    """Save ``model_cls(cfg)`` (weights from ``seed``) as a bf16 checkpoint in ``out``. Norms start at 1 and
    biases at 0, so the tensors whose names end in ``bumped`` get noise: every tensor has real bytes. The
    router's ``expert_bias`` tensor, when named, gets fresh fp32 values, as the MoE families' checkpoints keep it."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    model_cls(cfg).save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(path)).items()}
    g = torch.Generator().manual_seed(seed + 1)
    for n in tensors:
        if n.endswith(tuple(bumped)):
            tensors[n] = (tensors[n].float() + torch.randn(tensors[n].shape, generator=g) * 0.3).to(torch.bfloat16)
    if expert_bias is not None:
        tensors[expert_bias] = torch.randn(cfg.n_routed_experts, generator=g) * 0.1
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(out)


def family_fixtures(name: str, make_seed, **run_kw):
    """-> the module fixtures ``family`` ((seed dir, the ranks' out dir, what each rank recorded): the seed
    ``make_seed(dir)`` writes, published by ``run_family(**run_kw)``) and ``published`` (v1 pulled beside the
    seed's config and tokenizer). Assign them to module names ``family, published``."""
    import pytest

    @pytest.fixture(scope="module")
    def family(tmp_path_factory):
        root = tmp_path_factory.mktemp(name)
        seed = make_seed(root / "seed")
        out = root / "run"
        seen = run_family(seed, str(out), **run_kw)
        return seed, out, seen

    @pytest.fixture(scope="module")
    def published(family, tmp_path_factory):
        seed, _, seen = family
        return pull_published(seed, seen, tmp_path_factory.mktemp(f"{name}_local") / "ckpt")

    return family, published


def pull_published(seed: str, seen: list[dict], local: Path) -> Path:
    """Pull v1 into ``local`` and put the seed's config and tokenizer beside the weights: a model
    transformers and sglang can load."""
    import shutil

    from weightsync import pull

    assert pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"]).applied_version == seen[0]["version"]
    for f in Path(seed).iterdir():
        if f.suffix != ".safetensors" and not (local / f.name).exists():  # config, tokenizer
            shutil.copy(f, local / f.name)
    return local


def read_roundtrip(out: Path) -> dict:
    """What the ranks gathered back from the unchanged seed, all ranks' files merged."""
    from safetensors.torch import load_file

    gathered = {}
    for f in sorted(Path(out).glob("roundtrip-rank*.safetensors")):
        gathered.update(load_file(str(f)))
    return gathered


def assert_roundtrip_is_the_seed(family, fp32: str | None = None) -> None:
    """The unchanged weights the ranks gathered back are the seed's bytes; ``fp32`` (a router's expert
    bias) stays in fp32 as the checkpoint keeps it."""
    seed, out, _ = family
    gathered = read_roundtrip(out)
    assert differing(gathered, read_dir(seed)) == []
    if fp32 is not None:
        assert gathered[fp32].dtype.is_floating_point and str(gathered[fp32].dtype) == "torch.float32"


def check_v1_and_list_moved(seed: str, out: Path, published: Path, converter) -> list[str]:
    """Assert the published v1 equals ``converter`` on an independent gather of the ranks' raw parameters;
    return the tensors v1 moved away from the seed."""
    from miles_updater.gather import read_hf_specs

    want = independent_gather(str(out), 2, converter, read_hf_specs(seed))
    got = read_dir(published)
    assert differing(got, want) == []
    return differing(got, read_dir(seed))


def assert_megatron_logits_equal_transformers(out: Path, published: Path, ids) -> None:
    import torch

    ref = transformers_logits(str(published), ids)
    torch.testing.assert_close(torch.load(Path(out) / "logits.pt"), ref, atol=2e-3, rtol=2e-3)


def load_in_sglangs_class(published: Path, model_class: str) -> dict:
    """Build sglang's own ``model_class`` in process (``live_models_child.py``) on the published checkpoint and
    assert it loads every tensor and a live patch equals a reload bit for bit; return the child's report for
    the family's own checks (placements, derivations)."""
    import subprocess

    from testbed.sglang_cpu import cpu_server_env, find_free_port, server_python

    child = HERE.parent / "live_models_child.py"
    done = subprocess.run([server_python(), str(child), str(find_free_port()), f"published={published}"],
                          capture_output=True, text=True, timeout=600, env=cpu_server_env(), cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-4000:]
    out = next(iter(json.loads(done.stdout.strip().splitlines()[-1]).values()))
    assert "error" not in out, out.get("traceback", out)
    assert out["class"] == model_class and out["scope"] is None
    assert out["unused_tensors"] == [] and out["proven"] and not out["reload_only_tensors"], out
    assert out["written"] == out["changed"] > 0 and out["differ_from_reload"] == []
    return out


def assert_miles_converter_equals_published(family: str, args, seed: str, out: Path, seen: list[dict],
                                            local: Path) -> None:
    """miles' own ``family`` converter (skipped without ``MILES_RL_DIR``) on an independent gather of the
    trainer's weights gives the bytes v1 holds, pulled into ``local``."""
    from miles_updater.gather import read_hf_specs
    from weightsync import pull

    want = independent_gather(str(out), 2, miles_converter(family, args), read_hf_specs(seed))
    pull(str(local), seed, seen[0]["source_dir"], seen[0]["version"])
    assert differing(read_dir(local), want) == []


# --- the rank process ---------------------------------------------------------------------------


def _perturb(model, tp_rank: int, ep_rank: int) -> None:
    """Move every weight by a name-seeded amount, identical on the ranks that replicate it, rounded to
    bf16 so the bf16 checkpoint loses nothing Megatron's fp32 forward uses."""
    import torch

    from miles_updater.gather import iter_params

    with torch.no_grad():
        for i, ref in enumerate(iter_params([model])):
            p = ref.param
            split = int(bool(getattr(p, "tensor_model_parallel", False)))
            expert = int(".mlp.experts." in ref.name)
            g = torch.Generator().manual_seed(1000 + i + 17 * tp_rank * split + 31 * ep_rank * expert)
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _worker(rank: int, cfg: dict) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from miles_updater.args import DiskDeltaConfig
    from miles_updater.gather import ST_TO_TORCH, HFWeightGatherer, iter_params, load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater

    init_distributed_cpu(rank, cfg["world"], cfg["port"], tp=cfg["tp"], pp=cfg["pp"], ep=cfg["ep"], etp=cfg["etp"])
    from megatron.core import parallel_state as ps

    out = Path(cfg["out_dir"])
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    mc = model.config  # the fields miles' and slime's converters read from their args
    args = SimpleNamespace(hf_checkpoint=cfg["hf_dir"], num_attention_heads=mc.num_attention_heads,
                           num_query_groups=mc.num_query_groups, kv_channels=mc.kv_channels,
                           hidden_size=mc.hidden_size, num_layers=mc.num_layers)
    gatherer = HFWeightGatherer([model], cfg["hf_dir"], converter=cfg["converter"], args=args)
    tensors = gatherer.gather()
    if tensors:
        save_file({n: torch.frombuffer(bytearray(t.data.tobytes()), dtype=ST_TO_TORCH[t.dtype]).reshape(t.shape)
                   for n, t in tensors.items()}, str(out / f"roundtrip-rank{rank}.safetensors"))
    _perturb(model, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    config = DiskDeltaConfig(source_dir=str(out / "shared"), local_checkpoint_dir=str(out / "unused"),
                             hf_checkpoint=cfg["hf_dir"], converter=cfg["converter"])
    updater = DiskDeltaWeightUpdater(config, [model], args=args)
    updater.start()
    seen = {"source_dir": updater.source_dir, "version": updater.update_weights(update_engines=False).version,
            "converter": updater.gatherer.converter_name, "ep_rank": ps.get_expert_model_parallel_rank(),
            "n_local_experts": gatherer.num_local_experts,
            "params": {ref.name: {"pdim": getattr(ref.param, "partition_dim", 0)
                                  if getattr(ref.param, "tensor_model_parallel", False) else None}
                       for ref in iter_params([model])}}
    torch.save({ref.name: ref.param.detach().clone() for ref in iter_params([model])}, out / f"params-rank{rank}.pt")
    if cfg["logits"] and cfg["pp"] == 1:
        torch.manual_seed(0)
        ids = torch.randint(0, 200, (1, 12))
        model.eval()  # Megatron's MoE refuses TP without sequence parallelism in training mode
        logits = full_vocab_logits(model, ids, cfg["tp"])
        if rank == 0:
            torch.save(logits, out / "logits.pt")
            seen["ids"] = ids.tolist()
    move_weights(model, 2)  # a sparse step: v2 is a delta an engine can apply live
    seen["version2"] = updater.update_weights(update_engines=False).version
    updater.close()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))


MILES_ENV = "MILES_RL_DIR"  # an unpacked miles-rl wheel (pip download miles-rl --no-deps; unzip)
MILES_FILES = {"qwen2": "convert_qwen2_to_hf", "qwen3moe": "convert_qwen3moe_to_hf",
               "glm4moe": "convert_glm4moe_to_hf", "deepseekv3": "convert_deepseekv3_to_hf"}


def miles_converter(family: str, args):
    """miles' own per-family converter as the hook (``module.module.`` prefixed names, its args fields),
    loaded by file path: those files import only ``re`` and ``torch`` (miles' package needs ray, a GPU
    sglang and triton). Local-spec norm names are given their Transformer Engine names first (below).
    Skips the calling test when ``MILES_RL_DIR`` is not set."""
    import importlib.util

    import pytest

    # setup_env.sh unpacks the wheel into .venv/miles-rl; the variable points elsewhere
    default = Path(__file__).resolve().parents[3] / ".venv" / "miles-rl"
    root = os.environ.get(MILES_ENV) or (str(default) if default.is_dir() else None)
    if not root:
        pytest.skip(f"{MILES_ENV} is not set (an unpacked miles-rl wheel)")
    path = Path(root) / "miles" / "backends" / "megatron_utils" / "megatron_to_hf" / f"{family}.py"
    spec = importlib.util.spec_from_file_location(f"miles_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, MILES_FILES[family])
    te = dict(TE_NORM_NAMES, **(TE_MLA_NORM_NAMES if family == "deepseekv3" else {}))

    def convert(name, t):
        m = re.match(r"^(decoder\.layers\.\d+\.)(.+)$", name)
        if m and m.group(2) in te:
            name = m.group(1) + te[m.group(2)]
        return fn(args, "module.module." + name, t)

    return convert


# miles trains with Transformer Engine's layer spec, where these norms are fused into the next linear and
# named after it; our CPU ranks use Megatron's local spec (same tensors, separate modules)
TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
TE_MLA_NORM_NAMES = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
                     "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
