"""The measured mode choice keeps measuring both modes (issue 28, point 4).

``live.results.decide_mode`` picks live or reload from every rank's estimates; an estimate of
the mode that keeps losing is never refreshed by itself, so the losing mode is probed again
once the pauses since its last measurement pay for the probe (``PROBE_SHARE``), and a reload
is probed once when none was measured since start-up. The tests drive one rank's real
``PauseCosts`` through sequences of updates whose true pauses they set, and check the choices.
No sglang (but the last test builds the reply's IPC type, which imports it).
"""

from __future__ import annotations

import asyncio

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx

ELEMENTS = 1000


def vote(costs: lr.PauseCosts, rank: str = "dp0/tp0", live: bool = True, reason=None) -> lr.LiveDecision:
    """What ``LiveApplyState._vote`` sends for a staged update of ``ELEMENTS`` elements."""
    return lr.LiveDecision(rank=rank, live=live, reason=reason, elements=ELEMENTS,
                           live_estimate_s=costs.live_estimate(ELEMENTS), reload_estimate_s=costs.reload_estimate,
                           ages=costs.ages)


def run(costs: lr.PauseCosts, updates: int, live_s, reload_s, forced: dict = {}) -> list[dict]:
    """``updates`` updates; each takes ``live_s(k)`` live or ``reload_s`` reloaded, and is
    recorded as the engine records it. ``forced[k]``: update ``k`` cannot go live (a vote to
    reload). -> every update's ``mode_choice``."""
    choices = []
    for k in range(updates):
        c = lr.decide_mode([vote(costs, live=k not in forced, reason=forced.get(k))])
        if c["mode"] == lr.LIVE:
            pause = live_s(k)
            costs.record_live(ELEMENTS, pause / 2, pause)
        else:
            costs.record_reload(reload_s)
        choices.append(c)
    return choices


def modes(choices: list[dict]) -> str:
    return "".join("L" if c["mode"] == lr.LIVE else "R" for c in choices)


def test_one_slow_live_apply_followed_by_a_reload_does_not_make_every_later_update_reload():
    """The reproduction: live 0.03 s against a 0.30 s reload, one slow first live apply (0.5 s),
    then a reload the vote asked for; before, 40 of the next 40 updates reloaded."""
    costs = lr.PauseCosts()
    choices = run(costs, 42, lambda k: 0.5 if k == 0 else 0.03, 0.30, forced={1: "the map is not proven yet"})
    later = modes(choices[2:])
    assert later.count("L") >= 30, later
    assert "R" not in later[-20:], later  # back on the faster mode for good
    probe = next(c for c in choices[2:] if c["mode"] == lr.LIVE)
    assert probe["by"] == "probe" and probe["probe"] and probe["live_estimate_s"] > probe["reload_estimate_s"]
    assert probe["updates_since_live_measured"] >= lr.PROBE_MIN_UPDATES


def test_before_any_reload_is_measured_a_reload_is_probed_once_the_live_pauses_add_up_to_a_reloads_worth():
    """Live at 2 s against a 0.3 s reload: before, every update went live at any cost."""
    costs = lr.PauseCosts()
    choices = run(costs, 60, lambda k: 2.0, 0.30)
    seen = modes(choices)
    first = seen.index("R")
    assert first == int(lr.FIRST_RELOAD_PROBE_AFTER_S / 2.0), seen  # the live pauses reached a reload's worth
    probe = choices[first]
    assert probe["by"] == "probe" and probe["reload_estimate_s"] is None and "none measured since start-up" in probe["reason"]
    assert seen[first:] == "R" * (60 - first), seen  # and it was faster: every later update reloads
    # cheap live applies: no reload probe for a long time (it could gain little)
    costs = lr.PauseCosts()
    assert modes(run(costs, 500, lambda k: 0.05, 0.30)) == "L" * 500
    # and never before a full window of live applies, however long they took
    costs = lr.PauseCosts()
    seen = modes(run(costs, lr.FIRST_RELOAD_PROBE_AFTER + 1, lambda k: 100.0, 0.30))
    assert seen == "L" * lr.FIRST_RELOAD_PROBE_AFTER + "R"


def test_a_losing_mode_much_slower_than_the_winner_is_probed_rarely_so_probes_cost_a_bounded_share():
    """Live 0.1 s, reload 30 s: after the one first reload, a reload probe waits until the live
    pauses since reach its excess ten times over, twice that after a probe that lost."""
    costs = lr.PauseCosts()
    costs.record_reload(30.0)  # a reload the engine had to do (the map not proven yet)
    choices = run(costs, 4000, lambda k: 0.1, 30.0)
    spent = sum(30.0 if c["mode"] == lr.RELOAD else 0.1 for c in choices)
    first = modes(choices).index("R")
    assert modes(choices).count("R") == 1 and 0.1 * first >= 29.9 / lr.PROBE_SHARE
    assert spent <= 4000 * 0.1 * (1 + lr.PROBE_SHARE)
    assert costs.ages.reload_lost == 1  # the probe found a reload still slower: the next waits twice as long


def test_the_probes_of_a_mode_that_keeps_losing_come_ever_rarer():
    """Live 0.2 s, reload 0.3 s: a reload probe costs 0.1 s more than a live apply; the waits
    between probes double while each finds a reload still slower."""
    costs = lr.PauseCosts()
    costs.record_reload(0.3)
    choices = run(costs, 400, lambda k: 0.2, 0.30)
    at = [k for k, c in enumerate(choices) if c["mode"] == lr.RELOAD]
    assert all(choices[k]["by"] == "probe" for k in at)
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert len(at) >= 4 and all(g2 >= 1.8 * g1 for g1, g2 in zip(gaps, gaps[1:])), at
    spent = sum(0.3 if c["mode"] == lr.RELOAD else 0.2 for c in choices)
    assert spent <= 400 * 0.2 * (1 + lr.PROBE_SHARE)


def test_a_losing_mode_that_became_faster_is_found_again_and_one_that_did_not_stays_losing():
    # a reload that became slower (its page cache dropped): its next measurement is its estimate
    costs = lr.PauseCosts()
    costs.record_reload(0.05)
    choices = run(costs, 60, lambda k: 0.2, 0.30)
    assert modes(choices)[:3] == "LRL" and modes(choices)[3:].count("R") <= 3, modes(choices)
    # a live apply that was slow only while the machine was busy (a full window of 1 s pauses):
    # the first probe after it calmed down starts the window afresh, so live wins again at once
    costs = lr.PauseCosts()
    for _ in range(lr.PauseCosts.WINDOW):
        costs.record_live(ELEMENTS, 0.5, 1.0)  # the busy spell
    costs.record_reload(0.30)  # a reload the engine had to do: from here reloads win
    choices = run(costs, 60, lambda k: 0.03, 0.30)
    first_live = modes(choices).index("L")
    assert choices[first_live]["by"] == "probe" and "R" not in modes(choices)[first_live:], modes(choices)
    # and one that stays slow stays losing: its probes come ever rarer (their excess is paid for)
    costs = lr.PauseCosts()
    costs.record_reload(0.30)
    choices = run(costs, 200, lambda k: 1.0, 0.30)
    assert modes(choices)[1:].count("L") <= 6, modes(choices)


def test_probes_are_never_due_sooner_than_the_minimum_number_of_updates():
    ages = lr.MeasureAges(live_updates=lr.PROBE_MIN_UPDATES - 1, live_pause_s=1e6)
    slow_live = lr.LiveDecision(rank="tp0", live=True, elements=10, live_estimate_s=0.5, reload_estimate_s=0.3,
                                ages=ages)
    assert lr.decide_mode([slow_live])["mode"] == lr.RELOAD
    due = lr.MeasureAges(live_updates=lr.PROBE_MIN_UPDATES, live_pause_s=2.0)
    assert lr.decide_mode([lr.LiveDecision(rank="tp0", live=True, elements=10, live_estimate_s=0.5,
                                           reload_estimate_s=0.3, ages=due)])["by"] == "probe"


def test_the_engine_probes_only_when_every_rank_is_due_the_most_recent_measurement_counts():
    due = lr.MeasureAges(live_updates=10, live_pause_s=3.0)
    fresh = lr.MeasureAges(live_updates=0, live_pause_s=0.0)  # this rank measured live just now
    votes = [lr.LiveDecision(rank=r, live=True, elements=10, live_estimate_s=0.5, reload_estimate_s=0.3, ages=a)
             for r, a in (("dp0/tp0", due), ("dp1/tp0", fresh))]
    c = lr.decide_mode(votes)
    assert c["mode"] == lr.RELOAD and c["by"] == "estimate" and c["updates_since_live_measured"] == 0
    # a rank that sends no ages (an older scheduler): no probe, the estimates alone decide
    assert lr.decide_mode([votes[0], lr.LiveDecision(rank="dp1/tp0", live=True, elements=10, live_estimate_s=0.5,
                                                     reload_estimate_s=0.3)])["by"] == "estimate"


def test_a_vote_to_reload_and_nothing_to_write_are_not_probes():
    costs = lr.PauseCosts()
    for _ in range(20):
        costs.record_live(ELEMENTS, 0.01, 0.02)
    c = lr.decide_mode([vote(costs, live=False, reason="the map is not proven yet")])
    assert (c["mode"], c["by"], c["probe"], c["reason"]) == (lr.RELOAD, "vote", False, "dp0/tp0: the map is not proven yet")
    nothing = lr.LiveDecision(rank="dp0/tp0", live=True, elements=0, live_estimate_s=0.0, ages=costs.ages)
    assert lr.decide_mode([nothing])["by"] == "nothing to write"


def test_the_reply_says_what_the_mode_was_chosen_by_and_how_long_ago_each_mode_was_measured():
    from live_support import cpu_standins_on_path

    with cpu_standins_on_path():
        from sglang_patch import io_types

    costs = lr.PauseCosts()
    run(costs, lr.FIRST_RELOAD_PROBE_AFTER, lambda k: lr.FIRST_RELOAD_PROBE_AFTER_S / 4, 0.3)
    votes = [vote(costs, "dp0/tp0"), vote(costs, "dp1/tp0")]
    sent = []

    async def send(phase, reason):
        sent.append((phase, reason))
        out = tx.PhaseReplies()
        if phase == tx.VOTE:
            out.votes.extend(votes)
        else:
            out.reports.extend(lr.LiveRankReport(host="h", rank=v.rank, success=True, mode=lr.RELOAD, weight_version=5,
                                                 reason=reason) for v in votes)
        return out

    fields = asyncio.run(tx.run_transaction(send, 5))
    assert [p for p, _ in sent] == [tx.VOTE, tx.RELOAD] and fields["success"] and fields["mode"] == lr.RELOAD
    choice = fields["mode_choice"]
    assert choice["by"] == "probe" and choice["probe"] and choice["mode"] == lr.RELOAD
    assert choice["updates_since_reload_measured"] == lr.FIRST_RELOAD_PROBE_AFTER
    assert choice["pause_s_since_reload_measured"] == lr.FIRST_RELOAD_PROBE_AFTER * lr.FIRST_RELOAD_PROBE_AFTER_S / 4
    assert choice["live_estimate_s"] == fields["live_estimate_s"] and choice["reload_estimate_s"] is None
    assert "probing a reload's pause" in fields["reason"]
    body = io_types.live_http_body(io_types.UpdateWeightsFromPulledReqOutput(**fields))
    assert body["mode_choice"] == choice
