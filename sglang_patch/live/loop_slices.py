"""Work that the scheduler thread does itself, a time-boxed slice between its loop iterations.

Why not a thread: in the scheduler process sglang's loop holds the GIL nearly all the time (it
busy-polls). A side thread that makes many short C calls, each giving the GIL up, waits to win
it back after every call: measured 9 ms per call at TP=1, even with a 0.1 ms switch interval,
so 160 small torch calls took 4.3 s. The loop thread itself never waits for the GIL, so the
same calls made there cost only their work. Slicing bounds what one iteration gains: at most
``budget_s`` plus one step (at least one step runs per call, so a job always progresses),
and serving goes on while the work runs; an engine with nothing to serve gives a slice the
longer ``idle_budget_s``.

A caller on another thread (the pull thread) submits a generator of steps and waits; the loop
runs ``run_slice`` from its per-iteration hook. If the loop stops running slices (the engine
is busy in one long forward, or shutting down), the caller gives up after ``timeout_s`` and
cancels the job, which the loop then drops.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterator, NamedTuple, Optional

__all__ = ["Finished", "LoopSlices", "LoopWorkTimeout", "drain"]


class LoopWorkTimeout(Exception):
    """The scheduler loop did not finish the work in time (it was cancelled)."""


def drain(steps: Iterator[None]) -> object:
    """Run ``steps`` to the end in the calling thread; returns the generator's return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class Finished(NamedTuple):
    """A job the loop finished: the generator's return value, and how the work went."""

    result: object
    steps: int
    slices: int
    busy_s: float  # inside the steps
    wall_s: float  # from submission to the end

    def __str__(self) -> str:
        return f"{self.steps} steps in {self.slices} slices, {self.busy_s:.3f}s of work in {self.wall_s:.3f}s"


class _Job:
    def __init__(self, steps: Iterator[None]) -> None:
        self.steps = steps
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.result: object = None  # the generator's return value
        self.cancelled = False
        self.queued = time.perf_counter()
        self.steps_run = 0
        self.slices = 0
        self.busy_s = 0.0


class LoopSlices:
    """A queue of step generators that ``run_slice`` advances for at most ``budget_s`` a call,
    or ``idle_budget_s`` while ``is_idle()`` says the engine has nothing to serve.

    The idle budget is longer because an idle iteration holds up no generation, only a request
    that arrives during the slice (by at most that budget); and each iteration costs more than
    its slice here (the TP ranks meet in a broadcast every iteration, and the CPUs are shared
    with the pull helpers): with 2 ms slices, 0.19 s of staging work took 0.5-0.7 s at TP=2.
    """

    def __init__(self, budget_s: float = 0.002, *, idle_budget_s: float = 0.010,
                 is_idle: Optional[Callable[[], bool]] = None,
                 around_slice: Optional[Callable[[], object]] = None) -> None:
        self.budget_s = budget_s
        self.idle_budget_s = idle_budget_s
        self._is_idle = is_idle
        self._around = around_slice  # a context manager factory for each slice (e.g. one intra-op thread)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self.last_tick: Optional[float] = None  # monotonic time of the loop's last call

    @property
    def is_driven(self) -> bool:
        """Whether a loop has called ``run_slice`` in the last few seconds."""
        return self.last_tick is not None and time.monotonic() - self.last_tick < 5.0

    def run(self, steps: Iterator[None], *, timeout_s: float) -> "Finished":
        """Have the loop run ``steps`` to the end; blocks the calling thread until it has.

        Raises:
            LoopWorkTimeout: ``timeout_s`` passed without the job finishing (it is cancelled).
            Whatever a step raised.
        """
        return self.wait(self.submit(steps), timeout_s=timeout_s)

    def submit(self, steps: Iterator[None]) -> "_Job":
        """Queue ``steps`` for the loop and return at once; ``wait`` for them, or ``cancel``."""
        job = _Job(steps)
        with self._lock:
            self._jobs.append(job)
        return job

    def wait(self, job: "_Job", *, timeout_s: float) -> "Finished":
        """Block until the loop finished ``job`` (see ``run``)."""
        if not job.done.wait(timeout_s):
            self.cancel(job)
            if not job.done.is_set():
                raise LoopWorkTimeout(f"the scheduler loop did not finish the work within {timeout_s:.0f}s")
        if job.error is not None:
            raise job.error
        return Finished(job.result, job.steps_run, job.slices, job.busy_s, time.perf_counter() - job.queued)

    def cancel(self, job: "_Job") -> None:
        """The loop runs no further step of ``job`` (a step running now ends first)."""
        with self._lock:
            job.cancelled = True
            if job in self._jobs:
                self._jobs.remove(job)

    def run_slice(self) -> None:
        """Advance the queued jobs for about ``budget_s`` (the loop thread calls this every iteration)."""
        self.last_tick = time.monotonic()
        if not self._jobs:
            return
        deadline = time.perf_counter() + (self.idle_budget_s if self._idle() else self.budget_s)
        context = self._around() if self._around is not None else None
        if context is not None:
            context.__enter__()
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        return
                    job = self._jobs[0]
                if not self._advance(job, deadline):
                    with self._lock:
                        if self._jobs and self._jobs[0] is job:
                            self._jobs.popleft()
                    job.done.set()
                if time.perf_counter() >= deadline:
                    return
        finally:
            if context is not None:
                context.__exit__(None, None, None)

    def _idle(self) -> bool:
        if self._is_idle is None:
            return False
        try:
            return bool(self._is_idle())
        except Exception:  # a scheduler without the check, or a broken one: the short budget
            return False

    @staticmethod
    def _advance(job: _Job, deadline: float) -> bool:
        """Run ``job``'s steps (at least one) until ``deadline``; False once it ended (finished,
        failed or cancelled)."""
        if job.cancelled:
            return False
        job.slices += 1
        t0 = time.perf_counter()
        try:
            job.steps_run += 1
            next(job.steps)
            while time.perf_counter() < deadline:
                job.steps_run += 1
                next(job.steps)
        except StopIteration as done:
            job.result = done.value
            return False
        except Exception as exc:  # handed to the waiting caller, never into the loop
            job.error = exc
            return False
        except BaseException as exc:  # an interrupt: the caller is told, the loop sees it too
            job.error = exc
            job.done.set()
            raise
        finally:
            job.busy_s += time.perf_counter() - t0
        return True
