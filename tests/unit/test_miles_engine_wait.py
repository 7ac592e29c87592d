"""The other ranks' wait for rank 0 (``engine_wait.RankZeroWait``) on a real c10d TCPStore, the
ranks as threads of this process (the gloo ranks of test_miles_updater_engine_rounds.py run it
inside the updater): a heartbeat keeps the others waiting for as long as it beats, a rank 0 that
says nothing is given up on, a give-up or a cap leaves the next round working, and every round's
keys leave the store.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from miles_updater.engine_wait import EngineWaitTimeout, RankZeroWait, connect_store


@pytest.fixture()
def store():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    return dist.PrefixStore("default_pg", master)  # as torch's default store is


def _ranks(store, world: int, **kw) -> list[RankZeroWait]:
    """Each rank with a connection of its own, as in a trainer (``connect_store``)."""
    return [RankZeroWait(connect_store(store) if store is not None else None, "weightsync/engine-wait/test", r, world,
                         **kw) for r in range(world)]


def _finish_in_thread(wait: RankZeroWait) -> tuple[threading.Thread, list]:
    box: list = []

    def run():
        try:
            box.append(wait.finish(None))
        except EngineWaitTimeout as e:
            box.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_the_others_wait_past_their_heartbeat_timeout_while_rank_0_beats(store):
    r0, r1, r2 = _ranks(store, 3, heartbeat_timeout_s=0.4)
    r0.begin()
    waiting = [_finish_in_thread(r) for r in (r1, r2)]
    time.sleep(2.0)  # five heartbeat timeouts of the waiting ranks
    assert r0.finish({"version": 7}) == {"version": 7}
    for t, box in waiting:
        t.join()
        assert box == [{"version": 7}]


def test_a_rank_0_that_says_nothing_is_given_up_on_naming_the_heartbeat_timeout(store):
    r0, r1 = _ranks(store, 2, heartbeat_timeout_s=0.5)
    with pytest.raises(EngineWaitTimeout, match=r"rank 0 said nothing for [\d.]+ s \(--update-weight-engine-heartbeat-"
                                                r"timeout-s 0.5\)"):
        r1.finish(None)


def test_a_rank_that_gave_up_gets_the_next_rounds_value_not_the_late_one(store):
    base = store.num_keys()
    r0, r1 = _ranks(store, 2, heartbeat_timeout_s=0.5)
    with pytest.raises(EngineWaitTimeout):
        r1.finish(None)  # round 0: rank 0 is late
    assert r0.finish("round 0, late") == "round 0, late"  # rank 0 ends round 0 after rank 1 gave up
    t, box = _finish_in_thread(r1)
    r0.begin()
    time.sleep(0.2)
    r0.finish("round 1")
    t.join()
    assert box == ["round 1"]
    assert store.num_keys() == base  # both rounds' keys deleted, the given-up one included


def test_a_cap_ends_the_wait_though_rank_0_beats_and_the_next_round_works(store):
    r0, r1 = _ranks(store, 2, heartbeat_timeout_s=5.0, cap_s=0.5)
    r0.begin()
    with pytest.raises(EngineWaitTimeout, match=r"did not end within --update-weight-engine-wait-timeout-s 0.5 s "
                                                r"\(it was still alive"):
        r1.finish(None)
    r0.finish("round 0")
    t, box = _finish_in_thread(r1)
    r0.finish("round 1")
    t.join()
    assert box == ["round 1"]


def test_many_rounds_leave_no_keys_in_the_store(store):
    base = store.num_keys()
    ranks = _ranks(store, 3, heartbeat_timeout_s=5.0)
    for n in range(50):
        waiting = [_finish_in_thread(r) for r in ranks[1:]]
        ranks[0].begin()
        ranks[0].finish(n)
        for t, box in waiting:
            t.join()
            assert box == [n]
    assert store.num_keys() == base


def test_a_single_rank_needs_no_store(store):
    (only,) = _ranks(None, 1, heartbeat_timeout_s=1.0)
    only.begin()
    assert only.finish("alone") == "alone"


def test_an_interrupted_rank_0_is_given_up_on_and_the_next_round_stays_in_step(store):
    base = store.num_keys()
    r0, r1 = _ranks(store, 2, heartbeat_timeout_s=0.5)
    r0.begin()
    r0.abandon()  # e.g. a KeyboardInterrupt the trainer caught in the engine phase
    with pytest.raises(EngineWaitTimeout, match="rank 0 said nothing"):
        r1.finish(None)
    t, box = _finish_in_thread(r1)
    r0.begin()
    r0.finish("next round")
    t.join()
    assert box == ["next round"] and store.num_keys() == base
