"""The coordinate map learnt from a model's own ``load_weights`` (``sglang_patch.live.mapping.coordinate_map``).

A torch-only model whose loaders do what sglang's do (TP narrowing, fused qkv and gate_up
shards, a padded vocab with a constant fill, tied embeddings, stacked MoE experts copied
through a transpose, and a loader that computes instead of copying) is mapped, then the map
is replayed against a real checkpoint and compared element by element with what a real load
produced. The map is learnt on a storage-free copy of the module tree; what it cannot follow
(a value read through ``.item()``, a buffer, an attribute, a parameter a loader derives state
from) is reload-only with its reason; the proof's host memory is bounded by its step. sglang's
own classes are mapped in process in tests/e2e/test_live_map_models.py and on real servers in
tests/e2e/test_live_apply_tp2.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map

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
    from sglang_patch.live.mapping import coordinate_map
    from sglang_patch.live.mapping.coordinate_map import prove_map_steps

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


# --- what the map does not see is never dropped: reload-only, with the reason ------------------


class _Loaded(torch.nn.Module):
    """A model whose ``load_weights`` is the given function of (model, params, name, tensor)."""

    def __init__(self, load, **params) -> None:
        super().__init__()
        for name, t in params.items():
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self.register_buffer("scale_buf", torch.zeros(2))
        self._load = load

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            self._load(self, params, name, w)
        if hasattr(self, "post_load"):
            self.post_load()


def _plain(model, params, name, w):
    params[name.removesuffix(".weight")].data.copy_(w)


def _map_load_and_prove(model, ckpt):
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in ckpt.items()])
    model.load_weights(iter(ckpt.items()))
    assert prove_map(cmap, {n: p.data for n, p in model.named_parameters()}, lambda n: ckpt[n])
    return cmap


def test_a_one_element_tensor_read_through_item_is_reload_only_not_unused():
    def load(model, params, name, w):
        p = params[name.removesuffix(".weight")]
        if p.numel() == 1 and w.numel() == 1:
            p.data.fill_(w.item())  # what sglang's default_weight_loader does for a scalar
        else:
            p.data.copy_(w)

    model = _Loaded(load, gate=torch.zeros(1), w=torch.zeros(3, 2))
    ckpt = {"gate.weight": torch.tensor([0.25]), "w.weight": torch.randn(3, 2)}
    cmap = _map_load_and_prove(model, ckpt)
    assert "gate.weight" not in cmap.unused_tensors
    assert ".item()" in cmap.reload_only_tensors["gate.weight"]
    assert cmap.why_reload_only("gate.weight") is not None and cmap.why_reload_only("w.weight") is None


def test_a_parameter_a_loader_derives_state_from_after_its_copies_is_reload_only():
    class Mla(_Loaded):
        def post_load(self):  # as DeepSeek's post_load_weights derives w_kc/w_vc from kv_b_proj
            w_kc, w_vc = self.kv_b.data.split(2, dim=0)
            self.w_kc = w_kc.transpose(0, 1).contiguous()
            self.w_vc = w_vc.contiguous()

    model = Mla(_plain, kv_b=torch.zeros(4, 3), o=torch.zeros(3, 3))
    ckpt = {"kv_b.weight": torch.randn(4, 3), "o.weight": torch.randn(3, 3)}
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in ckpt.items()])
    assert "w_kc" not in model.__dict__ and "w_vc" not in model.__dict__  # derived on the copy only
    model.load_weights(iter(ckpt.items()))
    assert prove_map(cmap, {n: p.data for n, p in model.named_parameters()}, lambda n: ckpt[n])
    assert "state derived from it" in cmap.reload_only_params["kv_b"]
    assert "is reload-only" in cmap.why_reload_only("kv_b.weight")
    assert cmap.why_reload_only("o.weight") is None


def test_a_parameter_copied_from_another_parameter_makes_both_reload_only():
    class Mirror(_Loaded):
        def post_load(self):
            self.b.data.copy_(self.a.data)  # b follows a: patching a alone would leave b stale

    model = Mirror(_plain, a=torch.zeros(2, 2), b=torch.zeros(2, 2))
    cmap = build_coordinate_map(model, [TensorSpec("a.weight", (2, 2), "F32")])
    assert "not a view of a checkpoint tensor" in cmap.reload_only_params["b"]
    assert "state derived from it" in cmap.reload_only_params["a"]
    assert cmap.why_reload_only("a.weight") is not None


def test_a_tensor_loaded_into_a_buffer_or_kept_as_an_attribute_is_reload_only():
    def load(model, params, name, w):
        if name == "scale":
            model.scale_buf.copy_(w)
        elif name == "kept":
            model.kept = w  # no op at all: only the walk over the copy's attributes sees it
        else:
            params["w"].data.copy_(w)

    model = _Loaded(load, w=torch.zeros(2))
    specs = [TensorSpec("scale", (2,), "F32"), TensorSpec("kept", (2,), "F32"), TensorSpec("w", (2,), "F32")]
    cmap = build_coordinate_map(model, specs)
    assert "not a parameter" in cmap.reload_only_tensors["scale"]
    assert "kept by the loader as model.kept" in cmap.reload_only_tensors["kept"]
    assert cmap.unused_tensors == set() and "kept" not in model.__dict__


def test_a_parameter_whose_storage_the_loader_swaps_is_reload_only():
    def load(model, params, name, w):
        if name == "adopted":
            params["a"].data = w  # the checkpoint tensor itself becomes the parameter: no copy
        else:
            params["b"].data.copy_(w)
            params["b"].data = torch.empty_like(params["b"])  # a swap after the copy: not what it serves

    model = _Loaded(load, a=torch.zeros(2, 2), b=torch.zeros(2, 2))
    cmap = build_coordinate_map(model, [TensorSpec("adopted", (2, 2), "F32"), TensorSpec("copied", (2, 2), "F32")])
    assert "became the storage of parameter a" in cmap.reload_only_tensors["adopted"]
    assert "param.data swap" in cmap.reload_only_params["b"]
    assert cmap.why_reload_only("copied") is not None and "adopted" not in cmap.unused_tensors


def test_a_tensor_the_loader_reads_but_places_nowhere_is_reload_only_and_one_it_skips_is_unused():
    def load(model, params, name, w):
        if name == "peeked":
            w.narrow(0, 0, 1)  # looked at, then dropped: a reload might depend on it
        elif name == "w":
            params["w"].data.copy_(w)

    model = _Loaded(load, w=torch.zeros(2))
    cmap = build_coordinate_map(model, [TensorSpec(n, (2,), "F32") for n in ("peeked", "skipped", "w")])
    assert "copied into no parameter" in cmap.reload_only_tensors["peeked"]
    assert cmap.unused_tensors == {"skipped"}


def test_learning_the_map_runs_the_loader_on_a_copy_never_on_the_serving_model():
    class Swapper(_Loaded):
        def post_load(self):
            self.w.data = self.w.data * 1  # a param.data swap, and new attributes
            self.derived = torch.ones(1)

    model = Swapper(_plain, w=torch.arange(4.0))
    before = (model.w.data_ptr(), id(model.w), sorted(model.__dict__), model.w.clone())
    cmap = build_coordinate_map(model, [TensorSpec("w.weight", (4,), "F32")])
    assert (model.w.data_ptr(), id(model.w), sorted(model.__dict__)) == before[:3]
    assert torch.equal(model.w, before[3]) and not cmap.live_writes
    assert "state derived from it" in cmap.reload_only_params["w"]  # the swap read it


def test_a_write_that_reaches_the_serving_model_anyway_is_not_executed_and_makes_it_reload_only():
    serving = torch.zeros(2)

    def load(model, params, name, w):
        serving.copy_(w)  # a loader holding a reference the copy cannot re-bind (a closure)

    model = _Loaded(load, w=serving)
    cmap = build_coordinate_map(model, [TensorSpec("w", (2,), "F32")])
    assert torch.equal(serving, torch.zeros(2))
    assert cmap.live_writes == {"w"} and "serving model" in cmap.reload_only_params["w"]


def test_a_loader_that_branches_on_a_parameters_value_leaves_no_map():
    from sglang_patch.live.mapping.coordinate_map import MapNotLearnable

    def load(model, params, name, w):
        if bool(params["w"].data.sum() == 0):  # needs data a storage-free copy does not have
            params["w"].data.copy_(w)

    with pytest.raises(MapNotLearnable, match="reads the value"):
        build_coordinate_map(_Loaded(load, w=torch.zeros(2)), [TensorSpec("w", (2,), "F32")])


def test_two_checkpoint_elements_on_one_parameter_element_fail_the_proof():
    def load(model, params, name, w):
        params["w"].data[:2].copy_(w)  # both tensors land on the same two elements

    model = _Loaded(load, w=torch.zeros(3))
    ckpt = {"x": torch.ones(2), "y": torch.ones(2)}
    cmap = build_coordinate_map(model, [TensorSpec(n, (2,), "F32") for n in ckpt])
    model.w.data[:2] = 1
    assert prove_map(cmap, {"w": model.w.data}, lambda n: ckpt[n])
    assert "written by more than one checkpoint element" in cmap.reload_only_params["w"]


# --- the proof's host memory and how often it runs -----------------------------------------------


def test_the_proof_never_holds_more_than_one_step_of_host_memory(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from sglang_patch.live.mapping import coordinate_map

    step = 64
    monkeypatch.setattr(coordinate_map, "PROOF_STEP_ELEMENTS", step)
    ckpt = _checkpoint()
    model = ToyModel(tied=False)
    cmap = build_coordinate_map(model, _specs(ckpt))
    model.load_weights(iter(ckpt.items()))
    largest = max(p.numel() for p in model.parameters())
    assert largest > 2 * step

    class Sizes(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (list, tuple)) else (out,)):
                if isinstance(t, torch.Tensor) and not any(t.untyped_storage()._cdata == a.untyped_storage()._cdata
                                                           for a in args if isinstance(a, torch.Tensor)):
                    Sizes.biggest = max(Sizes.biggest, t.numel())
            return out

    params = dict(model.named_parameters())
    with Sizes():
        assert prove_map(cmap, params, lambda n: ckpt[n])
    assert cmap.proven_params == {"embed", "lm_head", "qkv", "gate_up", "norm", "w13"}
    # the interleaved expert halves (gate/up through a transpose) need a one-byte count over their span
    assert Sizes.biggest <= max(step, model.w13[0].numel()) < largest


def test_a_proof_after_reloads_runs_once_per_checkpoint_identity_and_one_at_a_time():
    from sglang_patch.live.mapping.coordinate_map import ProofAttempts

    attempts = ProofAttempts()
    assert attempts.begin(("/local", (1, "src", "run", "seed"))) is None
    assert "already running" in attempts.begin(("/local", (2, "src", "run", "seed")))
    attempts.end()
    assert "already tried" in attempts.begin(("/local", (1, "src", "run", "seed")))  # voided, reloaded again
    assert attempts.begin(("/local", (2, "src", "run", "seed"))) is None  # a new version: once
    attempts.end()
    assert attempts.tried == 2


# --- the allow-list and the engine-wide reasons ----------------------------------------------------


def _allowed_class(qualified: str):
    module, name = qualified.rsplit(".", 1)
    return type(name, (torch.nn.Module,), {"__module__": module})()


@pytest.mark.parametrize("args, words", [
    ({"speculative_algorithm": "EAGLE"}, "speculative decoding"),
    ({"enable_eplb": True}, "EPLB"),
    ({"ep_num_redundant_experts": 2}, "EPLB"),
    ({"weight_cache_mode": "daemon"}, "weight cache"),
])
def test_an_engine_with_a_draft_model_moving_experts_or_shared_weights_reloads_with_the_reason(args, words):
    from types import SimpleNamespace

    from sglang_patch.live.mapping.scope import why_engine_reload_only

    model = _allowed_class("sglang.srt.models.qwen3.Qwen3ForCausalLM")
    why = why_engine_reload_only(model, SimpleNamespace(**args), SimpleNamespace(draft_worker=None))
    assert why is not None and words in why


def test_a_class_off_the_allow_list_reloads_naming_the_class_and_a_subclass_is_not_enough():
    from sglang_patch.live.mapping.scope import ALLOW_LIST, why_engine_reload_only, why_not_allowed

    assert "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM" in ALLOW_LIST
    why = why_engine_reload_only(ToyModel())
    assert why.startswith("model class ToyModel (") and "not on live apply's allow-list" in why
    sub = type("Qwen3ForCausalLM", (type(_allowed_class("sglang.srt.models.qwen3.Qwen3ForCausalLM")),),
               {"__module__": "somewhere.else"})()
    assert why_not_allowed(sub) is not None


# --- the engine says why it has no map ----------------------------------------------------------


def _engine_state(tmp_path, model, scope=None):
    from types import SimpleNamespace

    from sglang_patch.pull.coordinator import SingleRankGroup
    from sglang_patch.live.state import LiveApplyState
    from testbed.tiny_qwen3 import make_tiny_qwen3

    seed = make_tiny_qwen3(tmp_path / "seed")
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    return LiveApplyState(scheduler=scheduler, group=SingleRankGroup(), host="host/node0", rank="dp0/tp0",
                          seed_dir=str(seed), allowed_roots=(), max_changed_fraction=0.1, scope=scope)


def test_an_engine_off_the_allow_list_builds_no_map_and_every_update_reloads_saying_why(tmp_path):
    from types import SimpleNamespace

    from sglang_patch.live.mapping.scope import EngineScope

    state = _engine_state(tmp_path, ToyModel(), EngineScope(SimpleNamespace(), SimpleNamespace(draft_worker=None)))
    state.proof.build_and_prove()
    assert state.cmap is None
    assert state.proof.status().startswith("live apply is off for this engine: model class ToyModel")


def test_a_map_that_cannot_be_learnt_on_a_storage_free_copy_says_so(tmp_path):
    def load(model, params, name, w):
        if bool(params["w"].data.sum() == 0):
            params["w"].data.copy_(w)

    state = _engine_state(tmp_path, _Loaded(load, w=torch.zeros(2)))
    state.proof.build_and_prove()
    assert state.cmap is None
    assert "could not be learnt on a storage-free copy of the model" in state.proof.status()


def test_a_checkpoint_tensor_changed_in_place_before_its_copy_is_reload_only():
    def load(model, params, name, w):
        w.mul_(2)  # in place: the copy that follows no longer carries the checkpoint's values
        params["w"].data.copy_(w)

    cmap = build_coordinate_map(_Loaded(load, w=torch.zeros(2)), [TensorSpec("w", (2,), "F32")])
    assert "changed in place" in cmap.reload_only_tensors["w"]
    assert cmap.why_reload_only("w") is not None


def _fusing_loader(dim: int):
    """sglang's MLA loaders with a q_lora_rank: q_a and kv_a are cached, then ``torch.cat`` into one
    parameter by a plain copy (``default_weight_loader``)."""
    def load(model, params, name, w):
        if name in ("q_a.weight", "kv_a.weight"):
            model.cached[name] = w
            if len(model.cached) == 2:
                params["fused"].data.copy_(torch.cat([model.cached["q_a.weight"], model.cached["kv_a.weight"]], dim=dim))
                model.cached.clear()
        else:
            _plain(model, params, name, w)
    return load


def test_a_cat_of_checkpoint_tensors_along_rows_maps_one_placement_per_part_exactly_where_a_load_puts_them():
    model = _Loaded(_fusing_loader(0), fused=torch.zeros(7, 3), o=torch.zeros(3, 3))
    model.cached = {}
    ckpt = {"q_a.weight": torch.randn(4, 3), "kv_a.weight": torch.randn(3, 3), "o.weight": torch.randn(3, 3)}
    cmap = _map_load_and_prove(model, ckpt)
    assert not cmap.reload_only_params and not cmap.reload_only_tensors
    assert {n: len(ps) for n, ps in cmap.placements.items()} == {"q_a.weight": 1, "kv_a.weight": 1, "o.weight": 1}
    assert "fused" in cmap.proven_params
    replayed = _replay(cmap, model, ckpt)
    assert torch.equal(replayed["fused"], model.fused.data)  # every element, none left NaN


def test_a_cat_the_map_cannot_cut_into_parts_is_reload_only_with_the_reason():
    model = _Loaded(_fusing_loader(1), fused=torch.zeros(3, 7), o=torch.zeros(3, 3))
    model.cached = {}
    ckpt = {"q_a.weight": torch.randn(3, 4), "kv_a.weight": torch.randn(3, 3), "o.weight": torch.randn(3, 3)}
    cmap = _map_load_and_prove(model, ckpt)
    assert "aten.cat" in cmap.reload_only_tensors["q_a.weight"] and "aten.cat" in cmap.reload_only_tensors["kv_a.weight"]
    assert "is reload-only" in cmap.why_reload_only("q_a.weight") and cmap.why_reload_only("o.weight") is None


class _Rule:
    def __init__(self, why=None) -> None:
        self.why = why

    def why_not_current(self):
        return self.why


class _DerivingModel(_Loaded):
    def post_load_weights(self):  # as sglang's DeepseekV2WeightLoaderMixin derives w_kc/w_vc
        self.w_kc = self.kv_b.data[:2].transpose(0, 1).contiguous()


def _derived_map(prove_derived):
    model = _DerivingModel(lambda m, ps, n, w: (_plain(m, ps, n, w), n == "o.weight" and m.post_load_weights()),
                           kv_b=torch.zeros(4, 3), o=torch.zeros(3, 3))
    ckpt = {"kv_b.weight": torch.randn(4, 3), "o.weight": torch.randn(3, 3)}
    cmap = build_coordinate_map(model, _specs_f32(ckpt), derivable=({"kv_b": "attn"}, {}))
    model.load_weights(iter(ckpt.items()))
    assert prove_map(cmap, {n: p.data for n, p in model.named_parameters()}, lambda n: ckpt[n], prove_derived=prove_derived)
    return cmap


def _specs_f32(ckpt):
    return [TensorSpec(n, tuple(t.shape), "F32") for n, t in ckpt.items()]


def _rules(result):
    def prove(derived_params, names):
        yield
        return {n: result for n in names}
    return prove


def test_a_read_inside_post_load_weights_that_a_rule_re_derives_and_proves_keeps_the_parameter_live():
    cmap = _derived_map(_rules(_Rule()))
    assert cmap.derived_params == {"kv_b": "attn"} and "kv_b" in cmap.derivations and "kv_b" in cmap.proven_params
    assert cmap.why_reload_only("kv_b.weight") is None
    cmap.derivations["kv_b"].why = "w_kc was replaced since the proof"  # checked again at every staging
    assert "w_kc was replaced" in cmap.why_reload_only("kv_b.weight")


@pytest.mark.parametrize("prove_derived, words", [
    (None, "no rule re-derives"), (_rules("the rule is not proven: they differ"), "they differ"),
])
def test_a_derived_parameter_whose_rule_is_missing_or_unproven_is_reload_only_with_the_reason(prove_derived, words):
    cmap = _derived_map(prove_derived)
    assert words in cmap.reload_only_params["kv_b"] and "kv_b" not in cmap.proven_params
    assert words in cmap.why_reload_only("kv_b.weight") and not cmap.derivations
