"""MLA's ``w_kc``/``w_vc`` re-derived live from ``kv_b_proj`` (``sglang_patch.live.mapping.derived``) by one
rank's writes (``live.apply.RankWrites``): after the scatter, again after a rollback (no undo log of
their own: the split of the restored source is exact), never when the rule went stale, and a
derivation that fails restores the rank. A torch-only attention module laid out as sglang's
``DeepseekV2AttentionMLA`` after ``post_load_weights``; sglang's own classes run in
tests/e2e/test_live_map_models.py.
"""

from __future__ import annotations

import torch

from sglang_patch.live import results as lr
from sglang_patch.live.apply import RankTxn, RankWrites
from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map
from sglang_patch.live.mapping.derived import MlaDerivation, prove_steps
from sglang_patch.live.loop_slices import drain
from sglang_patch.live.scatter.patch import StagedUpdate, stage_update
from sglang_patch.live.version import LiveWeights

from live_support import NewTensors, TensorReader, changed_positions

HEADS, NOPE, V, RANK = 2, 3, 2, 4


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(RANK, HEADS * (NOPE + V), bias=False)
        self.qk_nope_head_dim, self.v_head_dim = NOPE, V
        self.w_kc = self.w_vc = None

    def load_weights(self, weights):
        for _, w in weights:
            self.kv_b_proj.weight.data.copy_(w)
        # sglang's post_load_weights for an unquantized kv_b_proj (bind_or_assign: copy_ once they exist)
        w_kc, w_vc = self.kv_b_proj.weight.unflatten(0, (-1, NOPE + V)).split([NOPE, V], dim=1)
        kc, vc = w_kc.transpose(1, 2).contiguous().transpose(1, 2), w_vc.contiguous().transpose(1, 2)
        if self.w_kc is None:
            self.w_kc, self.w_vc = kc, vc
        else:
            self.w_kc.copy_(kc)
            self.w_vc.copy_(vc)


def _setup():
    model = Attn().requires_grad_(False)
    v0 = {"kv_b_proj.weight": torch.randn(HEADS * (NOPE + V), RANK)}
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in v0.items()])
    model.load_weights(iter(v0.items()))
    cmap.reload_only_params.clear()  # not sglang's mixin here: the rule is bound by hand below
    assert prove_map(cmap, {n: p.data for n, p in model.named_parameters()}, lambda n: v0[n])
    rules = drain(prove_steps(model, {"kv_b_proj.weight": ""}, ["kv_b_proj.weight"]))
    assert isinstance(rules["kv_b_proj.weight"], MlaDerivation), rules
    cmap.derived_params, cmap.derivations = {"kv_b_proj.weight": ""}, rules
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["kv_b_proj.weight"][[0, 3, 7]] += 1
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1),
                          max_elements=1000, staged=StagedUpdate(0, 1, None, "/x", 0))
    writes = RankWrites(host="h", rank="dp0/tp0", scheduler=None, pause_costs=lr.PauseCosts(),
                        weights=LiveWeights(rank="dp0/tp0", seed_dir=None, pull_is_running=lambda: False),
                        check=lambda *a: None, derivations=lambda: cmap.derivations)
    return model, cmap, v1, staged, writes


def _derived(model):
    return {k: getattr(model, k).clone() for k in ("w_kc", "w_vc")}


def _same(a, b):
    return all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def test_an_apply_re_derives_w_kc_w_vc_in_place_as_a_reload_does_and_a_rollback_restores_them_without_an_undo_log():
    model, _, v1, staged, writes = _setup()
    before, ptrs = _derived(model), (model.w_kc.data_ptr(), model.w_vc.data_ptr())
    txn = RankTxn("t", 0.0)
    report = writes.apply(staged, txn)
    assert report.success and "re-derived 1 layer(s)' w_kc/w_vc" in report.message
    reloaded = Attn().requires_grad_(False)
    reloaded.load_weights(iter(v1.items()))
    assert _same(_derived(model), _derived(reloaded)) and not _same(_derived(model), before)
    assert all(p.param == "kv_b_proj.weight" for p in staged.patches)  # the undo log holds kv_b_proj only
    rolled = writes.rollback(txn, "another rank failed")
    assert rolled.rolled_back and _same(_derived(model), before)
    assert (model.w_kc.data_ptr(), model.w_vc.data_ptr()) == ptrs


def test_a_rule_whose_w_kc_was_replaced_since_the_proof_fails_the_apply_before_any_write():
    model, cmap, _, staged, writes = _setup()
    kv_b = model.kv_b_proj.weight.clone()
    model.w_kc = model.w_kc.clone()  # e.g. a memory release and resume re-created it
    assert "replaced since the proof" in cmap.why_reload_only("kv_b_proj.weight")  # staging refuses it
    report = writes.apply(staged, RankTxn("t", 0.0))
    assert not report.success and "replaced since the proof" in report.message
    assert torch.equal(model.kv_b_proj.weight, kv_b)


def test_a_derivation_that_fails_after_the_scatter_restores_the_rank_and_derives_from_the_restored_source(monkeypatch):
    model, cmap, _, staged, writes = _setup()
    before, kv_b = _derived(model), model.kv_b_proj.weight.clone()
    rule = cmap.derivations["kv_b_proj.weight"]
    calls = []

    def derive_once_failing():
        calls.append(1)
        if len(calls) == 1:
            rule.w_kc.copy_(rule.src_kc)  # half of it landed, then the device failed
            raise RuntimeError("injected: the derivation failed")
        MlaDerivation.derive(rule)

    monkeypatch.setattr(rule, "derive", derive_once_failing)
    txn = RankTxn("t", 0.0)
    report = writes.apply(staged, txn)
    assert not report.success and "injected" in report.message and txn.restore_failure is None
    assert torch.equal(model.kv_b_proj.weight, kv_b) and _same(_derived(model), before)


def test_the_proof_of_the_rule_fails_with_the_reason_when_w_kc_is_not_the_split_of_kv_b_proj():
    model, *_ = _setup()
    model.w_vc[0, 1, 0] += 1
    rules = drain(prove_steps(model, {"kv_b_proj.weight": ""}, ["kv_b_proj.weight"]))
    assert "differ from the split of its kv_b_proj on 1 of" in rules["kv_b_proj.weight"]
    model.w_vc = model.w_vc.to(torch.float64)
    rules = drain(prove_steps(model, {"kv_b_proj.weight": ""}, ["kv_b_proj.weight"]))
    assert "w_vc is" in rules["kv_b_proj.weight"] and "torch.float64" in rules["kv_b_proj.weight"]


class _Counted:
    def __init__(self, path: str, bad: int = 0) -> None:
        self.path, self.bad, self.calls = path, bad, 0

    def mismatches(self):
        self.calls += 1
        return self.bad, 10


def test_the_per_update_check_compares_a_bounded_fresh_draw_of_the_re_derived_layers_and_counts_a_stale_one():
    from sglang_patch.live.check import DERIVED_LAYERS_PER_CHECK, check_derived
    from sglang_patch.live.scatter.patch import ParamPatch

    rules = {f"l{k}.kv_b_proj.weight": _Counted(f"l{k}") for k in range(10)}
    patches = [ParamPatch(n, None, None, None, None) for n in list(rules)[:8]]  # 8 layers re-derived
    drawn = []
    for seed in range(4):
        tally = check_derived(rules, patches, [seed])
        assert tally.compared == 10 * DERIVED_LAYERS_PER_CHECK and tally.mismatches == 0
        drawn.append({n for n, r in rules.items() if r.calls})
        for r in rules.values():
            r.calls = 0
    assert all(len(d) == DERIVED_LAYERS_PER_CHECK and d <= {p.param for p in patches} for d in drawn)
    assert len(set(map(frozenset, drawn))) > 1  # drawn afresh
    rules["l0.kv_b_proj.weight"].bad = 3
    tally = check_derived(rules, patches[:1], [0])
    assert tally.mismatches == 3 and "l0.w_kc/w_vc" in tally.first


def test_the_pause_re_derives_checks_and_restores_w_kc_w_vc_without_making_a_tensor():
    from sglang_patch.live.check import check_derived

    model, cmap, _, staged, writes = _setup()
    txn = RankTxn("t", 0.0)
    with NewTensors() as pause:
        assert writes.apply(staged, txn).success and txn.derived == 1
        tally = check_derived(cmap.derivations, staged.patches, [0])  # into the proof's scratch
        assert writes.rollback(txn, "another rank failed").rolled_back
    assert pause.created == [], pause.created  # copy_ from views made at the proof, into the old storage
    assert tally.compared == HEADS * (NOPE + V) * RANK and tally.mismatches == 0
    model.w_vc[1, 2, 1] += 1  # a stale derived element: counted through the same scratch
    tally = check_derived(cmap.derivations, staged.patches, [0])
    assert tally.mismatches == 1 and "w_kc/w_vc: 1 element(s) differ" in tally.first
