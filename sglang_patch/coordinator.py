"""Run a pull off the scheduler's event loop and finish it on every TP rank at the same iteration.

The problem: a pull takes seconds to minutes of disk work, the scheduler's loop must keep serving
generation meanwhile, every TP rank (on every node) must pull, and the reply may say success only
if every rank's host holds the verified target. Gathering the ranks' outcomes is a collective:
if one rank enters it and another does not, both hang.

The design, per scheduler process (one ``PullCoordinator`` each):

1. ``on_request`` runs inside the scheduler's request dispatch. sglang broadcasts every request
   from the entry rank to all TP ranks, so all ranks call it for the same request, at the same
   loop iteration, in the same order. If no pull is running it starts a daemon thread that does
   the rank's whole pull (path checks included: they depend on the host's filesystem, so they may
   differ between nodes and must not short-circuit on one rank only) and returns ``None``: the
   reply is deferred. If a pull is running, every rank sees that too (see 3) and answers a
   conflict at once; nothing is queued.
2. ``poll`` runs once per loop iteration on every rank (after request processing; the loop's own
   request broadcast keeps ranks in step iteration by iteration). While a pull is pending, each
   rank contributes "my thread is done" to an all-reduce(MIN) over the TP group's CPU group: a
   tiny collective that every rank enters at every iteration, so it cannot deadlock, and whose
   result is identical everywhere. Only when it says "all done" do all ranks, in that same
   iteration, all-gather their reports and clear the pending pull. Thus "a pull is pending" is
   the same on every rank at every iteration, which is what makes 1's conflict answer consistent.
3. The reply is built from all ranks' reports and sent through the scheduler's normal control
   output path; only the entry rank owns a socket, the others' sends are no-ops.

Invariants: the pull thread never raises (every exception becomes a failed report, traceback to
the log); ``on_request`` and ``poll`` never raise into the scheduler; a rank whose own pull failed
still joins both collectives. No sglang imports: the group and the reply path are injected.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

log = logging.getLogger(__name__)


class RankGroup(Protocol):
    """The collectives the coordinator needs, over the ranks that share one request stream."""

    size: int

    def all_min(self, value: int) -> int: ...

    def all_gather(self, obj: Any) -> list: ...


class SingleRankGroup:
    """A group of one (TP=1): collectives are identities."""

    size = 1

    def all_min(self, value: int) -> int:
        return value

    def all_gather(self, obj: Any) -> list:
        return [obj]


@dataclass
class _PendingPull:
    request: Any
    thread: threading.Thread
    started: float = field(default_factory=time.monotonic)
    report: Any = None


class PullCoordinator:
    """Deferred, conflict-checked, collectively finished pulls for one scheduler rank.

    Args:
        group: the TP group's collectives (``SingleRankGroup`` for TP=1).
        run_rank_pull: ``fn(request) -> report``; runs in the pull thread, may raise.
        failure_report: ``fn(request, exc, seconds) -> report`` for an exception in it.
        build_reply: ``fn(request, reports, seconds) -> reply`` from every rank's report.
        build_conflict: ``fn(request, running_request) -> reply`` for a pull refused as a conflict.
        send_reply: ``fn(reply, request)``: the scheduler's control output path.
        build_internal_error: ``fn(request, exc) -> reply`` when finishing itself failed.
    """

    def __init__(
        self,
        *,
        group: RankGroup,
        run_rank_pull: Callable[[Any], Any],
        failure_report: Callable[[Any, BaseException, float], Any],
        build_reply: Callable[[Any, Sequence[Any], float], Any],
        build_conflict: Callable[[Any, Any], Any],
        send_reply: Callable[[Any, Any], None],
        build_internal_error: Callable[[Any, BaseException], Any],
    ) -> None:
        self.group = group
        self._run_rank_pull = run_rank_pull
        self._failure_report = failure_report
        self._build_reply = build_reply
        self._build_conflict = build_conflict
        self._send_reply = send_reply
        self._build_internal_error = build_internal_error
        self._pending: Optional[_PendingPull] = None

    @property
    def is_pending(self) -> bool:
        return self._pending is not None

    def on_request(self, request: Any) -> Any:
        """Start a pull (returns None: reply deferred) or answer a conflict (returns the reply)."""
        try:
            if self._pending is not None:
                log.warning("pull_weights: refusing a second pull while one is running (conflict)")
                return self._build_conflict(request, self._pending.request)
            pending = _PendingPull(request=request, thread=None)  # type: ignore[arg-type]
            pending.thread = threading.Thread(
                target=self._thread_main, args=(pending,), name="pull-weights", daemon=True
            )
            self._pending = pending
            pending.thread.start()
            return None
        except Exception as exc:  # never into the scheduler
            log.exception("pull_weights: could not start the pull")
            self._pending = None
            return self._build_internal_error(request, exc)

    def _thread_main(self, pending: _PendingPull) -> None:
        start = time.monotonic()
        try:
            pending.report = self._run_rank_pull(pending.request)
        except BaseException as exc:  # the thread must always leave a report behind
            log.exception("pull_weights: the pull failed on this rank")
            try:
                pending.report = self._failure_report(pending.request, exc, time.monotonic() - start)
            except BaseException:
                log.exception("pull_weights: could not even describe the failure")
                pending.report = None

    def poll(self) -> None:
        """Once per scheduler loop iteration, on every rank: finish the pull when all ranks are done."""
        pending = self._pending
        if pending is None:
            return
        try:
            local_done = 0 if pending.thread.is_alive() else 1
            all_done = self.group.all_min(local_done) if self.group.size > 1 else local_done
            if not all_done:
                return
            report = pending.report
            if report is None:
                report = self._failure_report(
                    pending.request, RuntimeError("the pull thread left no report"), time.monotonic() - pending.started
                )
            reports = self.group.all_gather(report) if self.group.size > 1 else [report]
            self._pending = None
            reply = self._build_reply(pending.request, reports, time.monotonic() - pending.started)
        except Exception as exc:
            log.exception("pull_weights: finishing the pull failed")
            self._pending = None
            try:
                reply = self._build_internal_error(pending.request, exc)
            except Exception:
                log.exception("pull_weights: could not build the error reply")
                return
        try:
            self._send_reply(reply, pending.request)
        except Exception:
            log.exception("pull_weights: sending the reply failed")
