"""The coordinate map learnt from a model's own ``load_weights`` (``sglang_patch.coordinate_map``).

A torch-only model whose loaders do what sglang's do (TP narrowing, fused qkv and gate_up
shards, a padded vocab with a constant fill, tied embeddings, stacked MoE experts copied
through a transpose, and a loader that computes instead of copying) is mapped, then the map
is replayed against a real checkpoint and compared element by element with what a real load
produced. The real sglang models are mapped in the e2e tests (tests/e2e/test_live_apply_tp2.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_patch.coordinate_map import TensorSpec, build_coordinate_map, prove_map

TP_SIZE, TP_RANK = 2, 1
VOCAB, PADDED, HIDDEN, HEADS_Q, HEADS_KV, HEAD_DIM, INTER, EXPERTS = 10, 12, 8, 4, 2, 2, 6, 3


def _narrow_tp(w: torch.Tensor, dim: int) -> torch.Tensor:
    shard = w.shape[dim] // TP_SIZE
    return w.narrow(dim, TP_RANK * shard, shard)


class ToyModel(torch.nn.Module):
    """A TP rank of a model with sglang-style weight loaders."""

    def __init__(self, *, tied: bool = True, computing_loader: bool = False) -> None:
        super().__init__()
        q, kv = HEADS_Q * HEAD_DIM // TP_SIZE, HEADS_KV * HEAD_DIM // TP_SIZE
        self.q_size, self.kv_size = q, kv
        self.embed = torch.nn.Parameter(torch.zeros(PADDED // TP_SIZE, HIDDEN))
        self.qkv = torch.nn.Parameter(torch.zeros(q + 2 * kv, HIDDEN))
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * INTER // TP_SIZE, HIDDEN))
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.w13 = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN, 2 * INTER))  # stored transposed
        self.lm_head = self.embed if tied else torch.nn.Parameter(torch.zeros(PADDED // TP_SIZE, HIDDEN))
        self.computing_loader = computing_loader

    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed.weight":
                shard = VOCAB // TP_SIZE
                rows = w.narrow(0, TP_RANK * shard, shard)
                self.embed[:shard].data.copy_(rows)
                self.embed[shard:].data.fill_(0)  # the padded rows
            elif name == "lm_head.weight":
                if self.lm_head is not self.embed:
                    shard = VOCAB // TP_SIZE
                    self.lm_head[:shard].data.copy_(w.narrow(0, TP_RANK * shard, shard))
            elif name in ("q.weight", "k.weight", "v.weight"):
                offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[name[0]]
                size = self.q_size if name[0] == "q" else self.kv_size
                self.qkv.data.narrow(0, offset, size).copy_(_narrow_tp(w, 0))
            elif name in ("gate.weight", "up.weight"):
                shard = INTER // TP_SIZE
                self.gate_up.data.narrow(0, 0 if name[0] == "g" else shard, shard).copy_(_narrow_tp(w, 0))
            elif name == "norm.weight":
                if self.computing_loader:
                    self.norm.data.copy_(w * 2)  # a loader that computes: not a placement
                else:
                    self.norm.data.copy_(w)
            elif name.startswith("experts."):
                _, e, which, _ = name.split(".")
                block = self.w13.data[int(e)].t()  # (2*INTER, HIDDEN) view of the transposed storage
                block.narrow(0, 0 if which == "gate" else INTER, INTER).copy_(w.contiguous())


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
        "q.weight": (HEADS_Q * HEAD_DIM, HIDDEN), "k.weight": (HEADS_KV * HEAD_DIM, HIDDEN),
        "v.weight": (HEADS_KV * HEAD_DIM, HIDDEN), "gate.weight": (INTER, HIDDEN), "up.weight": (INTER, HIDDEN),
        "norm.weight": (HIDDEN,),
        **{f"experts.{e}.{w}.weight": (INTER, HIDDEN) for e in range(EXPERTS) for w in ("gate", "up")},
    }  # fmt: skip
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _specs(ckpt):
    return [TensorSpec(n, tuple(t.shape), "BF16") for n, t in ckpt.items()]


def _replay(cmap, model, ckpt):
    """Each parameter as the map says a load of ``ckpt`` leaves it (unmapped elements: NaN)."""
    out = {n: torch.full_like(p.data, float("nan")) for n, p in model.named_parameters()}
    for ps in cmap.placements.values():
        for p in ps:
            src = ckpt[p.tensor].reshape(-1)
            out[p.param].view(-1).as_strided(p.sizes, p.dst_strides, p.dst_offset).copy_(
                src.as_strided(p.sizes, p.src_strides, p.src_offset)
            )
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_the_map_places_every_element_where_a_real_load_puts_it(tied):
    ckpt = _checkpoint()
    model = ToyModel(tied=tied)
    cmap = build_coordinate_map(model, _specs(ckpt))
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters()), "building the map wrote a parameter"
    model.load_weights(iter(ckpt.items()))  # the real load
    replayed = _replay(cmap, model, ckpt)
    for name, p in model.named_parameters():
        got = replayed[name]
        mapped = ~torch.isnan(got)
        assert bool(mapped.any()), name
        assert torch.equal(got[mapped], p.data[mapped]), name
        if name in ("embed", "lm_head"):
            assert not bool(mapped[VOCAB // TP_SIZE :].any())  # the padded rows come from no element
        else:
            assert bool(mapped.all()), name
    # O(copies): one placement per loader copy, however many elements
    assert cmap.placement_count() == (2 if not tied else 1) + 3 + 2 + 1 + 2 * EXPERTS
    assert ("lm_head.weight" in cmap.unused_tensors) == tied
    assert not cmap.reload_only_params and not cmap.reload_only_tensors


def test_a_proof_against_the_loaded_checkpoint_passes_for_every_parameter():
    ckpt = _checkpoint()
    model = ToyModel()
    cmap = build_coordinate_map(model, _specs(ckpt))
    model.load_weights(iter(ckpt.items()))
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: ckpt[n])
    assert cmap.proven_params == {"embed", "qkv", "gate_up", "norm", "w13"}
    assert all(cmap.why_reload_only(n) is None for n in ckpt if n not in cmap.unused_tensors)


def test_a_parameter_transformed_after_loading_fails_the_proof_and_becomes_reload_only():
    ckpt = _checkpoint()
    model = ToyModel()
    cmap = build_coordinate_map(model, _specs(ckpt))
    model.load_weights(iter(ckpt.items()))
    with torch.no_grad():
        model.gate_up.data[0, 0] += 1  # a post-load transform of one element
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: ckpt[n])
    assert "gate_up" not in cmap.proven_params
    assert "differ from the checkpoint on 1 of" in cmap.reload_only_params["gate_up"]
    assert "parameter gate_up (loaded from up.weight) is reload-only" in cmap.why_reload_only("up.weight")
    assert cmap.why_reload_only("q.weight") is None


def test_a_loader_that_computes_makes_its_tensor_and_parameter_reload_only():
    ckpt = _checkpoint()
    model = ToyModel(computing_loader=True)
    cmap = build_coordinate_map(model, _specs(ckpt))
    assert "norm.weight" in cmap.reload_only_tensors
    assert "not a view of a checkpoint tensor" in cmap.reload_only_params["norm"]
    assert cmap.why_reload_only("norm.weight") is not None


def test_a_proof_voided_by_a_concurrent_weight_update_records_nothing():
    ckpt = _checkpoint()
    model = ToyModel()
    cmap = build_coordinate_map(model, _specs(ckpt))
    model.load_weights(iter(ckpt.items()))
    assert not prove_map(cmap, dict(model.named_parameters()), lambda n: ckpt[n], still_valid=lambda: False)
    assert not cmap.proven and not cmap.proven_params


@pytest.mark.parametrize("step", [1, 5, 1 << 20])
def test_a_proof_in_small_steps_reaches_the_same_verdicts_as_one_in_a_single_step(monkeypatch, step):
    from sglang_patch import coordinate_map
    from sglang_patch.coordinate_map import prove_map_steps

    monkeypatch.setattr(coordinate_map, "PROOF_STEP_ELEMENTS", step)
    ckpt = _checkpoint()
    model = ToyModel()
    cmap = build_coordinate_map(model, _specs(ckpt))
    model.load_weights(iter(ckpt.items()))
    with torch.no_grad():
        model.gate_up.data.view(-1)[-1] += 1  # the last element: the last step of its parameter
    steps = prove_map_steps(cmap, dict(model.named_parameters()), lambda n: ckpt[n])
    count = 0
    while True:
        try:
            next(steps)
            count += 1
        except StopIteration as done:
            assert done.value is True
            break
    assert cmap.proven_params == {"embed", "qkv", "norm", "w13"}
    assert "differ from the checkpoint on 1 of" in cmap.reload_only_params["gate_up"]
    biggest = max(p.numel() for p in model.parameters())
    assert count >= biggest // step  # the work really was cut into steps of at most `step` elements
