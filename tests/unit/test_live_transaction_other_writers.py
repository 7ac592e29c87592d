"""Nothing changes under a transaction's check (issue 28, points 2, 3 and 5): another writer of the
weights between two phases of a live apply, a staging that overlapped a rolled-back transaction,
two transactions of our own, and a later pipeline stage's late report.

One rank's ``LiveApplyState`` over a real core pull (tiny Qwen3 checkpoint, v1 served, v2 staged;
the same harness as ``test_live_check_pause``), its phases through ``_run_phase``; the other
writer is what sglang's hooks report (``begin_reload``/``after_reload``, ``after_other_update``)
plus a write of the parameters themselves. The tokenizer's lock with fakes for sglang's parts.
The e2e tests on a real server: ``tests/e2e/test_live_other_writers.py``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx

from live_support import staged_state_serving_v1, tiny_chain_pulled_at_v1


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return tiny_chain_pulled_at_v1(tmp_path_factory.mktemp("live_other_writers"))


def _phase(state, served, phase, txn="t1"):
    request = SimpleNamespace(phase=phase, txn=txn, local_checkpoint_dir=served.local, target_version=2,
                              flush_cache=True, reason="another rank failed" if phase == tx.ROLLBACK else None)
    return state._run_phase(request, phase, 0.0)


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _another_writer(state, model, how="check_weights (CheckWeightsReqInput, reset_tensors)") -> dict:
    """sglang's reset_tensors as the glue sees it: the hook before, random values, the hook after."""
    state.after_other_update(how)
    gen = torch.Generator().manual_seed(28)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))
    state.after_other_update(how)
    return _snapshot(model)


def _a_reload_of_v1(state, model, served) -> dict:
    """sglang's update_weights_from_disk of another dir, as the glue sees it (the hooks around it)."""
    state.begin_reload(served.model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    state.after_reload(served.model_dir, True)
    return _snapshot(model)


def test_a_reload_between_the_vote_and_the_apply_writes_nothing_and_the_rank_is_not_restored_so_every_rank_reloads(served):
    state, model = staged_state_serving_v1(served)
    assert _phase(state, served, tx.VOTE).live
    reloaded = _a_reload_of_v1(state, model, served)
    applied = _phase(state, served, tx.APPLY)
    assert not applied.success and "written by a reload from" in applied.message and "nothing applied" in applied.message
    assert _same(_snapshot(model), reloaded)  # not one staged element written over the reload
    rolled = _phase(state, served, tx.ROLLBACK)
    assert rolled.rolled_back is False and "not restored" in rolled.message, rolled  # the coordinator reloads
    assert _same(_snapshot(model), reloaded)
    assert state.live is None


def test_reset_tensors_between_the_apply_and_the_commit_commits_nothing_and_the_check_fails_so_every_rank_reloads(served):
    state, model = staged_state_serving_v1(served)
    assert _phase(state, served, tx.VOTE).live
    assert _phase(state, served, tx.APPLY).success
    reset = _another_writer(state, model)
    committed = _phase(state, served, tx.COMMIT)
    assert not committed.success and committed.check is not None and committed.check.failed, committed
    assert "reset_tensors" in committed.message and "between the apply and the commit" in committed.message
    assert lr.check_mismatches([committed])  # what makes the coordinator reload every rank
    assert state.live is None and "reset_tensors" in state.weights.live_reason  # v2 never taken
    assert _same(_snapshot(model), reset)


def test_a_rollback_after_another_writer_writes_no_undo_log_over_its_bytes_and_says_not_restored(served):
    state, model = staged_state_serving_v1(served)
    assert _phase(state, served, tx.VOTE).live
    assert _phase(state, served, tx.APPLY).success
    reloaded = _a_reload_of_v1(state, model, served)
    rolled = _phase(state, served, tx.ROLLBACK)
    assert rolled.rolled_back is False and not rolled.success, rolled
    assert "the weights were written by a reload from" in rolled.message
    assert _same(_snapshot(model), reloaded)  # the undo log's old bytes were not mixed in


def test_a_staging_that_overlapped_a_rolled_back_transaction_is_void_and_the_voted_update_stays_valid(served):
    state, model = staged_state_serving_v1(served)
    before = _snapshot(model)
    staged = state.weights.staged
    assert _phase(state, served, tx.VOTE).live
    generation, _ = state.weights.generation, state.weights.live  # a staging that starts now, after the vote
    assert _phase(state, served, tx.APPLY).success  # ... and reads its undo log here, mid-transaction
    rolled = _phase(state, served, tx.ROLLBACK)
    assert rolled.rolled_back is True, rolled
    assert _same(_snapshot(model), before)
    assert state.weights.finish_staging(generation, staged, None) is None  # void: it read the applied bytes
    assert "changed while the update was being staged" in state.weights.stage_reason


def test_after_a_proven_rollback_the_same_staged_update_votes_live_again(served):
    state, model = staged_state_serving_v1(served)
    assert _phase(state, served, tx.VOTE).live
    assert _phase(state, served, tx.APPLY).success
    assert _phase(state, served, tx.ROLLBACK).rolled_back
    assert state.weights.staged is not None and state.weights.staged.generation == state.weights.generation
    assert _phase(state, served, tx.VOTE, txn="t2").live  # the retry goes live
    assert _phase(state, served, tx.APPLY, txn="t2").success
    assert _phase(state, served, tx.COMMIT, txn="t2").success
    assert state.live.version == 2


def test_every_round_of_one_transaction_has_its_own_stage_gather_key():
    from sglang_patch.live.state import LiveApplyState

    rank = SimpleNamespace(_rounds=("", 0))
    keys = [LiveApplyState._round_key(rank, SimpleNamespace(txn="t1"), phase)
            for phase in (tx.VOTE, tx.APPLY, tx.ROLLBACK, tx.RELOAD, tx.RELOAD)]
    assert len(set(keys)) == len(keys) and keys[3] != keys[4], keys
    assert LiveApplyState._round_key(rank, SimpleNamespace(txn="t2"), tx.VOTE) == "t2/1/vote"


def test_a_stages_late_report_of_a_first_reload_is_dropped_never_read_as_its_report_of_the_second():
    import torch.distributed as dist

    from sglang_patch.scheduler_context import StoreStageChannel

    now = [0.0]
    store = dist.HashStore()
    channel = StoreStageChannel(store)
    sent: list = []
    make = lambda pp: tx.StageGather(pp_rank=pp, pp_size=2, leader=True, channel=channel,  # noqa: E731
                                     send=lambda out, req: sent.append((out, req)), timeout_s=10.0,
                                     clock=lambda: now[0])
    stage0, stage1 = make(0), make(1)
    ok = lambda rank: [lr.LiveRankReport(host="h", rank=rank, success=True, mode=lr.RELOAD)]  # noqa: E731
    failed = [lr.LiveRankReport(host="h", rank="dp0/pp1/tp0", success=False, mode=lr.RELOAD, message="load failed")]

    def reports(items, missing):
        return [(r.rank, r.success) for r in items] + [(f"pp{k}", "missing") for k in missing]

    stage0.finish("reload-1", "t1/2/reload", ok("dp0/pp0/tp0"), reports)
    now[0] = 11.0  # stage 1 misses the first reload's deadline
    stage0.poll()
    assert sent == [([("dp0/pp0/tp0", True), ("pp1", "missing")], "reload-1")]
    stage1.finish("reload-1", "t1/2/reload", ok("dp0/pp1/tp0"), reports)  # its late report of the first
    stage0.finish("reload-2", "t1/3/reload", ok("dp0/pp0/tp0"), reports)  # the second reload
    now[0] = 12.0
    stage0.poll()
    assert len(sent) == 1  # the first reload's late success is not the second's
    assert stage0.late_dropped == 1 and not store.check([channel.PREFIX + "live/t1/2/reload/pp1"])  # cleaned up
    stage1.finish("reload-2", "t1/3/reload", failed, reports)
    now[0] = 12.5
    stage0.poll()
    assert sent[-1] == ([("dp0/pp0/tp0", True), ("dp0/pp1/tp0", False)], "reload-2")


# --- the tokenizer: one transaction at a time, and continue_generation waits for it ---------------


def _tokenizer_side():
    from live_support import cpu_standins_on_path

    with cpu_standins_on_path():
        from sglang_patch import io_types, tokenizer_side
    return io_types, tokenizer_side


class _PausedTokenizer:
    """sglang's TokenizerManager as far as the transaction uses it, generation paused (so sglang's
    writer lock is not taken); its communicator records each phase and holds transaction ``hold``'s
    apply until ``release`` is set."""

    def __init__(self, io_types):
        self.io_types = io_types
        self.is_pause = True
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = None  # never touched while paused
        self.server_args = SimpleNamespace(load_format=None)
        self.sent: list = []
        self.in_apply = asyncio.Event()
        self.release = asyncio.Event()
        self.hold: set = set()

    def auto_create_handle_loop(self):
        pass

    def _update_weight_version_if_provided(self, version):
        pass

    async def update_weights_from_pulled_communicator(self, request):
        self.sent.append((request.local_checkpoint_dir, request.phase))
        if request.phase == tx.VOTE:
            return [self.io_types.UpdateWeightsFromPulledReqOutput(
                success=True, message="", votes=[lr.LiveDecision(rank="dp0/tp0", live=True)])]
        if request.phase == tx.APPLY and request.local_checkpoint_dir in self.hold:
            self.in_apply.set()
            await self.release.wait()
        report = lr.LiveRankReport(host="h", rank="dp0/tp0", success=True, mode=lr.LIVE, weight_version=2)
        return [self.io_types.UpdateWeightsFromPulledReqOutput(success=True, message="", reports=[report])]


def test_two_paused_transactions_of_our_own_never_interleave_and_continue_generation_waits_for_them():
    io_types, tokenizer_side = _tokenizer_side()

    async def scenario():
        tm = _PausedTokenizer(io_types)
        tm.hold.add("a")
        request = lambda name: io_types.UpdateWeightsFromPulledReqInput(local_checkpoint_dir=name, target_version=2)  # noqa: E731
        a = asyncio.create_task(tokenizer_side.update_weights_from_pulled(tm, request("a")))
        await tm.in_apply.wait()  # a's apply is out, its commit not yet
        b = asyncio.create_task(tokenizer_side.update_weights_from_pulled(tm, request("b")))
        continued: list = []

        async def original_continue(tm_, obj):
            continued.append(list(tm.sent))
            return "continued"

        cont = asyncio.create_task(tokenizer_side._around_continue_generation(original_continue, tm, "req"))
        for _ in range(50):  # every other task runs as far as it can
            await asyncio.sleep(0)
        assert tm.sent == [("a", tx.VOTE), ("a", tx.APPLY)] and not b.done() and not cont.done()
        tm.release.set()
        out_a, out_b = await asyncio.gather(a, b)
        await cont
        return tm.sent, continued, out_a, out_b

    sent, continued, out_a, out_b = asyncio.run(scenario())
    assert out_a.success and out_b.success
    phases = [tx.VOTE, tx.APPLY, tx.COMMIT]
    assert sent == [("a", p) for p in phases] + [("b", p) for p in phases], sent  # one after the other
    # serving resumed only while no transaction was open: after a's commit, before b's vote or after b's commit
    [seen] = continued
    assert seen in (sent[:3], sent), seen
