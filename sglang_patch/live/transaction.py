"""One live-apply transaction for the whole engine: every rank of every pipeline stage and DP
group votes, writes (keeping its undo log) and reports, and only then every rank commits or
every rank restores. No sglang here: the channel, the reply path and the engine are injected.

Why not per DP group or per stage: each DP group's schedulers answer the tokenizer on their
own, and a later pipeline stage sees a request only after stage 0's handler returned (sglang
relays the requests stage to stage after processing them). A decision taken inside one group
or one stage replied success while another group or stage rolled back, and the engine served
two versions (issue 19, points 3 and 4).

The protocol (``run_transaction``, on the tokenizer, which holds sglang's model-update writer
lock throughout, so no generation runs between the phases):

1. ``vote``: every rank says whether it can patch live (or refuses the request).
2. all live: ``apply``: every rank writes its staged patches, keeps its undo log and reports.
   Any other vote: ``reload`` on every rank (sglang's own loader).
3. every rank applied: ``commit`` (each rank takes the new version and flushes its cache: all
   ranks or none, their schedulers must stay in step). Otherwise ``rollback``:
   every rank writes its undo log back and checks it; a rank that reports "not restored" makes
   every rank ``reload`` the target from the local checkpoint (which holds it verified), so the
   engine never serves a mix.
4. a ``reload`` that failed on any rank is repeated on every rank, once (a rank whose load
   failed holds other weights than the rest); a second failure is a reply that says so.

Each phase is one request to every DP group (the tokenizer's fan-out); inside a group every TP
rank of a stage handles it at the same loop iteration and all-gathers its item. Stage k > 0's
TP leader posts its stage's items to the torch.distributed store (``StageGather``); stage 0's
entry rank replies only once every stage has posted (or a deadline passed: the missing stage
is then a failure), polled once per loop iteration, never blocking the loop. Every round has a
key of its own (the transaction, the round's number on the rank, the phase: ``state._round_key``),
and a stage's post that comes after its round's deadline is taken off the store when it comes and
dropped, never read as a later round's (issue 28, point 3: a repeated reload reused the first's key).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from . import results as lr

log = logging.getLogger(__name__)

VOTE, APPLY, COMMIT, ROLLBACK, RELOAD = "vote", "apply", "commit", "rollback", "reload"
PHASES = (VOTE, APPLY, COMMIT, ROLLBACK, RELOAD)
STAGE_TIMEOUT_S = 300.0  # a later stage's writes of a large model; only a dead stage takes this long
STAGE_CHECK_INTERVAL_S = 0.002  # the store round trip is a syscall: not on every busy-loop iteration
LATE_POSTS_KEPT = 64  # the rounds whose missing stages' late posts are still awaited, to be dropped


# --- the scheduler side: one phase's items from every stage of a DP group ------------------------


@dataclass
class _PendingPhase:
    request: Any
    key: str
    items: dict  # pp_rank -> [item]
    deadline: float
    make_output: Callable[[list, list], Any]
    next_check: float = 0.0


class StageGather:
    """Brings one phase's per-rank items of every pipeline stage to stage 0's entry rank.

    ``finish(request, key, items, make_output)`` runs on every rank with its stage's
    all-gathered items: without pipeline stages it returns ``make_output(items, [])`` at once;
    a later stage's leader posts its items and returns None; stage 0's leader keeps them and
    returns None, and ``poll`` (every loop iteration) sends ``make_output(all items, missing
    stages)`` once every stage posted or the deadline passed.
    """

    PREFIX = "live/"

    def __init__(self, *, pp_rank: int, pp_size: int, leader: bool, channel: Any,
                 send: Callable[[Any, Any], None], timeout_s: float = STAGE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pp_rank, self.pp_size, self.leader = pp_rank, pp_size, leader
        self.channel, self.send, self.timeout_s, self.clock = channel, send, timeout_s, clock
        self.pending: dict[str, _PendingPhase] = {}  # by key (a digest may come while a phase waits)
        # store keys of stages that missed their round's deadline: taken off the store and dropped
        # if they ever post (oldest forgotten first: a stage that never posts leaves nothing behind)
        self.late: dict[str, None] = {}
        self.late_dropped = 0
        self._next_late_check = 0.0

    def finish(self, request: Any, key: str, items: list, make_output: Callable[[list, list], Any]) -> Any:
        if self.pp_size <= 1:
            return make_output(list(items), [])
        if self.pp_rank > 0:
            if self.leader:
                self.channel.post(self._store_key(key, self.pp_rank), list(items))
            return None
        if not self.leader:
            return None
        self.pending[key] = _PendingPhase(request, key, {0: list(items)}, self.clock() + self.timeout_s, make_output)
        return None

    def poll(self) -> None:
        for pending in list(self.pending.values()):
            self._poll_one(pending)
        if self.late:
            self._drop_late_posts()

    def _store_key(self, key: str, pp_rank: int) -> str:
        return f"{self.PREFIX}{key}/pp{pp_rank}"

    def _drop_late_posts(self) -> None:
        now = self.clock()
        if now < self._next_late_check:
            return
        self._next_late_check = now + STAGE_CHECK_INTERVAL_S * 50
        for store_key in list(self.late):
            try:
                posted = self.channel.take(store_key)
            except Exception:
                log.exception("live apply: dropping the late post %s failed", store_key)
                continue
            if posted is not None:
                del self.late[store_key]
                self.late_dropped += 1
                log.warning("live apply: %s came after its round's deadline and was dropped", store_key)

    def _poll_one(self, pending: _PendingPhase) -> None:
        now = self.clock()
        if now < pending.next_check:
            return
        pending.next_check = now + STAGE_CHECK_INTERVAL_S
        for k in range(1, self.pp_size):
            if k in pending.items:
                continue
            try:
                posted = self.channel.take(self._store_key(pending.key, k))
            except Exception:
                log.exception("live apply: reading stage %d's items of %s failed", k, pending.key)
                posted = None
            if posted is not None:
                pending.items[k] = list(posted)
        missing = [k for k in range(self.pp_size) if k not in pending.items]
        if missing and now < pending.deadline:
            return
        del self.pending[pending.key]
        for k in missing:  # its post, if it ever comes, is this round's: dropped, never read as another's
            self.late[self._store_key(pending.key, k)] = None
        while len(self.late) > LATE_POSTS_KEPT:
            del self.late[next(iter(self.late))]
        items = [item for k in sorted(pending.items) for item in pending.items[k]]
        try:
            output = pending.make_output(items, missing)
        except Exception:
            log.exception("live apply: building the reply of %s failed", pending.key)
            return
        self.send(output, pending.request)


def missing_stage_vote(pp_rank: int, timeout_s: float) -> lr.LiveDecision:
    return lr.LiveDecision(rank=f"pp{pp_rank}", live=False, error_type="internal_error", http_status=500,
                           message=f"pipeline stage {pp_rank} did not vote within {timeout_s:.0f} s")


def missing_stage_report(pp_rank: int, phase: str, timeout_s: float) -> lr.LiveRankReport:
    return lr.LiveRankReport(host=f"pp-stage-{pp_rank}", rank=f"pp{pp_rank}", success=False, mode=lr.LIVE,
                             message=f"pipeline stage {pp_rank} did not report its {phase} within {timeout_s:.0f} s")


# --- the tokenizer side: the decisions ------------------------------------------------------------


@dataclass
class PhaseReplies:
    """Every rank's items of one phase, from every DP group."""

    votes: list = field(default_factory=list)
    reports: list = field(default_factory=list)


def rank_failures(reports: Sequence[lr.LiveRankReport]) -> str:
    return "; ".join(f"{r.rank}: {r.message}" for r in reports if not r.success)


async def run_transaction(send: Callable[[str, Optional[str]], Awaitable[PhaseReplies]], target_version: int) -> dict:
    """Drive one update through the phases; the reply's fields (``live.results.summarize``).

    ``send(phase, reason)``: send the phase to every DP group and return every rank's items.
    """
    votes = (await send(VOTE, None)).votes
    refusal = lr.first_refusal(votes)
    if refusal is not None:
        return lr.summarize(target_version, [], error_type=refusal.error_type, http_status=refusal.http_status,
                            message=refusal.message)
    if not votes:
        return lr.summarize(target_version, [])
    mode, reason = lr.choose_mode(votes)
    estimates = lr.estimate_fields(votes)  # what the mode was chosen by, in the reply
    if mode == lr.RELOAD:
        return await _reload_everywhere(send, target_version, reason, estimates)
    applied = (await send(APPLY, None)).reports
    if applied and all(r.success for r in applied):
        committed = (await send(COMMIT, None)).reports
        mismatched = lr.check_mismatches(committed)
        if not mismatched:
            return lr.summarize(target_version, **estimates, hosts=lr.merge_hosts(committed))
        # the live weights are not the published bytes on some rank: the sound path, on every rank
        why = f"the check after the live apply did not hold ({mismatched}): every rank reloads the local checkpoint"
        log.error("live apply v%d: %s", target_version, why)
        return await _reload_everywhere(send, target_version, why, estimates, failed_checks=lr.checks_of(committed))
    failure = rank_failures(applied) or "no rank reported its writes"
    log.warning("live apply v%d failed on some rank: %s; every rank rolls back", target_version, failure)
    rolled = (await send(ROLLBACK, failure)).reports
    not_restored = [r for r in rolled if not r.rolled_back]
    if not not_restored:
        return lr.summarize(target_version, **estimates, hosts=lr.merge_hosts(rolled))
    why = (f"live apply failed ({failure}) and {len(not_restored)} rank(s) could not be restored "
           f"({rank_failures(not_restored)}): every rank reloads the local checkpoint")
    log.error("live apply v%d: %s", target_version, why)
    return await _reload_everywhere(send, target_version, why, estimates)


async def _reload_everywhere(send: Callable[[str, Optional[str]], Awaitable[PhaseReplies]], target_version: int,
                             reason: Optional[str], estimates: dict, **summary: Any) -> dict:
    """Every rank reloads the target; if any rank's reload failed, every rank reloads once more.

    A rank whose load failed keeps other weights than the ranks whose load worked (sglang falls
    back to what it held), and the engine would serve two weight sets under one reply. The local
    checkpoint holds only the target now, so the one set every rank can reach is the target:
    the reload is repeated on every rank, once. If it fails again, the reply says that the
    ranks may hold different weights until an update succeeds; a retry of the call reloads
    every rank that does not hold the target (its vote finds nothing to patch live).
    """
    reports = (await send(RELOAD, reason)).reports
    failed = rank_failures(reports)
    if not failed:
        return lr.summarize(target_version, **estimates, **summary, hosts=lr.merge_hosts(reports))
    again = f"{reason}; the reload failed on some rank ({failed}): every rank reloaded once more"
    log.warning("live apply v%d: the reload failed on some rank (%s): every rank reloads once more", target_version, failed)
    reports = (await send(RELOAD, again)).reports
    failed = rank_failures(reports)
    if not failed:
        return lr.summarize(target_version, **estimates, **summary, hosts=lr.merge_hosts(reports))
    message = (f"the reload of v{target_version} failed twice on some rank ({failed}); the ranks whose reload "
               "worked serve the target and the others what their load left, so the engine may serve two weight "
               "sets until an update succeeds: retry the call (it reloads every rank that does not hold the target)")
    log.error("live apply v%d: %s", target_version, message)
    return lr.summarize(target_version, **estimates, **summary, hosts=lr.merge_hosts(reports), message=message)


def new_transaction_id() -> str:
    return f"live-{uuid.uuid4().hex}"
