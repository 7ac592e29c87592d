"""Run a pull off the scheduler's event loop and finish it on every rank, with a deadline.

The problem: a pull takes seconds to minutes of disk work, the scheduler's loop must keep serving
generation meanwhile, every rank (each TP rank of each pipeline stage, on every node) must pull,
the reply may say success only if every rank's host holds the verified target, and a pull stuck
on a hung filesystem read must not hold the engine forever. Gathering the ranks' outcomes is a
collective: if one rank enters it and another does not, both hang.

The design, per scheduler process (one ``PullCoordinator`` each):

1. ``on_request`` runs inside the scheduler's request dispatch. sglang broadcasts every request
   from the entry rank to all TP ranks and relays it from each pipeline stage to the next, so all
   ranks of a stage call it for the same request at the same loop iteration, and every stage sees
   the same request stream in the same order. If no pull is running it starts a daemon thread
   that does the rank's whole pull (path checks included: they depend on the host's filesystem,
   so they may differ between nodes and must not short-circuit on one rank only) and returns
   ``None``: the reply is deferred. If the same pull (same dirs, same target) is running, the
   request joins it and gets its reply; a pull to anything else is refused at once with
   ``PullInProgress``; nothing is queued.
2. ``poll`` runs once per loop iteration on every rank. While a pull is pending, each rank
   contributes "my part is done" to an all-reduce(MIN) over its stage's TP CPU group: a tiny
   collective that every rank of the stage enters at every iteration, so it cannot deadlock, and
   whose result is identical on the stage. A rank's part is done when its thread finished or its
   deadline passed (then its report is a ``PullTimeoutError``, the puller is asked to ``cancel``
   (the helper process running the pull is killed, which ends a hung read and frees the host
   lock) and the thread is abandoned: if it still finishes, it touches only its own record; the
   core writes the marker only after verifying, and its host lock orders it before any later pull). Only when the all-reduce says "all done"
   do the stage's ranks, in that same iteration, all-gather their reports and clear the pull.
3. Pipeline stages: a per-iteration collective *across* stages would deadlock (a later stage
   receives iteration i's requests from the earlier one only after the earlier one has processed
   them), so stages do not meet in a collective. Each later stage's leader posts its stage's
   reports on a ``StageChannel`` (a key-value side channel, keyed by the request); stage 0's
   leader counts "my part is done" only once every stage has posted, or once the deadline plus a
   grace has passed (then the missing stage is reported as timed out). A stage can clear its pull
   only before stage 0 does, and it is never ahead of stage 0 in the request stream, so every
   stage agrees on "a pull is pending" for every request it sees, which keeps 1 consistent.
4. Stage 0 builds the reply from every report of every stage and sends it, once per waiting
   request, through the scheduler's control output path; only the entry rank owns a socket, the
   others' sends are no-ops. Later stages send nothing.

Invariants: the pull thread never raises (every exception becomes a failed report, traceback to
the log); ``on_request`` and ``poll`` never raise into the scheduler; a rank whose own pull failed
or timed out still joins both collectives. No sglang imports: the group, the channel and the
reply path are injected.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from weightsync.errors import PullInProgressError, PullTimeoutError

from . import results

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
# How long stage 0 waits past its own deadline for a later stage's report: a later stage saw
# the request a little later and times out by its own clock.
STAGE_REPORT_GRACE_S = 15.0
# Stage 0 asks the channel (a round trip to the store) at most this often, not every iteration.
STAGE_CHECK_INTERVAL_S = 0.05


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


class StageChannel(Protocol):
    """Carries a pipeline stage's reports to stage 0 (one key per pull and stage)."""

    def post(self, key: str, value: Any) -> None: ...

    def take(self, key: str) -> Any:
        """The value posted under ``key`` (removing it), or None if none is there yet; never blocks."""


@dataclass(frozen=True)
class Stage:
    """Where this rank sits in the pipeline: ``leader`` is the stage's TP rank 0."""

    pp_rank: int = 0
    pp_size: int = 1
    leader: bool = True
    channel: Optional[StageChannel] = None

    @property
    def collects_stage_reports(self) -> bool:
        return self.pp_size > 1 and self.pp_rank == 0 and self.leader


@dataclass
class _PendingPull:
    request: Any
    key: str
    started: float
    deadline: float
    waiters: list
    done: threading.Event = field(default_factory=threading.Event)
    report: Any = None
    abandoned: bool = False
    stage_reports: dict = field(default_factory=dict)  # pp_rank -> [RankPullReport] (stage 0 leader)
    next_stage_check: float = 0.0


def is_same_pull(a: Any, b: Any) -> bool:
    """Two requests ask for the same pull: same target, same local dir, same source dir."""
    return (a.target_version, a.local_checkpoint_dir, a.source_dir) == (
        b.target_version,
        b.local_checkpoint_dir,
        b.source_dir,
    )


class PullCoordinator:
    """Deferred, joinable, deadline-bounded, collectively finished pulls for one scheduler rank.

    Args:
        group: the stage's TP group's collectives (``SingleRankGroup`` for TP=1).
        run_rank_pull: ``fn(request) -> RankPullReport``; runs in the pull thread, may raise. If it
            has ``cancel(error)``, that is called when the pull passes its deadline.
        host, rank: this rank's labels in reports it writes itself (failures, timeouts).
        make_reply: ``fn(reply_fields) -> reply`` (the IPC message).
        send_reply: ``fn(reply, request)``: the scheduler's control output path.
        timeout_s: the deadline of one pull on this rank.
        stage: this rank's pipeline stage (default: no pipeline).
        clock: ``time.monotonic`` (injectable so that deadlines are tested without waiting).
    """

    def __init__(
        self,
        *,
        group: RankGroup,
        run_rank_pull: Callable[[Any], Any],
        host: str,
        rank: str,
        make_reply: Callable[[dict], Any],
        send_reply: Callable[[Any, Any], None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        stage: Stage = Stage(),
        stage_grace_s: float = STAGE_REPORT_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self._run_rank_pull = run_rank_pull
        self.host = host
        self.rank = rank
        self._make_reply = make_reply
        self._send_reply = send_reply
        self.timeout_s = float(timeout_s)
        self.stage = stage
        self.stage_grace_s = float(stage_grace_s)
        self._clock = clock
        self._pending: Optional[_PendingPull] = None
        self._sequence = itertools.count()

    @property
    def is_pending(self) -> bool:
        return self._pending is not None

    # -- requests --------------------------------------------------------------------------

    def on_request(self, request: Any) -> Any:
        """Start or join a pull (returns None: reply deferred), or refuse it (returns the reply)."""
        try:
            pending = self._pending
            if pending is not None:
                if is_same_pull(request, pending.request):
                    log.info("pull_weights %s: a request for the running pull to v%s joins it", self.rank, request.target_version)
                    pending.waiters.append(request)
                    return None
                log.warning(
                    "pull_weights %s: v%s refused, a pull to v%s is running",
                    self.rank, request.target_version, pending.request.target_version,
                )  # fmt: skip
                refusal = PullInProgressError(request.target_version, pending.request.target_version)
                return self._make_reply(results.error_reply_fields(request.target_version, refusal))
            self._start(request)
            return None
        except Exception as exc:  # never into the scheduler
            log.exception("pull_weights %s: could not start the pull", self.rank)
            self._pending = None
            return self._make_reply(
                results.error_reply_fields(getattr(request, "target_version", -1), exc, where="starting the pull")
            )

    def _start(self, request: Any) -> None:
        now = self._clock()
        # Every stage sees the same request (same rid); the sequence number is the fallback.
        key = str(getattr(request, "rid", None) or f"seq{next(self._sequence)}")
        pending = _PendingPull(
            request=request, key=key, started=now, deadline=now + self.timeout_s, waiters=[request]
        )
        thread = threading.Thread(target=self._thread_main, args=(pending,), name="pull-weights", daemon=True)
        self._pending = pending
        thread.start()

    def _thread_main(self, pending: _PendingPull) -> None:
        start = self._clock()
        try:
            pending.report = self._run_rank_pull(pending.request)
        except BaseException as exc:  # the thread must always leave a report behind
            log.exception("pull_weights %s: the pull failed on this rank", self.rank)
            try:
                pending.report = results.report_failure(self.host, self.rank, exc, seconds=self._clock() - start)
            except BaseException:
                log.exception("pull_weights %s: could not even describe the failure", self.rank)
        finally:
            pending.done.set()
        if pending.abandoned:
            outcome = "success" if getattr(pending.report, "success", False) else "failure"
            log.warning(
                "pull_weights %s: the pull to v%s abandoned at its deadline finished %.0f s later (%s); "
                "nothing was reported (the reply was a timeout)",
                self.rank, pending.request.target_version, self._clock() - pending.deadline, outcome,
            )  # fmt: skip

    # -- every loop iteration ----------------------------------------------------------------

    def poll(self) -> None:
        """Once per scheduler loop iteration, on every rank: finish the pull when the stage is done."""
        pending = self._pending
        if pending is None:
            return
        try:
            now = self._clock()
            local_done = pending.done.is_set() or now >= pending.deadline
            if local_done and self.stage.collects_stage_reports:
                local_done = self._collect_stage_reports(pending, now) or now >= pending.deadline + self.stage_grace_s
            all_done = self.group.all_min(int(local_done)) if self.group.size > 1 else int(local_done)
            if not all_done:
                return
            reports = self.group.all_gather(self._own_report(pending, now))
            self._pending = None
            if self.stage.pp_rank > 0:  # stage 0 replies for every stage
                self._post_stage_reports(pending, reports)
                return
            reports = reports + self._later_stage_reports(pending)
            hosts = results.merge_host_results(r for r in reports if r is not None)
            fields = results.summarize(pending.request.target_version, hosts, now - pending.started)
        except Exception as exc:
            log.exception("pull_weights %s: finishing the pull failed", self.rank)
            self._pending = None
            fields = results.error_reply_fields(pending.request.target_version, exc, where="inside the scheduler")
        for waiter in pending.waiters:
            try:
                self._send_reply(self._make_reply(fields), waiter)
            except Exception:
                log.exception("pull_weights %s: sending the reply failed", self.rank)

    def _own_report(self, pending: _PendingPull, now: float) -> Any:
        if pending.done.is_set() and pending.report is not None:
            return pending.report
        if pending.done.is_set():
            exc: BaseException = RuntimeError("the pull thread left no report")
        else:
            pending.abandoned = True
            exc = PullTimeoutError(pending.request.target_version, self.timeout_s)  # the merge names the rank
            log.error("pull_weights %s: %s", self.rank, exc)
            self._cancel_pull(exc)
        return results.report_failure(self.host, self.rank, exc, seconds=now - pending.started)

    def _cancel_pull(self, exc: BaseException) -> None:
        """Stop the abandoned pull where the puller can (a helper process is killed, which ends a
        hung read and frees the host lock); a puller that cannot is left to finish on its own."""
        cancel = getattr(self._run_rank_pull, "cancel", None)
        if cancel is None:
            return
        try:
            cancel(exc)
        except Exception:
            log.exception("pull_weights %s: cancelling the abandoned pull failed", self.rank)

    # -- pipeline stages ----------------------------------------------------------------------

    def _stage_key(self, pending: _PendingPull, pp_rank: int) -> str:
        return f"{pending.key}/pp{pp_rank}"

    def _post_stage_reports(self, pending: _PendingPull, reports: list) -> None:
        if self.stage.leader and self.stage.channel is not None:
            self.stage.channel.post(self._stage_key(pending, self.stage.pp_rank), list(reports))

    def _collect_stage_reports(self, pending: _PendingPull, now: float) -> bool:
        """Take what the later stages posted; True once every stage has."""
        channel = self.stage.channel
        if now < pending.next_stage_check:
            return False
        pending.next_stage_check = now + STAGE_CHECK_INTERVAL_S
        for pp_rank in range(1, self.stage.pp_size):
            if pp_rank in pending.stage_reports or channel is None:
                continue
            try:
                posted = channel.take(self._stage_key(pending, pp_rank))
            except Exception:
                log.exception("pull_weights %s: reading stage %d's report failed", self.rank, pp_rank)
                posted = None
            if posted is not None:
                pending.stage_reports[pp_rank] = list(posted)
        return len(pending.stage_reports) == self.stage.pp_size - 1

    def _later_stage_reports(self, pending: _PendingPull) -> list:
        """The later stages' reports (stage 0's leader only); a stage that never posted is a timeout."""
        if not self.stage.collects_stage_reports:
            return []
        out: list = []
        for pp_rank in range(1, self.stage.pp_size):
            posted = pending.stage_reports.get(pp_rank)
            if posted is not None:
                out.extend(posted)
                continue
            where = f"pipeline stage {pp_rank} (it did not report within the deadline)"
            exc = PullTimeoutError(pending.request.target_version, self.timeout_s, where)
            out.append(results.report_failure(f"pp-stage-{pp_rank}", f"pp{pp_rank}", exc))
        return out
