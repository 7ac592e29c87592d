"""Outcomes of ``/update_weights_from_pulled``: one report per rank, one reply. No sglang here.

Every TP rank reports what it did (``LiveRankReport``); reports are all-gathered over the TP
group and merged per host, and the DP groups' replies are merged again on the tokenizer side.

Invariants:
- The mode is decided together: ``live`` only if every rank can patch live; one rank's reason
  to reload makes every rank reload (``choose_mode``), so no rank is ever at another version.
- A reply is a success only if every rank succeeded; ``rolled_back`` says every rank was put
  back exactly at the previous version after a failure on any of them.
- ``reason`` is why the call reloaded (None for a live apply), prefixed with the rank that
  could not patch live.
- The mode is chosen by measurement (``PauseCosts``, ``choose_mode``): each rank knows its last
  reload's pause and its scatter cost per element, and votes both estimates for this update;
  the engine goes live only where the live estimate (the slowest rank's) is below the reload
  estimate. The changed-fraction threshold stays as the operator's cap (a staging above it is
  refused on the rank). Both estimates are in the reply, with how the choice was made
  (``mode_choice``).
- The choice keeps measuring both modes (``decide_mode``): an estimate of the mode that keeps
  losing only ages, so the losing mode is probed again once the pauses spent since it was last
  measured pay for the probe many times over (``PROBE_SHARE``), and a reload is probed once when
  none was measured since start-up and the live pauses since add up to a large reload's worth
  (``FIRST_RELOAD_PROBE_AFTER_S``). Without that, one slow live apply followed by a reload made
  every later update reload for the engine's life, and before any reload every update went live
  at any cost.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import msgspec

LIVE = "live"
RELOAD = "reload"
# the reply's error_type when the check of the weights it names did not hold, or could not run
UPDATE_CHECK_FAILED = "update_check_failed"


class MeasureAges(msgspec.Struct, frozen=True):
    """How long ago one rank last measured each mode: the updates of the other mode since (and
    their pauses, seconds); counted from start-up for a mode never measured."""

    live_updates: int = 0
    live_pause_s: float = 0.0
    reload_updates: int = 0
    reload_pause_s: float = 0.0
    # measurements in a row, each after the mode sat unmeasured (a probe), that found it still
    # slower than the other mode's estimate: each doubles what the next probe must be paid by
    live_lost: int = 0
    reload_lost: int = 0


class LiveDecision(msgspec.Struct, frozen=True):
    """One rank's vote before the pause: can it patch live, and if not, why."""

    rank: str
    live: bool
    reason: Optional[str] = None
    error_type: Optional[str] = None  # a refusal (bad request, forbidden): nobody does anything
    http_status: int = 200
    message: str = ""
    elements: int = 0  # what a live apply would write on this rank
    live_estimate_s: Optional[float] = None  # this rank's estimates for this update (PauseCosts)
    reload_estimate_s: Optional[float] = None
    ages: Optional[MeasureAges] = None  # since each mode was last measured (None: no probing on this vote)


class PauseCosts:
    """What one rank measured of its own pauses, for ``choose_mode``. Both estimates are of the
    whole pause as this rank sees it, from the vote to its last phase:

    - reload: the last reload's own time (sglang's ``update_weights_from_disk`` on this rank,
      from either route: its cost does not depend on the version it loads) plus the check that
      follows a reload through our route (its sample is read in the pause) plus the median
      round trip from a vote to the next phase;
    - live: from the last ``WINDOW`` live applies. Where they wrote clearly different numbers
      of elements, a robust line through their whole pauses (Theil-Sen: the median of the
      pairwise slopes, then the median intercept): a 1% apply pays more per element than a 5%
      one (sparser writes, per-tensor costs), so its rate alone overestimated a larger update
      (measured: 0.34 s estimated for a 0.15 s apply, and the engine reloaded at 4x the pause).
      Otherwise (every apply about the same size, as in a steady run) the median fixed part
      (their pause less their writes: the extra phase, the gathers, the cache flush, the check)
      plus this update's elements at the median per-element scatter cost. Medians either way:
      one apply the OS preempted does not swing the choice.

    On a tiny model the fixed part dominates and a reload is often the faster; on a real one the
    scatter and the reload's copy of every tensor do.
    """

    WINDOW = 8
    # a live apply after this many updates of the other mode starts the window afresh: the
    # older pauses describe the machine as it was (a busy spell), and only they kept live losing
    STALE_AFTER = 4
    DISTINCT_SIZES = 1.5  # two applies whose element counts differ by this factor give a slope

    def __init__(self) -> None:
        self._ages = MeasureAges()
        self.reload_s: Optional[float] = None
        self.reload_check_s = 0.0  # the check after our route's last reload
        self._rates: list[float] = []
        self._fixed: list[float] = []
        self._round_trips: list[float] = []
        self._points: list[tuple[int, float]] = []  # (elements, pause_s) of the last live applies

    def _keep(self, window: list[float], value: float) -> None:
        window.append(float(value))
        del window[:-self.WINDOW]

    def record_reload(self, seconds: float) -> None:
        a = self._ages
        stale = a.reload_updates >= self.STALE_AFTER or self.reload_s is None
        self.reload_s = float(seconds)
        live = self.live_estimate(self._points[-1][0]) if self._points else None
        lost = a.reload_lost + 1 if stale and live is not None and self.reload_estimate >= live else 0
        self._ages = MeasureAges(live_updates=a.live_updates + 1, live_pause_s=a.live_pause_s + float(seconds),
                                 live_lost=a.live_lost, reload_lost=lost)

    def record_reload_check(self, seconds: float) -> None:
        self.reload_check_s = float(seconds)

    def record_round_trip(self, seconds: float) -> None:
        self._keep(self._round_trips, seconds)

    def record_live(self, elements: int, scatter_s: float, pause_s: float) -> None:
        a = self._ages
        stale = a.live_updates >= self.STALE_AFTER
        if stale:
            self._rates, self._fixed, self._points = [], [], []
        if elements > 0:
            self._keep(self._rates, scatter_s / elements)
        self._keep(self._fixed, max(0.0, pause_s - scatter_s))
        self._points.append((int(elements), float(pause_s)))
        del self._points[:-self.WINDOW]
        reload = self.reload_estimate
        lost = a.live_lost + 1 if stale and reload is not None and pause_s >= reload else 0
        self._ages = MeasureAges(reload_updates=a.reload_updates + 1, reload_pause_s=a.reload_pause_s + float(pause_s),
                                 live_lost=lost, reload_lost=a.reload_lost)

    @property
    def ages(self) -> MeasureAges:
        """Since each mode was last measured on this rank (the vote carries it: ``decide_mode``)."""
        return self._ages

    def _pause_line(self) -> Optional[tuple[float, float]]:
        """``(fixed, per element)`` of a Theil-Sen line through the recent pauses, or None when
        no two applies differ enough in size to give a slope."""
        slopes = []
        for k, (ei, pi) in enumerate(self._points):
            for ej, pj in self._points[k + 1:]:
                lo, hi = min(ei, ej), max(ei, ej)
                if hi >= self.DISTINCT_SIZES * max(lo, 1):
                    slopes.append((pj - pi) / (ej - ei))
        if not slopes:
            return None
        slope = max(0.0, statistics.median(slopes))
        fixed = max(0.0, statistics.median(p - slope * e for e, p in self._points))
        return fixed, slope

    @property
    def per_element_s(self) -> Optional[float]:
        return statistics.median(self._rates) if self._rates else None

    @property
    def reload_estimate(self) -> Optional[float]:
        if self.reload_s is None:
            return None
        return self.reload_s + self.reload_check_s + (statistics.median(self._round_trips) if self._round_trips else 0.0)

    def live_estimate(self, elements: int) -> Optional[float]:
        line = self._pause_line()
        if line is not None:
            return line[0] + elements * line[1]
        rate = self.per_element_s
        if rate is None:
            return None
        return statistics.median(self._fixed) + elements * rate

    def describe(self) -> dict:
        return {"reload_estimate_s": self.reload_estimate, "scatter_s_per_element": self.per_element_s,
                "live_fixed_s": statistics.median(self._fixed) if self._fixed else None}


class RankCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's check after an update (in the reply, per rank)."""

    rank: str
    verified_elements: int = 0  # compared and equal
    mismatches: int = 0
    sampled_elements: int = 0  # of those compared, drawn from the checkpoint
    scattered_elements: int = 0  # of those compared, written by this live apply
    checked_params: int = 0  # parameters the sample could reach
    not_checkable_params: int = 0  # reload-only, unproven or unmapped: outside the sample
    check_s: float = 0.0  # inside the pause, at commit: the two below together
    scattered_check_s: float = 0.0  # of check_s, the written elements' storages still the engine's (no element read)
    written_read_back_s: float = 0.0  # the written elements read back and compared in the scatter (of scatter_s, not check_s)
    sample_check_s: float = 0.0  # of check_s, the sample (a compare only when prepared at staging)
    sample_prepared_s: float = 0.0  # reading the sample's expected values at staging, while serving
    sample_read_in_pause: bool = False  # no sample was prepared at staging: the pause read the checkpoint
    # of sampled_elements, those that held the target's bytes already at a live apply's staging,
    # verified there while serving (the weights cannot change between then and the pause without
    # voiding the staging, and the scatter reads back what it writes); the pause compares the rest
    sampled_before_pause: int = 0
    sample_before_pause_s: float = 0.0
    detail: str = ""  # the first mismatch, or why nothing was checked
    failed: bool = False  # the check itself raised: nothing is proven, every rank reloads (as after a mismatch)

    def with_read_back(self, seconds: float) -> "RankCheck":
        """This check with the time the scatter spent reading back what it wrote."""
        return msgspec.structs.replace(self, written_read_back_s=seconds)


def check_failed(c: RankCheck) -> bool:
    """A check that did not hold: mismatches found, or the check could not run."""
    return bool(c.mismatches or c.failed)


class _LiveOutcome(msgspec.Struct, kw_only=True):
    """What a rank, or a host's ranks together, did in one call (shared by both levels)."""

    host: str
    success: bool
    mode: str
    reason: Optional[str] = None
    message: str = ""
    weight_version: Optional[int] = None
    elements_scattered: int = 0
    pause_s: float = 0.0
    scatter_s: float = 0.0  # of the pause, the writes themselves (the rest: votes, gathers, cache flush)
    rolled_back: bool = False
    stage_s: float = 0.0
    staged_nbytes: int = 0


class LiveRankReport(_LiveOutcome, kw_only=True):
    rank: str
    check: Optional[RankCheck] = None  # the check after a commit or a reload (live.check)


class LiveHostResult(_LiveOutcome, kw_only=True):
    ranks: list[str]
    checks: list[RankCheck] = msgspec.field(default_factory=list)  # one per rank that checked


def checks_of(items: Sequence["LiveRankReport | LiveHostResult"]) -> list[RankCheck]:
    out: list[RankCheck] = []
    for item in items:
        if isinstance(item, LiveHostResult):
            out.extend(item.checks)
        elif item.check is not None:
            out.append(item.check)
    return out


def check_mismatches(items: Sequence["LiveRankReport | LiveHostResult"]) -> str:
    """Why the check after a commit failed (ranks and their first mismatch, or why their check
    could not run), or "" when it held."""
    return "; ".join(f"{c.rank}: {c.mismatches} mismatch(es), first {c.detail}" if c.mismatches else f"{c.rank}: {c.detail}"
                     for c in checks_of(items) if check_failed(c))


def engine_estimates(decisions: Sequence[LiveDecision]) -> tuple[Optional[float], Optional[float]]:
    """``(live, reload)`` estimates of the engine's pause: the slowest rank's; None where some
    rank has not measured it (or where no rank could go live: nothing to estimate)."""
    def slowest(values: list) -> Optional[float]:
        return None if not values or any(v is None for v in values) else max(values)

    live = [d for d in decisions if d.live]
    return (slowest([d.live_estimate_s for d in live]) if len(live) == len(decisions) else None,
            slowest([d.reload_estimate_s for d in decisions]))


def engine_ages(decisions: Sequence[LiveDecision]) -> Optional[MeasureAges]:
    """Since each mode was last measured on the engine: the most recent rank's count (a rank
    that measured it since says so); None where some rank sent none (no probing then)."""
    ages = [d.ages for d in decisions]
    if not ages or any(a is None for a in ages):
        return None
    return MeasureAges(live_updates=min(a.live_updates for a in ages), live_pause_s=min(a.live_pause_s for a in ages),
                       reload_updates=min(a.reload_updates for a in ages),
                       reload_pause_s=min(a.reload_pause_s for a in ages),
                       live_lost=max(a.live_lost for a in ages), reload_lost=max(a.reload_lost for a in ages))


# The losing mode is probed again once its estimate's excess over the winner's is at most this
# share of the pauses spent since it was last measured, times 2 for each probe in a row that
# found it still slower: a probe costs at most a tenth of the pause time since the last one, the
# probes of a mode that keeps losing come ever rarer (their share halves each time), and a stale
# estimate is still re-measured in bounded time.
PROBE_SHARE = 0.1
PROBE_BACKOFF_LIMIT = 10  # at most 2**10 times the first probe's wait
PROBE_MIN_UPDATES = PauseCosts.STALE_AFTER  # and never sooner than this many updates after its last measurement
# No reload measured since start-up: its cost cannot be guessed from a live apply's, so one is
# probed once a full window of live applies was measured and their pauses add up to
# FIRST_RELOAD_PROBE_AFTER_S: a reload reads and copies every tensor, tens of seconds for the
# largest models, so the probe costs about as much again as the live pauses spent, once per
# engine life; where live applies are cheap it comes late, and could gain little anyway.
FIRST_RELOAD_PROBE_AFTER = PauseCosts.WINDOW
FIRST_RELOAD_PROBE_AFTER_S = 60.0


def decide_mode(decisions: Sequence[LiveDecision]) -> dict:
    """The mode every rank follows, why, and what it was chosen by (the reply's ``mode_choice``).

    Live only when every rank can; then, where both are measured, the faster estimate, unless
    the slower one is due for a probe (``PROBE_SHARE``, ``FIRST_RELOAD_PROBE_AFTER``)."""
    live, reload = engine_estimates(decisions)
    ages = engine_ages(decisions)

    def choice(mode: str, by: str, reason: Optional[str] = None, probe: bool = False) -> dict:
        return {"mode": mode, "reason": reason, "by": by, "probe": probe,
                "live_estimate_s": live, "reload_estimate_s": reload,
                "updates_since_live_measured": ages.live_updates if ages else None,
                "pause_s_since_live_measured": ages.live_pause_s if ages else None,
                "updates_since_reload_measured": ages.reload_updates if ages else None,
                "pause_s_since_reload_measured": ages.reload_pause_s if ages else None,
                "live_probes_lost": ages.live_lost if ages else None,
                "reload_probes_lost": ages.reload_lost if ages else None}

    for d in decisions:
        if not d.live:
            return choice(RELOAD, "vote", f"{d.rank}: {d.reason}")
    if not any(d.elements for d in decisions):
        return choice(LIVE, "nothing to write")  # already serving it
    if reload is None:
        if (ages is not None and live is not None and ages.reload_updates >= FIRST_RELOAD_PROBE_AFTER
                and ages.reload_pause_s >= FIRST_RELOAD_PROBE_AFTER_S):
            return choice(RELOAD, "probe", (
                f"probing a reload's pause: none measured since start-up, {ages.reload_updates} live applies since "
                f"pausing {ages.reload_pause_s:.1f}s in all (live estimated {live:.4f}s)"), probe=True)
        return choice(LIVE, "unmeasured")  # the changed-fraction cap bounds it
    if live is None:
        return choice(LIVE, "unmeasured")
    elements = max(d.elements for d in decisions)
    if live < reload:
        if ages is not None and _probe_due(reload - live, ages.reload_updates, ages.reload_pause_s, ages.reload_lost):
            return choice(RELOAD, "probe", (
                f"probing a reload's pause: last measured {ages.reload_updates} updates ago, estimated {reload:.4f}s "
                f"against live {live:.4f}s"), probe=True)
        return choice(LIVE, "estimate")
    if ages is not None and _probe_due(live - reload, ages.live_updates, ages.live_pause_s, ages.live_lost):
        return choice(LIVE, "probe", probe=True)
    return choice(RELOAD, "estimate", (
        f"a reload is estimated faster: live {live:.4f}s ({elements} changed elements on the busiest "
        f"rank at the measured scatter rate) against {reload:.4f}s (the last reload's pause)"))


def _probe_due(excess_s: float, updates: int, pause_s: float, lost: int) -> bool:
    """Whether the losing mode, estimated ``excess_s`` slower, is probed now that ``updates``
    updates taking ``pause_s`` ran since it was last measured (``lost``: its probes in a row that
    found it still slower)."""
    return updates >= PROBE_MIN_UPDATES and excess_s * 2 ** min(lost, PROBE_BACKOFF_LIMIT) <= PROBE_SHARE * pause_s


def estimate_fields(decisions: Sequence[LiveDecision]) -> dict:
    """The reply's ``live_estimate_s``, ``reload_estimate_s`` and ``mode_choice`` for these votes."""
    live, reload = engine_estimates(decisions)
    return {"live_estimate_s": live, "reload_estimate_s": reload, "mode_choice": decide_mode(decisions)}


def choose_mode(decisions: Sequence[LiveDecision]) -> tuple[str, Optional[str]]:
    """``(mode, reason)`` all ranks follow (``decide_mode``)."""
    c = decide_mode(decisions)
    return c["mode"], c["reason"]


def first_refusal(decisions: Sequence[LiveDecision]) -> Optional[LiveDecision]:
    refused = [d for d in decisions if d.error_type is not None]
    return min(refused, key=lambda d: d.http_status) if refused else None


def merge_hosts(items: Sequence[LiveRankReport | LiveHostResult]) -> list[LiveHostResult]:
    by_host: dict[str, list] = {}
    for item in items:
        by_host.setdefault(item.host, []).append(item)
    out = []
    for host in sorted(by_host):
        group = by_host[host]
        ranks: list[str] = []
        for item in group:
            ranks.extend(item.ranks if isinstance(item, LiveHostResult) else [item.rank])
        failed = [i for i in group if not i.success]
        versions = {i.weight_version for i in group}
        out.append(
            LiveHostResult(
                host=host,
                ranks=sorted(set(ranks)),
                success=not failed and len(versions) == 1,
                mode=RELOAD if any(i.mode == RELOAD for i in group) else LIVE,
                reason=next((i.reason for i in group if i.reason), None),
                message=(failed[0].message if failed else group[0].message),
                weight_version=versions.pop() if len(versions) == 1 else None,
                elements_scattered=sum(i.elements_scattered for i in group),
                pause_s=max(i.pause_s for i in group),
                scatter_s=max(i.scatter_s for i in group),
                rolled_back=any(i.rolled_back for i in group),
                stage_s=max(i.stage_s for i in group),
                staged_nbytes=sum(i.staged_nbytes for i in group),
                checks=checks_of(group),
            )
        )
    return out


def summarize(target_version: int, hosts: Sequence[LiveHostResult], *, error_type: Optional[str] = None,
              http_status: int = 200, message: Optional[str] = None, live_estimate_s: Optional[float] = None,
              reload_estimate_s: Optional[float] = None, failed_checks: Sequence[RankCheck] = (),
              mode_choice: Optional[dict] = None, reloaded_after_check: Optional[bool] = None) -> dict:
    """The reply's fields (see ``UpdateWeightsFromPulledReqOutput``).

    ``failed_checks``: the checks after a live apply that did not hold, which made every rank
    reload (``reloaded_after_check``). A check of the weights the reply names that did not hold
    (the hosts' own: after the final commit or reload) makes the reply a failure, whatever the
    ranks' loads said: it never ends in success (``update_check_failed``, the checks in
    ``failed_checks``). ``reloaded_after_check`` None: whether ``failed_checks`` holds any."""
    hosts = list(hosts)
    unheld = [c for h in hosts for c in h.checks if check_failed(c)]
    reloaded = bool(failed_checks) if reloaded_after_check is None else reloaded_after_check
    earlier = [c for c in failed_checks if check_failed(c) and c not in unheld]  # not counted twice
    ok = (error_type is None and bool(hosts) and not unheld
          and all(h.success and h.weight_version == target_version for h in hosts))
    mode = RELOAD if any(h.mode == RELOAD for h in hosts) else LIVE
    reason = next((h.reason for h in hosts if h.reason), None)
    versions = {h.weight_version for h in hosts}
    rolled_back = bool(hosts) and any(h.rolled_back for h in hosts)
    if message is None:
        if ok:
            how = "patched live" if mode == LIVE else f"reloaded from the local checkpoint ({reason})"
            message = f"v{target_version} is served on {len(hosts)} host(s): {how}"
        elif not hosts:
            message = "no scheduler rank answered"
        elif unheld and error_type is None and all(h.success and h.weight_version == target_version for h in hosts):
            details = "; ".join(f"{c.rank}: {c.mismatches} mismatch(es), first {c.detail}" if c.mismatches else
                                f"{c.rank}: {c.detail}" for c in unheld)
            message = (f"v{target_version} was {'patched live' if mode == LIVE else 'reloaded'} but the check of the "
                       f"live weights against the local checkpoint did not hold ({details}): the engine may serve "
                       f"weights of no published version until an update succeeds. Check the local checkpoint "
                       f"against the published version (weightsync verify), republish it complete if a tensor is "
                       f"missing or damaged, then pull and update again")
            error_type, http_status = UPDATE_CHECK_FAILED, 500
        else:
            failed = [h for h in hosts if not (h.success and h.weight_version == target_version)]
            details = "; ".join(f"{h.host}: {h.message}" for h in failed)
            message = f"update to v{target_version} failed on {len(failed)} of {len(hosts)} host(s): {details}"
            if rolled_back:
                message += " (every rank was restored to the previous version)"
    if not ok and error_type is None:
        error_type, http_status = ((UPDATE_CHECK_FAILED, 500) if unheld else ("internal_error", 500))
    return dict(
        success=ok,
        mode=mode,
        reason=reason,
        message=message,
        error_type=error_type,
        http_status=http_status if not ok else 200,
        target_version=target_version,
        weight_version=versions.pop() if len(versions) == 1 else None,
        elements_scattered=sum(h.elements_scattered for h in hosts),
        pause_s=max((h.pause_s for h in hosts), default=0.0),
        rolled_back=rolled_back,
        hosts=hosts,
        live_estimate_s=live_estimate_s,
        reload_estimate_s=reload_estimate_s,
        mode_choice=mode_choice,
        # the check after the update (live.check), every rank of every host together
        verified_elements=sum(c.verified_elements for h in hosts for c in h.checks),
        mismatches=sum(c.mismatches for h in hosts for c in h.checks) + sum(c.mismatches for c in earlier),
        not_checkable_params=sum(c.not_checkable_params for h in hosts for c in h.checks),
        # the checks after a live apply that found mismatches, which made every rank reload
        reloaded_after_check=reloaded,
        # every check that did not hold: those that made every rank reload, then the final ones
        failed_checks=earlier + unheld,
    )


def merge_replies(target_version: int, replies: Sequence[dict]) -> dict:
    """One reply from the DP groups' replies; a refusal (4xx) of any group is the reply."""
    for r in replies:
        if r.get("error_type") not in (None, "internal_error", UPDATE_CHECK_FAILED) and not r.get("hosts"):
            return dict(r)
    hosts = merge_hosts([h for r in replies for h in r.get("hosts", [])])
    failed = [r for r in replies if not r.get("success")]
    if failed and not hosts:
        return dict(failed[0])
    return summarize(target_version, hosts, failed_checks=[c for r in replies for c in r.get("failed_checks", ())],
                     reloaded_after_check=any(r.get("reloaded_after_check") for r in replies),
                     mode_choice=next((r["mode_choice"] for r in replies if r.get("mode_choice")), None))
