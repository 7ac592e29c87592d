"""The engine-wide live-apply transaction (``sglang_patch.live.transaction``): the tokenizer's
decisions over every rank's items, and how a DP group's pipeline stages reach stage 0's reply.
No sglang: the stages share a real ``torch.distributed.HashStore``; the DP groups are a table of
what each rank answers per phase."""

from __future__ import annotations

import asyncio

import pytest

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx

RANKS = ["dp0/pp0/tp0", "dp0/pp1/tp0", "dp1/pp0/tp0", "dp1/pp1/tp0"]


class Engine:
    """Every rank's answer per phase; records the phases the tokenizer sent, in order."""

    def __init__(self, *, vote=None, apply_fails=(), not_restored=(), reload_fails=None):
        self.vote = vote or {}
        self.apply_fails, self.not_restored = set(apply_fails), set(not_restored)
        self.reload_fails = dict(reload_fails or {})  # rank -> how many of its reloads fail
        self.sent: list[tuple[str, object]] = []
        self.version = {r: 3 for r in RANKS}

    async def send(self, phase, reason):
        self.sent.append((phase, reason))
        out = tx.PhaseReplies()
        for rank in RANKS:
            report = dict(host="h/node0", rank=rank, mode=lr.LIVE)
            if phase == tx.VOTE:
                out.votes.append(self.vote.get(rank, lr.LiveDecision(rank=rank, live=True)))
                continue
            if phase == tx.APPLY:
                ok = rank not in self.apply_fails
                out.reports.append(lr.LiveRankReport(**report, success=ok, weight_version=4,
                                                     message="patched" if ok else f"injected fault on {rank}"))
            elif phase == tx.COMMIT:
                self.version[rank] = 4
                out.reports.append(lr.LiveRankReport(**report, success=True, weight_version=4))
            elif phase == tx.ROLLBACK:
                restored = rank not in self.not_restored
                out.reports.append(lr.LiveRankReport(**report, success=False, rolled_back=restored,
                                                     weight_version=3 if restored else None,
                                                     message="rolled back" if restored else "not restored: p1"))
            elif phase == tx.RELOAD:
                if self.reload_fails.get(rank, 0) > 0:  # its load failed: it keeps what it held
                    self.reload_fails[rank] -= 1
                    out.reports.append(lr.LiveRankReport(**{**report, "mode": lr.RELOAD}, success=False, reason=reason,
                                                         message=f"load failed on {rank}"))
                    continue
                self.version[rank] = 4
                out.reports.append(lr.LiveRankReport(**{**report, "mode": lr.RELOAD}, success=True, weight_version=4,
                                                     reason=reason))
        return out


def run(engine: Engine) -> dict:
    return asyncio.run(tx.run_transaction(engine.send, 4))


def test_every_rank_applied_then_every_rank_commits():
    engine = Engine()
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.APPLY, tx.COMMIT]
    assert fields["success"] and fields["mode"] == lr.LIVE and fields["weight_version"] == 4
    assert set(engine.version.values()) == {4}


@pytest.mark.parametrize("failing", ["dp0/pp1/tp0", "dp1/pp0/tp0"])  # a later stage; another DP group
def test_a_failure_on_any_stage_or_dp_group_rolls_every_rank_back_and_nothing_commits(failing):
    engine = Engine(apply_fails=[failing])
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.APPLY, tx.ROLLBACK]
    assert f"{failing}: injected fault on {failing}" in engine.sent[-1][1]
    assert fields["success"] is False and fields["rolled_back"] is True and fields["http_status"] == 500
    assert fields["weight_version"] == 3 and "every rank was restored" in fields["message"]
    assert set(engine.version.values()) == {3}


def test_a_rank_that_is_not_restored_makes_every_rank_reload_and_the_reply_says_why():
    engine = Engine(apply_fails=["dp1/pp1/tp0"], not_restored=["dp0/pp0/tp0"])
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.APPLY, tx.ROLLBACK, tx.RELOAD]
    assert fields["success"] and fields["mode"] == lr.RELOAD and fields["weight_version"] == 4
    assert "1 rank(s) could not be restored (dp0/pp0/tp0: not restored: p1)" in fields["reason"]
    assert set(engine.version.values()) == {4}


def test_one_rank_voting_reload_makes_every_rank_reload_before_any_write():
    engine = Engine(vote={"dp1/pp1/tp0": lr.LiveDecision(rank="dp1/pp1/tp0", live=False, reason="nothing staged")})
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [(tx.VOTE), tx.RELOAD]
    assert fields["mode"] == lr.RELOAD and fields["reason"].startswith("dp1/pp1/tp0: nothing staged")


def test_one_rank_refusing_refuses_the_call_and_nothing_is_written():
    refusal = lr.LiveDecision(rank="dp1/pp0/tp0", live=False, error_type="conflict", http_status=409, message="a pull runs")
    engine = Engine(vote={"dp1/pp0/tp0": refusal})
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE]
    assert fields["http_status"] == 409 and fields["error_type"] == "conflict" and not fields["success"]



RELOAD_VOTE = {"dp1/pp1/tp0": lr.LiveDecision(rank="dp1/pp1/tp0", live=False, reason="nothing staged")}


@pytest.mark.parametrize("failing", ["dp0/pp1/tp0", "dp1/pp0/tp0"])  # a later stage; another DP group
def test_a_reload_that_fails_on_one_stage_or_dp_group_is_repeated_on_every_rank_so_the_engine_holds_one_version(failing):
    engine = Engine(vote=RELOAD_VOTE, reload_fails={failing: 1})
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.RELOAD, tx.RELOAD]
    assert f"the reload failed on some rank ({failing}: load failed on {failing})" in engine.sent[-1][1]
    assert fields["success"] and fields["mode"] == lr.RELOAD and fields["weight_version"] == 4, fields
    assert set(engine.version.values()) == {4}


def test_a_reload_that_fails_twice_replies_failure_saying_the_ranks_may_differ():
    engine = Engine(vote=RELOAD_VOTE, reload_fails={"dp1/pp0/tp0": 2})
    fields = run(engine)
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.RELOAD, tx.RELOAD]
    assert not fields["success"] and fields["http_status"] == 500 and fields["weight_version"] is None, fields
    assert "failed twice" in fields["message"] and "two weight sets" in fields["message"] and "retry" in fields["message"]
    assert engine.version["dp1/pp0/tp0"] == 3 and engine.version["dp0/pp0/tp0"] == 4


def test_a_mismatch_after_a_commit_reloads_every_rank_and_a_failed_reload_there_is_repeated_too():
    engine = Engine(reload_fails={"dp0/pp0/tp0": 1})
    mismatch = lr.RankCheck(rank="dp1/pp1/tp0", verified_elements=10, mismatches=1, detail="p[3] differs")
    send = engine.send

    async def send_with_a_mismatch(phase, reason):
        out = await send(phase, reason)
        if phase == tx.COMMIT:
            out.reports[-1].check = mismatch
        return out

    fields = asyncio.run(tx.run_transaction(send_with_a_mismatch, 4))
    assert [p for p, _ in engine.sent] == [tx.VOTE, tx.APPLY, tx.COMMIT, tx.RELOAD, tx.RELOAD]
    assert fields["success"] and fields["mode"] == lr.RELOAD and set(engine.version.values()) == {4}

# --- pipeline stages: stage 0's entry rank replies once every stage has posted ------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _stages(clock, timeout_s=10.0):
    import torch.distributed as dist

    from sglang_patch.scheduler_context import StoreStageChannel

    channel = StoreStageChannel(dist.HashStore())
    sent: list = []
    make = lambda pp, leader: tx.StageGather(pp_rank=pp, pp_size=2, leader=leader, channel=channel,  # noqa: E731
                                             send=lambda out, req: sent.append((out, req)), timeout_s=timeout_s,
                                             clock=clock)
    return make(0, True), make(0, False), make(1, True), sent


def _reports(items, missing):
    return sorted(r.rank for r in items) + [tx.missing_stage_report(k, "apply", 10).rank for k in missing]


def test_stage_0_replies_only_after_the_later_stage_posted_its_items():
    clock = Clock()
    stage0, stage0_tp1, stage1, sent = _stages(clock)
    mine = [lr.LiveRankReport(host="h", rank="dp0/pp0/tp0", success=True, mode=lr.LIVE)]
    assert stage0.finish("req", "t1/apply", mine, _reports) is None  # deferred: stage 1 has not seen it yet
    assert stage0_tp1.finish("req", "t1/apply", mine, _reports) is None  # only the entry rank replies
    for _ in range(3):
        clock.now += 1
        stage0.poll()
    assert sent == []
    later = [lr.LiveRankReport(host="h", rank="dp0/pp1/tp0", success=False, mode=lr.LIVE, message="fault")]
    assert stage1.finish("req", "t1/apply", later, _reports) is None
    clock.now += 1
    stage0.poll()
    assert sent == [(["dp0/pp0/tp0", "dp0/pp1/tp0"], "req")]
    stage0.poll()
    assert len(sent) == 1  # once


def test_a_stage_that_never_posts_is_reported_missing_at_the_deadline():
    clock = Clock()
    stage0, _, _, sent = _stages(clock, timeout_s=10.0)
    stage0.finish("req", "t2/apply", [lr.LiveRankReport(host="h", rank="dp0/pp0/tp0", success=True, mode=lr.LIVE)],
                  _reports)
    clock.now = 9.0
    stage0.poll()
    assert sent == []
    clock.now = 10.5
    stage0.poll()
    assert sent == [(["dp0/pp0/tp0", "pp1"], "req")]


def test_without_pipeline_stages_the_reply_is_immediate():
    gather = tx.StageGather(pp_rank=0, pp_size=1, leader=True, channel=None, send=lambda o, r: None)
    assert gather.finish("req", "t3/vote", ["a", "b"], lambda items, missing: (items, missing)) == (["a", "b"], [])
