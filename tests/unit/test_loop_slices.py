"""The scheduler thread's sliced work queue (``sglang_patch.live.loop_slices``): what a caller on
another thread sees, driven here by a plain thread standing in for sglang's loop."""

from __future__ import annotations

import threading

import pytest

from sglang_patch.live.loop_slices import LoopSlices, LoopWorkTimeout


def _drive(loop: LoopSlices, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            loop.run_slice()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _counting(n: int, seen: list, where: list):
    for i in range(n):
        seen.append(i)
        where.append(threading.current_thread().name)
        yield


def test_a_job_runs_to_its_end_on_the_loop_thread_and_the_caller_waits_for_it():
    loop, stop, seen, where = LoopSlices(budget_s=0.0), threading.Event(), [], []
    driver = _drive(loop, stop)
    try:
        loop.run(_counting(50, seen, where), timeout_s=60)
        assert seen == list(range(50))
        assert set(where) == {driver.name}  # never the caller's thread
    finally:
        stop.set()


def test_every_slice_advances_a_job_by_at_least_one_step_even_with_no_budget():
    loop, seen, where = LoopSlices(budget_s=0.0), [], []
    job = threading.Thread(target=loop.run, args=(_counting(3, seen, where),), kwargs={"timeout_s": 60})
    job.start()
    while not loop._jobs:
        pass
    for expected in (1, 2, 3):
        loop.run_slice()
        assert len(seen) == expected
    loop.run_slice()  # the job ends: the caller is released
    job.join(timeout=60)
    assert not job.is_alive()


def test_a_slice_of_an_idle_engine_runs_to_the_longer_idle_budget():
    idle, seen, where = [False], [], []
    loop = LoopSlices(budget_s=0.0, idle_budget_s=600.0, is_idle=lambda: idle[0])
    job = threading.Thread(target=loop.run, args=(_counting(5, seen, where),), kwargs={"timeout_s": 60})
    job.start()
    while not loop._jobs:
        pass
    loop.run_slice()
    assert len(seen) == 1  # serving: one step (no budget)
    idle[0] = True
    loop.run_slice()
    assert len(seen) == 5  # idle: the rest of the job in one slice
    job.join(timeout=60)
    assert not job.is_alive()


def test_an_idle_check_that_fails_counts_as_serving():
    seen: list = []
    loop = LoopSlices(budget_s=0.0, idle_budget_s=600.0, is_idle=lambda: 1 / 0)
    job = threading.Thread(target=loop.run, args=(_counting(3, seen, []),), kwargs={"timeout_s": 60})
    job.start()
    while not loop._jobs:
        pass
    loop.run_slice()
    assert len(seen) == 1
    while job.is_alive():
        loop.run_slice()


def test_a_step_that_raises_reaches_the_caller_and_the_loop_goes_on():
    loop, stop = LoopSlices(), threading.Event()

    def failing():
        yield
        raise ValueError("bad patch")

    _drive(loop, stop)
    try:
        with pytest.raises(ValueError, match="bad patch"):
            loop.run(failing(), timeout_s=60)
        seen: list = []
        loop.run(_counting(2, seen, []), timeout_s=60)  # the next job still runs
        assert seen == [0, 1]
    finally:
        stop.set()


def test_a_job_no_loop_runs_times_out_and_is_dropped_so_a_late_loop_never_runs_it():
    loop, seen = LoopSlices(), []
    with pytest.raises(LoopWorkTimeout, match="did not finish"):
        loop.run(_counting(5, seen, []), timeout_s=0.05)
    loop.run_slice()
    assert seen == []


def test_the_queue_counts_as_driven_only_once_a_loop_has_called_it():
    loop = LoopSlices()
    assert not loop.is_driven
    loop.run_slice()
    assert loop.is_driven
