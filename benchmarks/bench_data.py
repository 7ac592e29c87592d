"""Synthetic but realistic data for the sync benchmark: a Qwen3-shaped bf16 checkpoint and a
stream of RL updates.

The trainer keeps fp32 master weights and Adam moments; each step draws a gradient, takes an
Adam step at the step's learning rate and publishes the weights rounded to bf16 (round to
nearest even, torch's cast). Which bf16 elements change depends on the learning rate against
each weight's ulp, as in a real run: small weights move by several ulps, large ones by none.
Gradients carry a persistent per-row scale (some neurons get more signal) and the embedding
gets gradient only in rows whose tokens appear in the step's batch, as in RL fine-tuning.

torch does the arithmetic (multi-threaded; GPU when asked); the benchmark itself only ever
sees numpy uint16 views of the bf16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


PRESETS = {
    # ~300 MB of bf16, 90 tensors: fits a 2-core CI box in a few minutes
    "small": Shape(hidden=1024, intermediate=3072, layers=8, heads=16, kv_heads=4, head_dim=64, vocab=32768),
    # tiny, for tests of the benchmark itself
    "tiny": Shape(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=4096),
    # the real Qwen3-4B layout (tied embeddings): 8.0 GB of bf16, 398 tensors
    "qwen3-4b": Shape(hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936),
}

# (learning rate, label): realistic RL steps, then one dense step where a full version must win
DEFAULT_STEPS = [(1e-6, "lr1e-6"), (2e-6, "lr2e-6"), (5e-6, "lr5e-6"), (1e-5, "lr1e-5"), (3e-6, "lr3e-6"),
                 (1e-6, "lr1e-6"), (2e-6, "lr2e-6"), (5e-6, "lr5e-6"), (1e-5, "lr1e-5"), (1.5e-4, "dense")]


def qwen3_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 causal LM (tied embeddings: no lm_head)."""
    h, i, d = shape.hidden, shape.intermediate, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (shape.heads * d, h)
        out[p + "self_attn.k_proj.weight"] = (shape.kv_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = (shape.kv_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, shape.heads * d)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    return out


class RLStream:
    """fp32 master weights + Adam state; ``step(lr)`` returns the new bf16 bits per tensor."""

    def __init__(self, shape: Shape, *, seed: int = 0, device: str = "cpu", token_fraction: float = 0.3):
        import torch

        self.torch = torch
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.token_fraction = token_fraction
        self.shapes = qwen3_tensors(shape)
        self.master: dict[str, "torch.Tensor"] = {}
        self.m: dict[str, "torch.Tensor"] = {}
        self.v: dict[str, "torch.Tensor"] = {}
        self.row_scale: dict[str, "torch.Tensor"] = {}
        self.t = 0
        for name, shp in self.shapes.items():
            if len(shp) == 1:
                w = 1.0 + 0.05 * torch.randn(shp, generator=self.gen, device=device)
            else:
                w = 0.02 * torch.randn(shp, generator=self.gen, device=device)
            self.master[name] = w
            self.m[name] = torch.zeros_like(w)
            self.v[name] = torch.zeros_like(w)
            rows = shp[0]
            self.row_scale[name] = torch.exp(0.5 * torch.randn(rows, generator=self.gen, device=device))

    def nbytes(self) -> int:
        return sum(2 * int(np.prod(s)) for s in self.shapes.values())

    def bf16(self) -> dict[str, np.ndarray]:
        """The current weights as bf16 bits (numpy uint16, host memory)."""
        torch = self.torch
        return {n: w.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16) for n, w in self.master.items()}

    def step(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> dict[str, np.ndarray]:
        torch = self.torch
        self.t += 1
        bc1 = 1 - beta1**self.t
        bc2 = 1 - beta2**self.t
        for name, w in self.master.items():
            g = torch.randn(w.shape, generator=self.gen, device=self.device)
            scale = self.row_scale[name]
            g.mul_(scale.view(-1, *([1] * (w.dim() - 1))))
            if name.endswith("embed_tokens.weight"):
                seen = torch.rand(w.shape[0], generator=self.gen, device=self.device) < self.token_fraction
                g.mul_(seen.view(-1, 1))
            m, v = self.m[name], self.v[name]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v / bc2).sqrt_().add_(eps)
            w.addcdiv_(m, denom, value=-lr / bc1)
        return self.bf16()
