"""Which engines live apply may patch at all: the model classes proven exact, and the engine
state that rules it out whatever the map says.

Live apply covers exactly what it can prove. The coordinate map proves *where* each checkpoint
element lands; it cannot prove that a model class keeps no other state derived from its
weights. So the class itself must be on ``ALLOW_LIST``: each entry is proven by an in-process
test with sglang's own class (``tests/e2e/test_live_map_models.py``): mapped on a storage-free
copy, proven, patched, and compared bit for bit with a reload of the new version. Any other
class reloads on every update, saying so.

Engine-wide reasons (each makes every update a reload, with the reason in the reply):
- the model class is not on the allow-list;
- sglang itself refuses online updates of this model (its derived-weight cache checks,
  ``compat.derived_weight_cache_error``): live apply honours them with sglang's reason;
- speculative decoding: a reload also reloads the draft model, a live patch would not;
- EPLB or a non-trivial initial expert location: experts move between ranks behind the map;
- sglang's weight cache daemon shares the weights with other engines.
"""

from __future__ import annotations

from typing import Any, Optional

from ... import compat

# model class (module.qualname) -> the family it serves; each has its in-process proof
ALLOW_LIST = {
    "sglang.srt.models.qwen3.Qwen3ForCausalLM": "Qwen3 (dense)",
    "sglang.srt.models.qwen2.Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (dense)",
    "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM": "Qwen3 MoE",
    "sglang.srt.models.llama.LlamaForCausalLM": "Llama",
    "sglang.srt.models.glm4_moe.Glm4MoeForCausalLM": "GLM-4 MoE",
    # MLA: w_kc/w_vc re-derived live from an unquantized kv_b_proj (live.mapping.derived); anything else
    # in these models that the map cannot follow is reload-only, with its reason
    "sglang.srt.models.glm4_moe_lite.Glm4MoeLiteForCausalLM": "GLM-4 MoE Lite (GLM-4.7-Flash, MLA)",
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM": "DeepSeek-V2 (MLA)",
    "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM": "DeepSeek-V3 (MLA)",
}


def model_class_of(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def why_not_allowed(model: Any) -> Optional[str]:
    """Why live apply may not patch this model class (exactly the class: a subclass can add state)."""
    name = model_class_of(model)
    if name in ALLOW_LIST:
        return None
    return (f"model class {type(model).__name__} ({name}) is not on live apply's allow-list "
            f"({', '.join(sorted(set(ALLOW_LIST.values())))}): every update reloads")


def why_sglang_refuses(model: Any) -> Optional[str]:
    """sglang's own reason to refuse online updates of ``model`` (None: it has none)."""
    try:
        reason = compat.derived_weight_cache_error(model)
    except Exception as exc:  # the check itself failed: do not guess that the model is clean
        return f"sglang's derived-weight cache check failed: {type(exc).__name__}: {exc}"
    return f"sglang refuses online weight updates of this model: {reason}" if reason else None


def why_engine_reload_only(model: Any, server_args: Any = None, scheduler: Any = None) -> Optional[str]:
    """The first engine-wide reason every update must reload, or None."""
    why = why_not_allowed(model)
    if why is not None:
        return why
    if server_args is not None:
        spec = getattr(server_args, "speculative_algorithm", None)
        if spec not in (None, "", "NONE") or getattr(scheduler, "draft_worker", None) is not None:
            return (f"speculative decoding ({spec or 'a draft worker'}) is on: a reload also reloads the draft "
                    "model, a live patch would leave it at the old version")
        if getattr(server_args, "enable_eplb", False) or int(getattr(server_args, "ep_num_redundant_experts", 0) or 0) \
                or (getattr(server_args, "init_expert_location", "trivial") or "trivial") != "trivial":
            return "EPLB or a non-trivial expert location is on: experts move between ranks behind the coordinate map"
        cache_mode = getattr(server_args, "weight_cache_mode", None)
        if cache_mode not in (None, "", "off"):
            return f"sglang's weight cache is active (--weight-cache-mode {cache_mode}): the weights are shared"
    return why_sglang_refuses(model)


class EngineScope:
    """The engine-wide checks of one scheduler rank (``make_state`` gives one to ``LiveApplyState``)."""

    def __init__(self, server_args: Any, scheduler: Any) -> None:
        self.server_args = server_args
        self.scheduler = scheduler

    def why_reload_only(self, model: Any) -> Optional[str]:
        """Before the map is built: why this engine must reload on every update, or None."""
        return why_engine_reload_only(model, self.server_args, self.scheduler)

    def why_refused_now(self, model: Any) -> Optional[str]:
        """At each staging: sglang's own refusal, in case a module declared one after start-up."""
        return why_sglang_refuses(model)
