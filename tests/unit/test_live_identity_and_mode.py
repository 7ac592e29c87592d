"""Live apply's decisions that need no engine: the live version's identity (which bytes the
weights hold, issue 19 point 1), whether a reload names the version it loaded (point 2), and
the mode chosen by measurement (point 13)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_patch.live import results as lr
from sglang_patch.live.identity import (LiveVersion, ReloadWitness, from_held, is_serving, key_of_held,
                                        reload_outcome, seed_version, why_not_base)

SEED, OTHER_SEED = "f" * 32, "e" * 32
SRC = "/src"


def held(version, *, source=SRC, run="run-a", seed=SEED):
    return SimpleNamespace(version=version, source_dir=source, run=run, seed=seed, how="marker")


# --- identity ----------------------------------------------------------------------------------


def test_a_chain_grown_from_a_replaced_seed_dir_is_never_patched_onto_the_start_up_weights():
    live = seed_version(SEED)
    assert why_not_base(live, held(2)) is None
    why = why_not_base(live, held(2, seed=OTHER_SEED))
    assert why is not None and "another seed" in why


def test_a_new_run_under_the_same_source_path_is_never_patched_onto_the_old_runs_version():
    live = from_held(held(2), "reload")
    assert why_not_base(live, held(3)) is None
    why = why_not_base(live, held(3, run="run-b"))
    assert why is not None and "run run-a" in why and "run-b" in why
    assert why_not_base(live, held(3, run=None)) is not None
    assert "another source dir" in why_not_base(live, held(3, source="/other"))


def test_a_new_run_whose_version_equals_the_live_one_is_not_already_served():
    live = from_held(held(2), "reload")
    assert is_serving(live, held(2))
    assert not is_serving(live, held(2, run="run-b"))
    assert not is_serving(live, held(2, seed=OTHER_SEED))
    assert not is_serving(live, held(2, source="/other"))
    assert not is_serving(None, held(2))


def test_version_zero_is_the_seed_whatever_source_or_run_seeded_the_local_dir():
    live = seed_version(SEED)
    assert is_serving(live, held(0, run="any", source="/any"))
    assert not is_serving(live, held(0, seed=OTHER_SEED))
    assert from_held(held(0), "reload").key() == live.key()


def test_a_live_version_without_a_seed_fingerprint_matches_nothing():
    for live in (seed_version(None), seed_version("none"), LiveVersion(2, SRC, "how", "run-a", None)):
        assert why_not_base(live, held(3)) is not None
        assert not is_serving(live, held(live.version, seed=live.seed))


# --- a reload names the version it loaded only when nothing moved --------------------------------


def witness(h, *, path="/local", pull_running=False):
    return ReloadWitness(path, key_of_held(h), pull_running)


def test_a_reload_with_the_same_identity_before_and_after_and_no_pull_names_that_version():
    assert reload_outcome(witness(held(3)), "/local", True, key_of_held(held(3)), False) is None


def test_a_reload_overlapping_a_pull_leaves_the_live_version_unknown():
    why = reload_outcome(witness(held(3), pull_running=True), "/local", True, key_of_held(held(3)), False)
    assert why is not None and "/pull_weights was running" in why
    why = reload_outcome(witness(held(3)), "/local", True, key_of_held(held(3)), True)
    assert why is not None and "/pull_weights was running" in why


def test_a_reload_whose_dir_changed_meanwhile_leaves_the_live_version_unknown():
    for before, after in ((held(3), held(4)), (held(3), held(3, run="run-b")), (None, held(4)),
                          (held(3), held(3, seed=OTHER_SEED))):
        why = reload_outcome(witness(before), "/local", True, key_of_held(after), False)
        assert why is not None and "changed during the reload" in why, (before, after)


def test_a_failed_or_unwitnessed_reload_or_one_naming_nothing_leaves_it_unknown():
    assert "failed" in reload_outcome(witness(held(3)), "/local", False, key_of_held(held(3)), False)
    assert "names no verified version" in reload_outcome(witness(held(3)), "/local", True, None, False)
    assert "not read before" in reload_outcome(None, "/local", True, key_of_held(held(3)), False)
    assert "not read before" in reload_outcome(witness(held(3), path="/x"), "/local", True, key_of_held(held(3)), False)


# --- the mode is chosen by measurement -----------------------------------------------------------


def vote(rank, elements, live_s, reload_s, live=True):
    return lr.LiveDecision(rank=rank, live=live, elements=elements, live_estimate_s=live_s, reload_estimate_s=reload_s,
                           reason=None if live else "cannot")


def test_live_is_chosen_only_where_its_estimate_is_below_the_reload_estimate():
    assert lr.choose_mode([vote("tp0", 100, 0.01, 0.2), vote("tp1", 100, 0.02, 0.2)]) == (lr.LIVE, None)
    mode, reason = lr.choose_mode([vote("tp0", 100, 0.01, 0.2), vote("tp1", 5000, 0.3, 0.2)])
    assert mode == lr.RELOAD and "a reload is estimated faster" in reason and "0.3000s" in reason and "0.2000s" in reason
    fields = lr.estimate_fields([vote("tp0", 100, 0.01, 0.2), vote("tp1", 5000, 0.3, 0.25)])
    assert (fields["live_estimate_s"], fields["reload_estimate_s"]) == (0.3, 0.25)
    assert fields["mode_choice"]["mode"] == lr.RELOAD and fields["mode_choice"]["by"] == "estimate"


def test_without_a_measurement_the_operators_cap_alone_decides_and_the_reply_says_none():
    votes = [vote("tp0", 100, None, 0.2), vote("tp1", 100, 0.01, 0.2)]
    assert lr.choose_mode(votes) == (lr.LIVE, None)
    fields = lr.estimate_fields(votes)
    assert (fields["live_estimate_s"], fields["reload_estimate_s"]) == (None, 0.2)
    assert fields["mode_choice"]["by"] == "unmeasured"
    assert lr.choose_mode([vote("tp0", 100, 0.5, None)]) == (lr.LIVE, None)


def test_a_rank_that_cannot_go_live_still_wins_over_the_estimates():
    mode, reason = lr.choose_mode([vote("tp0", 100, 0.001, 10.0), vote("tp1", 0, None, 10.0, live=False)])
    assert mode == lr.RELOAD and reason == "tp1: cannot"
    assert lr.estimate_fields([vote("tp0", 100, 0.001, 10.0), vote("tp1", 0, None, 10.0, live=False)])["live_estimate_s"] is None


def test_nothing_to_write_is_live_whatever_the_estimates():
    assert lr.choose_mode([vote("tp0", 0, 0.5, 0.1)]) == (lr.LIVE, None)


def test_pause_costs_estimate_whole_pauses_from_the_last_reload_and_recent_live_applies():
    costs = lr.PauseCosts()
    assert costs.live_estimate(1000) is None and costs.reload_estimate is None
    costs.record_reload(0.3)
    costs.record_reload(0.2)
    assert costs.reload_estimate == 0.2  # the last one; no round trip measured yet
    costs.record_round_trip(0.004)
    costs.record_round_trip(0.006)
    assert costs.reload_estimate == pytest.approx(0.205)
    costs.record_live(1000, 0.001, 0.011)
    costs.record_live(3000, 0.006, 0.016)
    costs.record_live(0, 0.0, 0.010)  # nothing written: a fixed cost, no rate
    assert costs.per_element_s == pytest.approx(1.5e-6)  # the median of 1e-6 and 2e-6
    # applies of different sizes: a line through their pauses (pairwise slopes 1e-6, 2e-6, 2.5e-6)
    assert costs.live_estimate(10_000) == pytest.approx(0.010 + 0.020)
    costs.record_live(1000, 0.5, 0.51)  # one preempted apply does not swing it
    assert costs.per_element_s == pytest.approx(2e-6)
    assert costs.live_estimate(10_000) == pytest.approx(0.010 + 0.020)
    for _ in range(lr.PauseCosts.WINDOW):
        costs.record_live(1000, 0.01, 0.02)
    assert costs.per_element_s == pytest.approx(1e-5) and costs.live_estimate(0) == pytest.approx(0.01)  # the last WINDOW



def test_a_larger_update_is_estimated_from_the_line_through_applies_of_both_sizes_not_the_small_ones_rate():
    """Measured on the benchmark model (TP=2): 1% applies (3.3M elements) paused 0.094 s with a
    scatter of 0.06 s, a 5% one (16M) 0.152 s. The small applies' rate (18 ns an element, their
    sparse writes) put the next 5% update at 0.34 s, above a reload, and the engine reloaded at
    0.66 s where a live apply took 0.15 s."""
    costs = lr.PauseCosts()
    costs.record_live(3_300_000, 0.060, 0.094)
    costs.record_live(16_000_000, 0.100, 0.152)
    costs.record_live(3_300_000, 0.061, 0.095)
    assert costs.live_estimate(16_000_000) == pytest.approx(0.152, abs=0.002)
    costs.record_reload(0.25)
    costs.record_reload_check(0.03)
    assert costs.reload_estimate == pytest.approx(0.28)
    assert lr.choose_mode([vote("tp0", 16_000_000, costs.live_estimate(16_000_000), costs.reload_estimate)])[0] == lr.LIVE


def test_the_reply_carries_both_estimates():
    report = lr.LiveRankReport(host="h", rank="tp0", success=True, mode=lr.LIVE, weight_version=3)
    fields = lr.summarize(3, lr.merge_hosts([report]), **lr.estimate_fields([vote("tp0", 10, 0.01, 0.2)]))
    assert fields["success"] and fields["live_estimate_s"] == 0.01 and fields["reload_estimate_s"] == 0.2


def test_the_engine_reloads_when_one_ranks_measured_live_estimate_exceeds_the_reload_and_the_reply_says_both():
    """Across DP groups and stages: the slowest rank's live estimate against the reload estimate."""
    import asyncio

    from sglang_patch.live import transaction as tx

    sent = []

    def engine(votes):
        async def send(phase, reason):
            sent.append((phase, reason))
            out = tx.PhaseReplies()
            if phase == tx.VOTE:
                out.votes.extend(votes)
            else:
                mode = lr.RELOAD if phase == tx.RELOAD else lr.LIVE
                out.reports.extend(lr.LiveRankReport(host="h", rank=v.rank, success=True, mode=mode, weight_version=4)
                                   for v in votes)
            return out
        return send

    slow = [vote("dp0/tp0", 100, 0.01, 0.2), vote("dp1/tp0", 90_000, 0.45, 0.25)]
    fields = asyncio.run(tx.run_transaction(engine(slow), 4))
    assert [p for p, _ in sent] == [tx.VOTE, tx.RELOAD] and "a reload is estimated faster" in sent[1][1]
    assert fields["success"] and fields["mode"] == lr.RELOAD
    assert (fields["live_estimate_s"], fields["reload_estimate_s"]) == (0.45, 0.25)
    sent.clear()
    fast = [vote("dp0/tp0", 100, 0.01, 0.2), vote("dp1/tp0", 100, 0.02, 0.25)]
    fields = asyncio.run(tx.run_transaction(engine(fast), 4))
    assert [p for p, _ in sent] == [tx.VOTE, tx.APPLY, tx.COMMIT] and fields["mode"] == lr.LIVE
    assert (fields["live_estimate_s"], fields["reload_estimate_s"]) == (0.02, 0.25)
