"""Each update proven from the live weights (``sglang_patch.live.check``): after a commit or a
reload every rank compares a fresh sample of its mapped elements with the checkpoint and every
element it wrote with the staged value; a mismatch makes every rank reload and the reply says so.

Real coordinate maps learnt from small torch modules' ``load_weights``; the last tests run a
real core pull (tiny Qwen3 checkpoint, published chain) through ``LiveApplyState``. No sglang.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx
from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map
from sglang_patch.live.check import check_sample, check_update, sample_seed
from sglang_patch.live.scatter.patch import StagedUpdate, scatter_with_undo, stage_update

from live_support import TensorReader, changed_positions, serve_from_local


class Shards(torch.nn.Module):
    """Rank 1 of a column split (rows 4..7 of ``w``) fused with a transposed ``b``; ``scale`` is
    loaded through ``.item()`` (reload-only, as sglang's default loader does for one element);
    ``extra`` is loaded by nothing (unmapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(4 + 2, 3))
        self.scale = torch.nn.Parameter(torch.zeros(()))
        self.extra = torch.nn.Parameter(torch.ones(5))

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.fused.data[:4].copy_(t.narrow(0, 4, 4))
            elif name == "b":
                self.fused.data[4:].copy_(t.t())
            else:
                self.scale.data.fill_(t.item())


def _setup():
    g = torch.Generator().manual_seed(0)
    v0 = {"w": torch.randn(8, 3, generator=g), "b": torch.randn(3, 2, generator=g), "s": torch.tensor(0.5)}
    model = Shards()
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in v0.items()])
    model.load_weights(iter(v0.items()))
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: v0[n])
    return model, cmap, v0


def _live_apply(model, cmap, v0):
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["w"][5, 2] += 1
    v1["w"][7, 0] -= 2
    v1["b"][2, 1] += 1
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1), max_elements=100,
                          staged=StagedUpdate(0, 1, None, "/x", 0))
    scatter_with_undo(staged)
    return v1, staged


def test_a_correct_live_apply_verifies_every_written_element_and_a_sample_with_no_mismatch():
    model, cmap, v0 = _setup()
    v1, staged = _live_apply(model, cmap, v0)
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v1.__getitem__, version=1, counter=1,
                         patches=staged.patches)
    assert check.mismatches == 0 and check.scattered_elements == 3
    assert check.sampled_elements == 4 * 3 + 3 * 2  # every mapped element of these small tensors
    assert check.verified_elements == check.sampled_elements + check.scattered_elements


def test_a_wrong_element_among_the_written_positions_is_found():
    model, cmap, v0 = _setup()
    v1, staged = _live_apply(model, cmap, v0)
    with torch.no_grad():
        model.fused.view(-1)[int(staged.patches[0].index[0])] += 0.25  # the write that did not land
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v1.__getitem__, version=1, counter=1,
                         patches=staged.patches)
    assert check.mismatches >= 1 and "fused" in check.detail


def test_a_wrong_element_the_update_did_not_write_is_found_by_the_sample():
    model, cmap, v0 = _setup()
    v1, staged = _live_apply(model, cmap, v0)
    with torch.no_grad():
        model.fused[0, 0] = torch.nextafter(model.fused[0, 0], torch.tensor(float("inf")))  # one ulp: bit for bit
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v1.__getitem__, version=1, counter=1,
                         patches=staged.patches)
    assert check.mismatches == 1 and "fused (from w)" in check.detail and "element 0" in check.detail


def test_a_checkpoint_of_another_version_does_not_verify():
    model, cmap, v0 = _setup()
    _live_apply(model, cmap, v0)
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v0.__getitem__, version=1, counter=1)
    assert check.mismatches == 3


def test_reload_only_and_unmapped_parameters_are_outside_the_sample_and_not_counted_as_verified():
    model, cmap, v0 = _setup()
    assert "s" in cmap.reload_only_tensors  # read through .item(): scale has no placement
    with torch.no_grad():
        model.scale.fill_(7.0)  # neither is checkable: a difference there is not seen, nor counted
        model.extra.fill_(7.0)
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v0.__getitem__, version=0, counter=1)
    assert (check.checked_params, check.not_checkable_params) == (1, 2)
    assert check.mismatches == 0 and check.verified_elements == model.fused.numel()
    cmap.reload_only_params["fused"] = "repacked after loading"  # as a failed proof records it
    check = check_update("dp0/tp1", cmap, dict(model.named_parameters()), v0.__getitem__, version=0, counter=2)
    assert (check.checked_params, check.not_checkable_params, check.verified_elements) == (0, 3, 0)


def test_the_sample_is_bounded_per_tensor_and_drawn_afresh_for_each_update():
    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, 64))

        def load_weights(self, weights):
            for _, t in weights:
                self.weight.data.copy_(t)

    model = Square()
    w = torch.randn(64, 64)
    cmap = build_coordinate_map(model, [TensorSpec("weight", (64, 64), "F32")])
    model.load_weights([("weight", w)])
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: w)
    params = dict(model.named_parameters())
    first = check_sample(cmap, params, lambda n: w, sample_seed(3, 1), per_tensor=100)
    assert first.mismatches == 0 and first.compared == 100
    with torch.no_grad():
        model.weight.view(-1)[::2] += 1  # half the elements wrong
    seen = [check_sample(cmap, params, lambda n: w, sample_seed(3, c), per_tensor=100).mismatches for c in (1, 2)]
    assert all(m > 20 for m in seen)
    assert check_sample(cmap, params, lambda n: w, sample_seed(3, 1), per_tensor=100).mismatches == seen[0]
    # a different counter draws other positions (same count by chance only if every position repeated)
    a = np.random.default_rng(sample_seed(3, 1)).integers(0, 4096, 100)
    b = np.random.default_rng(sample_seed(3, 2)).integers(0, 4096, 100)
    assert not np.array_equal(a, b)


# --- the transaction: a mismatch after the commit reloads every rank -------------------------------


RANKS = ["dp0/tp0", "dp0/tp1", "dp1/tp0"]


class Engine:
    """Every rank's answer per phase (``mismatch_on`` finds a wrong element after its commit)."""

    def __init__(self, mismatch_on=(), check_raises_on=(), reload_check_raises_on=(), votes_reload=False):
        self.mismatch_on = set(mismatch_on)
        self.check_raises_on = set(check_raises_on)
        self.reload_check_raises_on = set(reload_check_raises_on)  # the reload's own check raised there
        self.votes_reload = votes_reload
        self.sent: list = []

    async def send(self, phase, reason):
        self.sent.append(phase)
        out = tx.PhaseReplies()
        for rank in RANKS:
            base = dict(host=f"h/node{rank[2]}", rank=rank, weight_version=4)
            if phase == tx.VOTE:
                out.votes.append(lr.LiveDecision(rank=rank, live=not self.votes_reload, elements=3,
                                                 reason="a full version" if self.votes_reload else None))
            elif phase == tx.APPLY:
                out.reports.append(lr.LiveRankReport(**base, success=True, mode=lr.LIVE))
            elif phase == tx.COMMIT:
                bad = int(rank in self.mismatch_on)
                check = lr.RankCheck(rank=rank, verified_elements=100 - bad, mismatches=bad, checked_params=2,
                                     not_checkable_params=1, detail="p (scattered): element 3 holds 1.0, expected 2.0" if bad else "")
                if rank in self.check_raises_on:  # what UpdateChecker.after_update replies when the check raised
                    check = lr.RankCheck(rank=rank, failed=True, detail="the check failed: RuntimeError: boom")
                out.reports.append(lr.LiveRankReport(**base, success=True, mode=lr.LIVE, check=check))
            elif phase == tx.RELOAD:
                check = lr.RankCheck(rank=rank, verified_elements=50, checked_params=2, not_checkable_params=1)
                if rank in self.reload_check_raises_on:
                    check = lr.RankCheck(rank=rank, failed=True, detail="the check failed: KeyError: 'lm_head.weight'")
                out.reports.append(lr.LiveRankReport(**base, success=True, mode=lr.RELOAD, reason=reason, check=check))
        return out


def test_a_clean_check_after_the_commit_replies_the_verified_elements_of_every_rank():
    engine = Engine()
    fields = asyncio.run(tx.run_transaction(engine.send, 4))
    assert engine.sent == [tx.VOTE, tx.APPLY, tx.COMMIT]
    assert fields["success"] and fields["mode"] == lr.LIVE and not fields["reloaded_after_check"]
    assert fields["verified_elements"] == 300 and fields["mismatches"] == 0 and fields["not_checkable_params"] == 3
    assert sorted(c.rank for h in fields["hosts"] for c in h.checks) == RANKS


def test_a_mismatch_after_the_commit_on_one_rank_makes_every_rank_reload_and_the_reply_says_so():
    engine = Engine(mismatch_on={"dp1/tp0"})
    fields = asyncio.run(tx.run_transaction(engine.send, 4))
    assert engine.sent == [tx.VOTE, tx.APPLY, tx.COMMIT, tx.RELOAD]
    assert fields["success"] and fields["mode"] == lr.RELOAD and fields["reloaded_after_check"]
    assert fields["mismatches"] == 1 and [c.rank for c in fields["failed_checks"]] == ["dp1/tp0"]
    assert "check after the live apply did not hold" in fields["reason"] and "dp1/tp0" in fields["reason"]
    assert fields["verified_elements"] == 150  # the reload's own check, on every rank


def test_a_check_that_raised_on_one_rank_verifies_nothing_and_makes_every_rank_reload():
    engine = Engine(check_raises_on={"dp0/tp1"})
    fields = asyncio.run(tx.run_transaction(engine.send, 4))
    assert engine.sent == [tx.VOTE, tx.APPLY, tx.COMMIT, tx.RELOAD]
    assert fields["success"] and fields["mode"] == lr.RELOAD and fields["reloaded_after_check"]
    assert [c.rank for c in fields["failed_checks"]] == ["dp0/tp1"] and fields["failed_checks"][0].failed
    assert "dp0/tp1: the check failed: RuntimeError: boom" in fields["reason"]


def test_a_reload_whose_check_could_not_run_is_a_failure_with_that_check_in_failed_checks():
    """Issue 25.1: a full version lacking a tensor reloaded, its check raised KeyError, and the
    reply was 200 ``success: true`` with ``failed_checks: []``."""
    engine = Engine(votes_reload=True, reload_check_raises_on={"dp1/tp0"})
    fields = asyncio.run(tx.run_transaction(engine.send, 4))
    assert engine.sent == [tx.VOTE, tx.RELOAD]  # a reload of the same bytes cannot help
    assert not fields["success"] and fields["http_status"] == 500 and fields["error_type"] == lr.UPDATE_CHECK_FAILED
    assert [c.rank for c in fields["failed_checks"]] == ["dp1/tp0"] and fields["failed_checks"][0].failed
    assert not fields["reloaded_after_check"]  # no live apply's check made it reload
    assert "KeyError: 'lm_head.weight'" in fields["message"] and "no published version" in fields["message"]
    assert fields["weight_version"] == 4 and fields["mode"] == lr.RELOAD  # what the ranks loaded, said as it is


def test_a_live_apply_whose_check_failed_and_whose_reloads_check_failed_too_is_a_failure_naming_both():
    engine = Engine(check_raises_on={"dp0/tp1"}, reload_check_raises_on={"dp0/tp0"})
    fields = asyncio.run(tx.run_transaction(engine.send, 4))
    assert engine.sent == [tx.VOTE, tx.APPLY, tx.COMMIT, tx.RELOAD]
    assert not fields["success"] and fields["error_type"] == lr.UPDATE_CHECK_FAILED and fields["reloaded_after_check"]
    assert [c.rank for c in fields["failed_checks"]] == ["dp0/tp1", "dp0/tp0"]


def test_a_failed_check_survives_the_merge_of_dp_groups_replies_counted_once():
    bad = lr.RankCheck(rank="dp1/tp0", mismatches=2, verified_elements=5, detail="p: element 1 holds 0.0, expected 1.0")
    ok = lr.RankCheck(rank="dp0/tp0", verified_elements=7)
    group = lambda rank, check: lr.summarize(4, lr.merge_hosts([lr.LiveRankReport(  # noqa: E731
        host=f"h/{rank}", rank=rank, success=True, mode=lr.RELOAD, weight_version=4, check=check)]))
    merged = lr.merge_replies(4, [group("dp0/tp0", ok), group("dp1/tp0", bad)])
    assert not merged["success"] and merged["error_type"] == lr.UPDATE_CHECK_FAILED
    assert merged["failed_checks"] == [bad] and merged["mismatches"] == 2 and not merged["reloaded_after_check"]


def test_a_check_that_raises_any_exception_is_a_failed_check_and_never_a_success(pulled):
    """Whatever the check raises (not only a missing tensor's KeyError), it says ``failed`` and
    the reply of the update it checked is a failure."""
    from sglang_patch.live.check import UpdateChecker, check_after_update

    class Odd(Exception):
        pass

    state, _ = _state(pulled)

    def params():
        raise Odd("an exception nobody expects")

    state.params = params
    for check in (check_after_update(state, pulled.local, 1), UpdateChecker().after_update(state, pulled.local, 1)):
        assert check.failed and lr.check_failed(check) and "Odd: an exception nobody expects" in check.detail
        report = lr.LiveRankReport(host="h", rank=state.rank, success=True, mode=lr.RELOAD, weight_version=1, check=check)
        fields = lr.summarize(1, lr.merge_hosts([report]))
        assert not fields["success"] and fields["failed_checks"] == [check]


def test_a_reload_of_a_local_checkpoint_that_lacks_a_tensor_replies_a_failure_and_forgets_the_live_version(
        pulled, tmp_path, monkeypatch):
    """A full version whose tensor set is smaller than the model's, reloaded: sglang's loader
    keeps the old values of the missing tensor, so the engine holds bytes of no published
    version. The reload's check cannot read that tensor: the rank's report carries the failed
    check, the reply is a failure, and the live version is forgotten (the next update reloads)."""
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    from live_support import cpu_standins_on_path

    with cpu_standins_on_path():  # the reload phase builds sglang's own request
        import sglang.srt.managers.io_struct  # noqa: F401
    local = str(tmp_path / "local")
    shutil.copytree(pulled.local, local)
    state, model = serve_from_local(local, pulled.model_dir, "reload")
    state.proof.prove(CheckpointReader(local), state.live, checkpoint_dir=local)
    assert state.cmap.proven
    shard = sorted(f for f in os.listdir(local) if f.endswith(".safetensors"))[-1]
    with safe_open(os.path.join(local, shard), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    missing = sorted(kept)[0]
    del kept[missing]
    os.unlink(os.path.join(local, shard))  # a new inode: as a writer of another version would leave it
    save_file(kept, os.path.join(local, shard), metadata=meta)

    class WeightUpdater:
        def update_weights_from_disk(self, req):  # sglang's loader: whatever tensors the dir has
            model.load_weights(_present(req.model_path))
            return SimpleNamespace(success=True, message="Succeeded to update model weights.")

    state.scheduler.weight_updater = WeightUpdater()
    state.scheduler.server_args = SimpleNamespace(load_format=None)
    monkeypatch.setenv("WEIGHTSYNC_UPDATE_CHECK_SAMPLE", "4096,1000")  # every tensor: the missing one is drawn
    report = state.writes.reload(SimpleNamespace(local_checkpoint_dir=local, target_version=1, flush_cache=True),
                                 "a full version", 0.0)
    assert report.check is not None and report.check.failed and missing in report.check.detail, report.check
    fields = lr.summarize(1, lr.merge_hosts([report]))
    assert not fields["success"] and fields["error_type"] == lr.UPDATE_CHECK_FAILED and fields["failed_checks"]
    assert state.weights.live is None and "did not hold" in state.weights.live_reason


def _present(local):
    """Every tensor the safetensors files of ``local`` hold (not the index's list)."""
    import os

    from safetensors import safe_open

    for name in sorted(os.listdir(local)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(local, name), "pt") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)


# --- a real pull, through LiveApplyState -------------------------------------------------------


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    from testbed.feed import VersionFeed
    from testbed.tiny_qwen3 import make_tiny_qwen3
    from weightsync import pull

    root = tmp_path_factory.mktemp("live_check")
    model_dir = make_tiny_qwen3(root / "model")
    feed = VersionFeed(model_dir, root / "shared")
    feed.publish(1)
    local = str(root / "local")
    pull(local, model_dir, feed.source_dir, 1)
    return SimpleNamespace(local=local, model_dir=model_dir)


def _state(pulled):
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    state, model = serve_from_local(pulled.local, pulled.model_dir, "reload")
    state.proof.prove(CheckpointReader(pulled.local), state.live, checkpoint_dir=pulled.local)
    return state, model


def test_after_an_update_a_rank_verifies_its_weights_against_the_local_checkpoint_of_that_version(pulled):
    from sglang_patch.live.check import SAMPLE_PER_TENSOR, check_after_update

    state, model = _state(pulled)
    check = check_after_update(state, pulled.local, 1)
    tensors = len(state.cmap.placements)
    assert check.mismatches == 0 and check.detail == ""
    assert 0 < check.verified_elements <= tensors * SAMPLE_PER_TENSOR
    assert check.checked_params == len(list(model.parameters())) and check.not_checkable_params == 0
    smallest = min(model.named_parameters(), key=lambda kv: kv[1].numel())[0]  # fully sampled
    with torch.no_grad():
        dict(model.named_parameters())[smallest].view(-1)[0] += 1
    found = check_after_update(state, pulled.local, 1)
    assert found.mismatches == 1 and smallest in found.detail


def test_a_check_for_a_version_the_local_checkpoint_does_not_hold_draws_no_sample_and_says_why(pulled):
    from sglang_patch.live.check import check_after_update

    state, _ = _state(pulled)
    check = check_after_update(state, pulled.local, 2)
    assert check.mismatches == 0 and check.sampled_elements == 0 and "does not name this version" in check.detail


_METRICS_SCRIPT = r"""
import json
from sglang_patch import metrics

ok = {"rank": "dp0/tp0", "verified_elements": 10, "sampled_elements": 8, "scattered_elements": 2,
      "scattered_check_s": 0.002, "sample_check_s": 0.0007, "sampled_before_pause": 6, "sample_before_pause_s": 0.004}
bad = {"rank": "dp0/tp1", "verified_elements": 7, "mismatches": 3, "sampled_elements": 10, "sample_check_s": 0.03}
unchecked = {"rank": "dp0/tp1", "detail": "the local checkpoint changed during the check"}
metrics.observe_update_from_pulled({"success": True, "mode": "live", "pause_s": 0.1, "weight_version": 2,
                                    "hosts": [{"host": "h/node0", "checks": [ok, unchecked]}]})
metrics.observe_update_from_pulled({"success": True, "mode": "reload", "pause_s": 0.3, "weight_version": 3,
                                    "reloaded_after_check": True, "failed_checks": [bad],
                                    "hosts": [{"host": "h/node0", "checks": [ok, ok]}]})
# a reload whose own check could not run: the reply repeats it in failed_checks (counted once)
failed = {"rank": "dp0/tp0", "failed": True, "detail": "the check failed: KeyError: 'w'"}
metrics.observe_update_from_pulled({"success": False, "mode": "reload", "weight_version": 3,
                                    "mode_choice": {"mode": "reload", "by": "probe"}, "failed_checks": [failed],
                                    "hosts": [{"host": "h/node0", "checks": [failed]}]})

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry)
print(json.dumps({f"{s.name}{sorted(s.labels.items())}": s.value
                  for fam in registry.collect() for s in fam.samples if s.name.startswith("weightsync_update_")}))
"""


def test_metrics_count_each_ranks_check_its_mismatches_and_the_reloads_they_caused(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", _METRICS_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["weightsync_update_checks_total[('outcome', 'ok')]"] == 3
    assert got["weightsync_update_checks_total[('outcome', 'mismatch')]"] == 1
    assert got["weightsync_update_checks_total[('outcome', 'unchecked')]"] == 1
    assert got["weightsync_update_checks_total[('outcome', 'failed')]"] == 1
    assert got["weightsync_update_mode_choices_total[('by', 'probe'), ('mode', 'reload')]"] == 1
    assert got["weightsync_update_check_mismatches_total[]"] == 3
    assert got["weightsync_update_check_reloads_total[]"] == 1
    # what the checks cost inside the pause, per part: each check that compared such elements
    assert got["weightsync_update_check_seconds_count[('part', 'written')]"] == 3
    assert got["weightsync_update_check_seconds_count[('part', 'sample')]"] == 4
    assert got["weightsync_update_check_seconds_sum[('part', 'written')]"] == pytest.approx(0.006)
    assert got["weightsync_update_check_seconds_bucket[('le', '0.001'), ('part', 'sample')]"] == 3
    # and, outside the pause, the sample's compare at a live apply's staging
    assert got["weightsync_update_check_seconds_count[('part', 'sample_at_staging')]"] == 3
    assert got["weightsync_update_check_seconds_sum[('part', 'sample_at_staging')]"] == pytest.approx(0.012)


def test_the_sample_reaches_at_most_the_tensor_budget_per_update_and_other_tensors_the_next_time():
    class Many(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(10, 8))

        def load_weights(self, weights):
            for name, t in weights:
                self.weight.data[int(name[1:])].copy_(t)

    rows = {f"r{i}": torch.randn(8) for i in range(10)}
    model = Many()
    cmap = build_coordinate_map(model, [TensorSpec(n, (8,), "F32") for n in rows])
    model.load_weights(rows.items())
    assert prove_map(cmap, dict(model.named_parameters()), rows.__getitem__)
    params = dict(model.named_parameters())
    first = check_sample(cmap, params, rows.__getitem__, sample_seed(1, 1), max_tensors=3)
    assert first.compared == 3 * 8
    seen = set()
    for counter in range(1, 30):
        with torch.no_grad():
            model.weight.copy_(torch.stack([rows[f"r{i}"] for i in range(10)]))
            model.weight[counter % 10] += 1  # one wrong row: found only when its tensor is drawn
        if check_sample(cmap, params, rows.__getitem__, sample_seed(1, counter), max_tensors=3).mismatches:
            seen.add(counter % 10)
    assert len(seen) >= 5  # drawn afresh: over updates, different tensors are reached
