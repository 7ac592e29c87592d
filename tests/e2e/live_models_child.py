"""Child process of test_live_map_models.py: sglang's own model classes, built on the CPU in a
one-rank gloo group (``init_one_rank``), each mapped on a storage-free copy, proven, patched and
compared bit for bit with a reload; plus the cases live apply must refuse (a one-element parameter
loaded through ``.item()``, an MLA layer whose derived ``w_kc``/``w_vc`` the rule of
``live.mapping.derived`` cannot prove, sglang's own refusal of online updates, a class off the allow-list).
The MLA classes (DeepSeek-V2/V3, GLM-4 MoE Lite) are allow-listed: their ``w_kc``/``w_vc`` are
re-derived live and compared with a reload too, after an apply and after a rollback.
``benchmarks/gpu_check.py`` imports its one-rank setup from here. The MoE classes run only in process: sglang cannot serve an MoE on this CPU (its
fused-MoE kernels need sgl_kernel's CPU build or triton on a GPU). One case alone:
``python live_models_child.py PORT qwen3_moe``.

Prints one JSON line: ``{case: result}``; a case that raised carries ``error``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch


def init_sglang_single_rank(port: int) -> None:
    """A one-rank gloo group with sglang's parallel state, through 0.5.23's spawn-time publish."""
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


def init_one_rank(port: int) -> None:
    """A one-rank gloo group with sglang's parallel state and server args, on either release."""
    from sglang.srt import runtime_context

    if hasattr(runtime_context, "SpawnRanks"):  # 0.5.23: the spawn-time publish
        init_sglang_single_rank(port)
        return
    # 0.5.16: parallel state from the globals, server args through the legacy shim
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from types import SimpleNamespace

    from sglang.srt.layers.dp_attention import initialize_dp_attention

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")
    server_args = ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu")
    set_global_server_args_for_scheduler(server_args)
    initialize_dp_attention(server_args, SimpleNamespace(hf_config=SimpleNamespace(), hidden_size=32, dtype=torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    from sglang_patch.live.mapping.coordinate_map import as_int_bits

    return as_int_bits(t.detach())


def _state_of_tree(model: torch.nn.Module) -> dict:
    """What a loader run could change on the serving model besides parameter values."""
    return {
        "ptrs": {n: p.data_ptr() for n, p in model.named_parameters()},
        "ids": {n: id(p) for n, p in model.named_parameters()},
        "attrs": {name: sorted(m.__dict__) for name, m in model.named_modules()},
    }


def derived_state(model: torch.nn.Module) -> dict:
    """Every tensor a module keeps besides its parameters (MLA's ``w_kc``/``w_vc``, buffers, any
    other tensor attribute a loader may derive), by module path: a reload's must equal them too."""
    out = {}
    for path, m in model.named_modules():
        for k, v in list(m.__dict__.items()) + list(m._buffers.items()):
            if type(v) is torch.Tensor and v.numel():
                out[f"{path}.{k}"] = v
    return out


def _differ(a: dict, b: dict) -> list:
    return sorted(n for n in a if n not in b or not torch.equal(_bits(a[n]), _bits(b[n])))


def patch_like_a_reload(model: torch.nn.Module, v0: dict, *, seed: int = 1, before_proof=None) -> dict:
    """Map ``model`` (sglang's class), prove it after a real load of ``v0``, patch a few elements of
    every mapped tensor live (re-deriving what ``live.mapping.derived`` covers), roll that back and apply it
    again, and compare with a real load of the new version. ``before_proof(model)``: a test's
    change to the loaded model before the proof."""
    from sglang_patch.live.mapping import derived
    from sglang_patch.live.check import check_update
    from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map
    from sglang_patch.live.scatter.patch import StagedUpdate, StagingRefused, scatter_with_undo, stage_update
    from sglang_patch.live.mapping.scope import why_engine_reload_only

    specs = [TensorSpec(n, tuple(t.shape), "BF16") for n, t in v0.items()]
    params = {n: p.data for n, p in model.named_parameters()}
    before_vals = {n: p.clone() for n, p in params.items()}
    before_tree = _state_of_tree(model)
    cmap = build_coordinate_map(model, specs, derivable=derived.derivable_params(model))
    untouched = all(torch.equal(_bits(params[n]), _bits(before_vals[n])) for n in params)
    tree_unchanged = _state_of_tree(model) == before_tree
    model.load_weights(iter(v0.items()))
    if before_proof is not None:
        before_proof(model)
    proven = prove_map(cmap, params, lambda n: v0[n], prove_derived=derived.prover(model))

    g = torch.Generator().manual_seed(seed)
    v1 = {n: t.clone() for n, t in v0.items()}
    changed = {}
    for n in sorted(cmap.placements):
        flat = v1[n].view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[:5].sort().values
        flat[pos] = (flat[pos].float() + 1.0).to(flat.dtype)  # bf16, or fp32 (GLM's e_score_correction_bias)
        changed[n] = pos.numpy().astype("int64")

    class Reader:
        def tensor(self, name):
            return v1[name]

    out = {
        "class": type(model).__name__,
        "scope": why_engine_reload_only(model),
        "params": sorted(params),
        "untouched_while_mapping": untouched,
        "tree_unchanged_while_mapping": tree_unchanged,
        "proven": proven,
        "proven_params": sorted(cmap.proven_params),
        "reload_only_params": cmap.reload_only_params,
        "reload_only_tensors": cmap.reload_only_tensors,
        "unused_tensors": sorted(cmap.unused_tensors),
        "placements": {n: len(ps) for n, ps in cmap.placements.items()},
        "tensors": sorted(v0),
        "derived_params": cmap.derived_params,
        "derivations": sorted(cmap.derivations),
        "why_reload_only": {n: cmap.why_reload_only(n) for n in sorted(v0) if cmap.why_reload_only(n)},
        "build_s": cmap.build_s,
        "nbytes": cmap.nbytes(),
    }
    try:
        staged = stage_update(
            cmap, params, ((n, None, p) for n, p in sorted(changed.items())), Reader(), max_elements=10**9,
            staged=StagedUpdate(0, 1, None, "/nowhere", 0),
        )
    except StagingRefused as exc:  # a reload-only tensor changed: the update reloads
        out["staging_refused"] = exc.reason
        return out
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    derived_v0 = {n: t.clone() for n, t in derived_state(model).items()}
    derived_ptrs = {n: t.data_ptr() for n, t in derived_state(model).items()}
    params_v0 = {n: p.clone() for n, p in params.items()}

    # apply, then roll back: the undo log restores the parameters, the rule re-derives the rest
    undo, written = scatter_with_undo(staged)
    out["rederived"] = derived.refresh(cmap.derivations, staged.patches)
    out["derived_changed_by_apply"] = _differ(derived_v0, derived_state(model))  # w_kc/w_vc only, if any
    restored = undo.restore()
    derived.refresh(cmap.derivations, staged.patches)
    out["rollback_restored"] = restored.restored
    out["undo_log_params"] = sorted({p.param for p in staged.patches})
    out["differ_after_rollback"] = _differ(params_v0, params) + _differ(derived_v0, derived_state(model))

    # apply again, check it as a commit would, and compare with a reload
    _, written = scatter_with_undo(staged)
    derived.refresh(cmap.derivations, staged.patches)
    check = check_update("dp0/tp0", cmap, params, lambda n: v1[n], version=1, counter=1, patches=staged.patches)
    out["check"] = {"verified": check.verified_elements, "mismatches": check.mismatches, "detail": check.detail}
    if cmap.derivations:  # a stale w_kc element is caught by the check
        d = next(iter(cmap.derivations.values()))
        keep = d.w_kc[0, 0, 0].clone()
        d.w_kc[0, 0, 0] += 1
        stale = check_update("dp0/tp0", cmap, params, lambda n: v1[n], version=1, counter=2, patches=staged.patches)
        out["check_of_a_stale_w_kc"] = {"mismatches": stale.mismatches, "detail": stale.detail}
        d.w_kc[0, 0, 0] = keep
    live = {n: p.clone() for n, p in params.items()}
    live_derived = {n: t.clone() for n, t in derived_state(model).items()}
    model.load_weights(iter(v1.items()))  # the reload
    out.update({
        "written": written,
        "changed": sum(len(p) for p in changed.values()),
        "pointers_unchanged": all(p.data_ptr() == ptrs[n] for n, p in params.items()),
        "derived_pointers_unchanged": {n: t.data_ptr() for n, t in derived_state(model).items()} == derived_ptrs,
        "differ_from_reload": [n for n, p in params.items() if not torch.equal(_bits(live[n]), _bits(p))]
        + _differ(live_derived, derived_state(model)),
        "derived_tensors": sorted(n for n in live_derived if n.endswith((".w_kc", ".w_vc"))),
        "other_tensor_state": len(live_derived),
    })
    return out


def _bf16(state: dict) -> dict:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in state.items()}


def qwen3(tied: bool) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM as HF

    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return patch_like_a_reload(Qwen3ForCausalLM(cfg).to(torch.float32), _bf16(HF(cfg).state_dict()))


def qwen2(tied: bool) -> dict:
    """Qwen2 / Qwen2.5: q/k/v biases stacked into qkv_proj beside the weights; the small Qwen2.5 models tie lm_head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM as HF

    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    v0 = _bf16(HF(cfg).state_dict())
    for n in [n for n in v0 if n.endswith("_proj.bias")]:
        v0[n] = torch.randn(v0[n].shape).to(torch.bfloat16)  # transformers initialises biases to zero
    return patch_like_a_reload(Qwen2ForCausalLM(cfg).to(torch.float32), v0)


def llama() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM as HF

    from sglang.srt.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return patch_like_a_reload(LlamaForCausalLM(cfg).to(torch.float32), _bf16(HF(cfg).state_dict()))


def qwen3_moe() -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM as HF

    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )
    torch.manual_seed(0)
    v0 = per_expert_checkpoint(HF(cfg).state_dict(), cfg.moe_intermediate_size)
    return patch_like_a_reload(Qwen3MoeForCausalLM(cfg).to(torch.float32), v0)


def glm4_moe() -> dict:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM as HF

    from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=128,
        tie_word_embeddings=False, partial_rotary_factor=0.5, use_qk_norm=True,
    )
    torch.manual_seed(0)
    v0 = per_expert_checkpoint(HF(cfg).state_dict(), cfg.moe_intermediate_size)
    return patch_like_a_reload(Glm4MoeForCausalLM(cfg).to(torch.float32), v0)


def scalar_parameter() -> dict:
    """A one-element parameter loaded by sglang's own ``default_weight_loader`` (``fill_(w.item())``,
    as mllama's cross-attention gates and FP8 KV ``k_scale``/``v_scale`` are)."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            self.proj = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, w in weights:
                default_weight_loader(params[name.removesuffix(".weight")], w)

    ckpt = {"gate.weight": torch.tensor([0.5]).to(torch.bfloat16), "proj.weight": torch.randn(4, 4).to(torch.bfloat16)}
    model = Gated()
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "BF16") for n, t in ckpt.items()])
    model.load_weights(iter(ckpt.items()))
    prove_map(cmap, {n: p.data for n, p in model.named_parameters()}, lambda n: ckpt[n])
    return {
        "unused_tensors": sorted(cmap.unused_tensors),
        "reload_only_tensors": cmap.reload_only_tensors,
        "why_gate": cmap.why_reload_only("gate.weight"),
        "why_proj": cmap.why_reload_only("proj.weight"),
        "proven_params": sorted(cmap.proven_params),
    }


def mla_config(q_lora_rank=None, architecture="DeepseekV2ForCausalLM"):
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # sglang's CPU MLA rope
    )
    cfg.moe_layer_freq = 1  # sglang reads the DeepSeek checkpoints' field, transformers' config lacks it
    cfg.architectures = [architecture]  # sglang 0.5.16 reads it while building
    cfg.scoring_func, cfg.topk_method = "softmax", "greedy"  # DeepSeek-V2's router; transformers' config lacks them
    return cfg


def mla(before_proof=None, layout=None, architecture="DeepseekV2ForCausalLM", q_lora_rank=None) -> dict:
    """sglang's DeepSeek-V2/V3 classes: ``post_load_weights`` derives ``w_kc``/``w_vc`` from
    ``kv_b_proj``. ``layout(model)``: a change to the serving model before the map is learnt."""
    from transformers import DeepseekV2ForCausalLM as HF

    from sglang.srt.models import deepseek_v2

    cfg = mla_config(q_lora_rank=q_lora_rank, architecture=architecture)
    torch.manual_seed(0)
    v0 = per_expert_checkpoint(HF(cfg).state_dict(), cfg.moe_intermediate_size)
    model = getattr(deepseek_v2, architecture)(cfg).to(torch.float32)
    attn = model.model.layers[0].self_attn
    before = {k: attn.__dict__.get(k) for k in ("w_kc", "w_vc")}
    if layout is not None:
        layout(model)
    out = patch_like_a_reload(model, v0, before_proof=before_proof)
    out["serving_w_kc_w_vc_untouched_while_mapping"] = before == {"w_kc": None, "w_vc": None}
    return out


def _perturb_w_kc(model) -> None:
    model.model.layers[1].self_attn.w_kc[1, 2, 3] += 1  # as a derivation the rule does not repeat would


def _quantized_kv_b(model) -> None:
    # what a quantized kv_b_proj carries (sglang then requantizes in post_load_weights)
    model.model.layers[1].self_attn.kv_b_proj.weight_scale = torch.ones(1)


def glm4_moe_lite(q_lora_rank: int) -> dict:
    """sglang's GLM-4 MoE Lite (GLM-4.7-Flash): MLA through the same mixin, its own load_weights."""
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM as HF

    from sglang.srt.models.glm4_moe_lite import Glm4MoeLiteForCausalLM

    cfg = Glm4MoeLiteConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    v0 = per_expert_checkpoint(HF(cfg).state_dict(), cfg.moe_intermediate_size)
    return patch_like_a_reload(Glm4MoeLiteForCausalLM(cfg).to(torch.float32), v0)


def sglang_refusal() -> dict:
    """sglang's own refusal of online updates (``_derived_weight_cache_error`` on a module) is live apply's."""
    from transformers import Qwen3Config

    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang_patch.live.mapping.scope import why_engine_reload_only

    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            _unsupported_derived_weight_cache_error as sglang_check,
        )
    except ImportError:
        sglang_check = None
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    model = Qwen3ForCausalLM(cfg)
    clean = why_engine_reload_only(model)
    model.model.layers[0].mlp._derived_weight_cache_error = "test: a derived cache the loader does not refresh"
    return {
        "sglang_has_the_check": sglang_check is not None,
        "sglang_reason": sglang_check(model) if sglang_check else None,
        "clean": clean,
        "refused": why_engine_reload_only(model),
    }


def off_the_list() -> dict:
    from sglang.srt.models.llama import Phi3ForCausalLM
    from sglang_patch.live.mapping.scope import why_engine_reload_only

    return {"why": why_engine_reload_only(object.__new__(Phi3ForCausalLM))}


CASES = {
    "qwen3": lambda: qwen3(tied=False), "qwen3_tied": lambda: qwen3(tied=True), "llama": llama,
    "qwen2": lambda: qwen2(tied=False), "qwen2_tied": lambda: qwen2(tied=True),
    "qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe, "scalar_parameter": scalar_parameter, "mla": mla,
    # DeepSeek-V3 and GLM-4.7-Flash ship a q_lora_rank: sglang fuses q_a_proj and kv_a_proj_with_mqa by torch.cat
    "mla_v3": lambda: mla(architecture="DeepseekV3ForCausalLM", q_lora_rank=8),
    "glm4_moe_lite": lambda: glm4_moe_lite(q_lora_rank=8),
    "mla_w_kc_perturbed": lambda: mla(before_proof=_perturb_w_kc),
    "mla_quantized_kv_b": lambda: mla(layout=_quantized_kv_b),
    "sglang_refusal": sglang_refusal, "off_the_list": off_the_list,
}


PUBLISHED_CLASSES = {  # architecture -> sglang module
    "Qwen2ForCausalLM": "qwen2", "Qwen3MoeForCausalLM": "qwen3_moe", "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v2", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
}


def published(model_dir: str) -> dict:
    """A checkpoint our trainer published (``tests/e2e/megatron``): sglang's own class for its architecture
    loads every tensor of it, and the map proven on it patches live bit-identical to a reload."""
    import glob
    import importlib

    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    arch = cfg.architectures[0]
    if arch == "DeepseekV3ForCausalLM":  # fields sglang reads that transformers' config lacks
        cfg.moe_layer_freq = 1
        cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
        # sglang's CPU MLA rope is built only for yarn: factor 1 leaves the weights' meaning as it is
        cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "beta_fast": 32.0,
                               "original_max_position_embeddings": cfg.max_position_embeddings,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cls = getattr(importlib.import_module(f"sglang.srt.models.{PUBLISHED_CLASSES[arch]}"), arch)
    v0 = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        v0.update(load_file(f))
    torch.manual_seed(0)
    return patch_like_a_reload(cls(cfg).to(torch.float32), v0)


def main() -> None:
    init_one_rank(int(sys.argv[1]))
    out = {}
    wanted = sys.argv[2:] or list(CASES)
    for name in [w for w in wanted if w.startswith("published=")]:
        try:
            out[name] = published(name.split("=", 1)[1])
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    for name, case in CASES.items():
        if name not in wanted:
            continue
        try:
            out[name] = case()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
