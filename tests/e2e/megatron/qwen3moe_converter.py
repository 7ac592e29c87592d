"""A Qwen3-MoE Megatron -> HF converter written the way miles' and slime's are (a regex per name, the
layout read from the trainer's args), independently of ``miles_updater.hf_mapping``: what a user passes
as ``--update-weight-converter qwen3moe_converter.make_converter``.

Stateful on purpose, as slime's MLA conversion is: a layer's ``gate_proj``/``up_proj`` of each expert
come out of one call, but the router is held back until the layer's first expert arrives (the gather
must still see every tensor exactly once per gather, and ``reset`` drops what a failed gather left).
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")


class Qwen3MoeConverter:
    def __init__(self, args):
        self.heads = args.num_attention_heads
        self.groups = args.num_query_groups
        self.head_dim = args.kv_channels
        self.held: dict[str, list] = {}

    def reset(self) -> None:
        self.held.clear()

    def __call__(self, name, t):
        if name == "embedding.word_embeddings.weight":
            return [("model.embed_tokens.weight", t)]
        if name == "output_layer.weight":
            return [("lm_head.weight", t)]
        if name == "decoder.final_layernorm.weight":
            return [("model.norm.weight", t)]
        layer, rest = _LAYER.match(name).groups()
        p = f"model.layers.{layer}."
        if rest == "self_attention.linear_qkv.weight":
            per = self.heads // self.groups + 2
            g = t.view(self.groups, per, self.head_dim, -1)
            q, k, v = g[:, : per - 2], g[:, per - 2], g[:, per - 1]
            return [(p + "self_attn.q_proj.weight", q.reshape(-1, t.shape[-1])),
                    (p + "self_attn.k_proj.weight", k.reshape(-1, t.shape[-1])),
                    (p + "self_attn.v_proj.weight", v.reshape(-1, t.shape[-1]))]
        simple = {
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "input_layernorm.weight": "input_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        }
        if rest in simple:
            return [(p + simple[rest], t)]
        if rest == "mlp.router.weight":
            self.held[layer] = [(p + "mlp.gate.weight", t)]
            return []
        m = _EXPERT.match(rest)
        if m:
            fc, e = m.groups()
            e_pre = p + f"mlp.experts.{e}."
            out = self.held.pop(layer, [])
            if fc == "linear_fc1":
                gate, up = t.chunk(2, dim=0)
                return out + [(e_pre + "gate_proj.weight", gate), (e_pre + "up_proj.weight", up)]
            return out + [(e_pre + "down_proj.weight", t)]
        raise KeyError(f"qwen3moe_converter: unknown Megatron name {name}")


def make_converter(args):
    return Qwen3MoeConverter(args)
