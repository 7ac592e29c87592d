"""Helpers for the in-process sglang tests (``test_live_map_models.py``, ``benchmarks/gpu_check.py``):
a one-rank gloo group with sglang's parallel state, and Qwen3-MoE's per-expert HF checkpoint
layout. Run alone, it maps, proves and patches sglang's Qwen3-MoE class in process (sglang cannot
serve an MoE on this CPU: its fused-MoE kernels need sgl_kernel's CPU build or triton on a GPU)
and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def init_sglang_single_rank(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def per_expert_checkpoint(state: dict, inter: int) -> dict:
    """The on-disk HF layout of Qwen3-MoE (``experts.{e}.{gate,up,down}_proj.weight``, bf16):
    transformers fuses the experts in memory, sglang's loader reads them one by one."""
    out = {}
    for name, t in state.items():
        t = t.detach().to(torch.bfloat16)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def main() -> None:
    port = int(sys.argv[1])
    init_sglang_single_rank(port)
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HFMoe

    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang_patch.coordinate_map import TensorSpec, build_coordinate_map, prove_map
    from sglang_patch.live_patch import StagedUpdate, scatter_with_undo, stage_update

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )
    torch.manual_seed(0)
    v0 = per_expert_checkpoint(HFMoe(cfg).state_dict(), cfg.moe_intermediate_size)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    specs = [TensorSpec(n, tuple(t.shape), "BF16") for n, t in v0.items()]
    params = {n: p.data for n, p in model.named_parameters()}
    before = {n: p.clone() for n, p in params.items()}
    cmap = build_coordinate_map(model, specs)
    untouched = all(torch.equal(params[n].view(torch.int32), before[n].view(torch.int32)) for n in params)
    model.load_weights(iter(v0.items()))
    proven = prove_map(cmap, params, lambda n: v0[n])

    # v1: change a few elements of every expert tensor and of an attention weight
    g = torch.Generator().manual_seed(1)
    v1 = {n: t.clone() for n, t in v0.items()}
    changed = {}
    for n, t in v1.items():
        if ".experts." in n or n.endswith("qkv_proj.weight") or n.endswith("k_proj.weight"):
            flat = t.view(-1)
            pos = torch.randperm(flat.numel(), generator=g)[:5].sort().values
            flat[pos] = (flat[pos].float() + 1.0).to(torch.bfloat16)
            changed[n] = pos.numpy().astype("int64")

    class Reader:
        def tensor(self, name):
            return v1[name]

    staged = stage_update(
        cmap, params, ((n, None, p) for n, p in sorted(changed.items())), Reader(), max_elements=10**9,
        staged=StagedUpdate(0, 1, None, "/nowhere", 0),
    )
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    _, written = scatter_with_undo(staged)
    live = {n: p.clone() for n, p in params.items()}
    model.load_weights(iter(v1.items()))  # the reload
    reloaded = {n: p.clone() for n, p in params.items()}
    expert_placements = sum(len(v) for k, v in cmap.placements.items() if ".experts." in k)
    print(json.dumps({
        "params": sorted(params),
        "untouched_while_mapping": untouched,
        "proven": proven,
        "proven_params": sorted(cmap.proven_params),
        "reload_only_params": cmap.reload_only_params,
        "reload_only_tensors": cmap.reload_only_tensors,
        "expert_tensors": sum(1 for n in v0 if ".experts." in n),
        "expert_placements": expert_placements,
        "written": written,
        "changed": sum(len(p) for p in changed.values()),
        "pointers_unchanged": all(p.data_ptr() == ptrs[n] for n, p in params.items()),
        "bit_identical_to_reload": [n for n in params if not torch.equal(live[n].view(torch.int32), reloaded[n].view(torch.int32))],
        "build_s": cmap.build_s,
        "nbytes": cmap.nbytes(),
    }))


if __name__ == "__main__":
    main()
