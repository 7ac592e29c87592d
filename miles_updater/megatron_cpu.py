"""Megatron-core on the CPU with gloo: the few shims it needs, and a GPTModel built from an HF config.

Role: CPU scaffolding for tests and the demo (production runs Megatron on GPUs and never imports
this module). megatron-core 0.19.2 assumes CUDA in three places a tiny CPU model hits:
1. ``torch.cuda.current_device()`` is used as a ``device=`` argument (RoPE, buffers): it must
   return ``"cpu"``;
2. the CUDA RNG tracker's ``fork()`` is entered around every TP-split init/dropout: it must be a
   null context;
3. the fused/causal mask path needs an explicit boolean causal ``attention_mask``
   (``causal_attention_mask``) on the CPU;
5. megatron-core 0.19.2's local MLA spec passes ``k_channels``/``v_channels`` to ``DotProductAttention``,
   which does not take them: ``build_gpt_model`` swaps in ``_MLADotProductAttention``;
4. with tied embeddings and PP > 1, the first/last-stage copies are all-reduced after
   ``weight.data.cuda()``: ``Tensor.cuda`` must be a no-op on a machine without CUDA.
``apply_cpu_shims`` installs 1, 2 and 4 (idempotent); callers pass 3.

Invariant: ``load_hf_checkpoint`` + ``gather_hf_tensors`` round-trips an HF checkpoint bit for bit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os

import torch

_SHIMS_APPLIED = False


def apply_cpu_shims() -> None:
    """Install the two process-wide CPU shims Megatron needs (see the module docstring)."""
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as tp_random

    tracker = tp_random.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    _SHIMS_APPLIED = True


def causal_attention_mask(seq_len: int) -> torch.Tensor:
    """Boolean mask, True where attention is *not* allowed (Megatron's convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def init_distributed_cpu(
    rank: int, world_size: int, master_port: int, *, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234,
    backend: str = "gloo", timeout_s: float | None = None, etp: int | None = None, vpp: int | None = None,
) -> None:
    """Process group on 127.0.0.1 + Megatron model-parallel groups (CPU shims applied for gloo).

    ``backend="nccl"`` is for the GPU test (one GPU per rank, already selected); no shims then.
    ``timeout_s``: the collective timeout of the world and of Megatron's groups (default: 10 minutes
    for the world, Megatron's own default for its groups); whole minutes for Megatron's groups.
    ``etp``: the experts' tensor-parallel size (default: ``tp``; 1 lets EP span the TP ranks).
    ``vpp``: virtual pipeline chunks per rank (build each with ``build_gpt_model(..., vp_stage=i)``).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if backend == "gloo":
        apply_cpu_shims()
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=600 if timeout_s is None else timeout_s),
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        **({} if etp is None else {"expert_tensor_parallel_size": etp}),
        **({} if vpp is None else {"virtual_pipeline_model_parallel_size": vpp}),
        **({} if timeout_s is None else {"distributed_timeout_minutes": max(1, round(timeout_s / 60))}),
    )
    torch.manual_seed(seed)


def destroy_distributed_cpu() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def read_hf_config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def transformer_config_from_hf(hf: dict, *, params_dtype: torch.dtype = torch.float32):
    """A Megatron TransformerConfig for an HF Qwen2/3, Llama, GLM-4.5 MoE or DeepSeek-V3 (MLA) config
    (CPU-friendly: no fusions)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    arch = (hf.get("architectures") or [""])[0]
    heads = hf["num_attention_heads"]
    moe: dict = {}
    # transformers 5 writes num_local_experts; older Qwen3-MoE configs say num_experts; GLM/DeepSeek n_routed_experts.
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    if num_experts:
        moe = dict(num_moe_experts=num_experts, moe_router_topk=hf.get("num_experts_per_tok", 2),
                   moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_grouped_gemm=False,
                   moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none")
    if hf.get("n_routed_experts"):  # GLM-4.5 / DeepSeek-V3: sigmoid routing with a per-expert bias, shared experts
        first_dense, layers = hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]
        groups = hf.get("n_group") or 1
        moe.update(
            moe_layer_freq=[0] * first_dense + [1] * (layers - first_dense),
            moe_shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"] or None,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=hf.get("routed_scaling_factor") or 1.0, moe_router_dtype="fp32",
            **({"moe_router_num_groups": groups, "moe_router_group_topk": hf.get("topk_group")} if groups > 1 else {}),
        )
    extra: dict = {}
    cls = TransformerConfig
    if hf.get("kv_lora_rank"):  # multi-latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash)
        cls = MLATransformerConfig
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        extra = dict(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                     qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf["v_head_dim"], rope_type="rope", rotary_base=rope.get("rope_theta", 10000))
        # Megatron's MLA rope always takes the rotary dims interleaved, as DeepSeek's checkpoints hold them
        # (transformers: rope_interleave=True, its default)
    return cls(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", arch.startswith("Qwen2"))),  # Qwen2/2.5: always q/k/v biases
        qk_layernorm=arch.startswith("Qwen3") or bool(hf.get("use_qk_norm")) or bool(hf.get("kv_lora_rank")),
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=_ps_size("tp"),
        pipeline_model_parallel_size=_ps_size("pp"),
        expert_model_parallel_size=_ps_size("ep"),
        expert_tensor_parallel_size=_ps_size("etp"),
        **moe,
        **extra,
    )


def _ps_size(which: str) -> int:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return {
        "tp": ps.get_tensor_model_parallel_world_size,
        "pp": ps.get_pipeline_model_parallel_world_size,
        "ep": ps.get_expert_model_parallel_world_size,
        "etp": ps.get_expert_tensor_parallel_world_size,
    }[which]()


def build_gpt_model(hf_dir: str, *, params_dtype: torch.dtype = torch.float32, vp_stage: int | None = None,
                    mtp_num_layers: int = 0):
    """This rank's GPTModel stage (its virtual chunk ``vp_stage``) for the HF checkpoint's architecture
    (random weights), with ``mtp_num_layers`` multi-token-prediction layers after the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not torch.cuda.is_available():
        apply_cpu_shims()
    hf = read_hf_config(hf_dir)
    config = transformer_config_from_hf(hf, params_dtype=params_dtype)
    if vp_stage is not None:
        config.virtual_pipeline_model_parallel_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if mtp_num_layers:
        config.mtp_num_layers = mtp_num_layers
    if isinstance(config.moe_layer_freq, list):  # dense and MoE layers mixed (GLM-4.5, DeepSeek-V3)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm",
            multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)),
        )
    if getattr(config, "multi_latent_attention", False):
        _use_mla_core_attention(spec)
    mtp = {}
    if mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        layer = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
        mtp = {"mtp_block_spec": get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False, vp_stage=vp_stage)}
    rope = hf.get("rope_parameters") or {}
    return GPTModel(
        config, spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(hf.get("rope_theta") or rope.get("rope_theta", 10000)),
        rotary_percent=float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
        **mtp,
    )


def _mla_dot_product_attention():
    import copy

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class _MLADotProductAttention(DotProductAttention):
        """Megatron's unfused attention for MLA: its output has ``v_channels`` per head (the q/k head size
        only enters the softmax scale, which MLA passes)."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            if v_channels is not None:
                config = copy.copy(config)
                config.kv_channels = v_channels
            super().__init__(config, *args, **kwargs)

    return _MLADotProductAttention


def _use_mla_core_attention(spec) -> None:
    """Swap the MLA layers' core attention in a layer or block spec (see the module docstring, 5)."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    cls = _mla_dot_product_attention()
    for layer in layers:
        attn = getattr(layer.submodules, "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is not None and hasattr(sub, "core_attention"):
            sub.core_attention = cls
