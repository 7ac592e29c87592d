"""Driving rollout engines to a published version: the engine half of every sync (no torch here).

Role: whatever publishes (the Megatron updater, a plain PyTorch trainer), the engines are driven
the same way, by ``EngineSync`` on one trainer process:

    post-write hook -> pull_weights(v) on every engine at once, while they keep generating ->
    pause_generation -> apply v -> continue_generation (always, once paused)

Applying v (``--update-weight-apply``, one registry ``APPLY_MODES``):
- ``auto`` (default): ``/update_weights_from_pulled`` (live apply of the changed elements; the
  engine itself falls back to a full reload and says ``mode: "reload"`` with the reason when live
  apply is impossible). An engine whose live call fails is reloaded with
  ``/update_weights_from_disk`` in the same pause; one without the route (HTTP 404: an older
  engine) is remembered and reloaded directly from then on.
- ``live``: the same, but the live route is tried on every sync, and each fallback is a warning.
- ``reload``: ``/update_weights_from_disk`` only (the engine re-reads every tensor).
Either call flushes the cache itself (once per sync), except with pause mode ``in_place``, which
keeps the KV cache on purpose.

Where the fleet stands: ``EngineSync.served`` maps every engine to the version it serves (set
when it applied one; asked with ``GET /model_info`` after a failure; None while unknown). When
one engine's apply fails and the others succeed, the others serve vN and it serves vN-1, all of
them generate again, and the ``EngineSyncError`` (and ``SyncMetrics.served``) says so. The next
sync first brings the lagging engines up to vN (only they pause), then every engine to the new
version: the fleet never stays split for more than one sync.

The baseline: at start ``pull_weights(0)`` goes to every engine without waiting, so the local
copy of the seed overlaps the first rollout. It is only a head start: a failed baseline is
logged and the sync goes on (the first pull seeds by itself).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

from weightsync.hooks import load_callable

from .engines import (
    EngineCallError,
    EngineGroup,
    EngineSyncError,
    EngineTimeouts,
    RayEngineGroup,
    SGLangEngineClient,
    ThreadEngineGroup,
)

log = logging.getLogger(__name__)

APPLY_AUTO, APPLY_LIVE, APPLY_RELOAD = "auto", "live", "reload"
APPLY_MODES = (APPLY_AUTO, APPLY_LIVE, APPLY_RELOAD)
LIVE_CALL, RELOAD_CALL = "update_weights_from_pulled", "update_weights_from_disk"


@dataclass
class SyncMetrics:
    """What one sync cost and changed; returned to the caller and logged."""

    version: int
    kind: str = ""
    reason: str = ""
    encoding: str = ""  # a delta's encoding ("" for a full version)
    changed_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    full_nbytes: int = 0
    wire_nbytes: int = 0
    gather_s: float = 0.0
    encode_s: float = 0.0
    publish_s: float = 0.0
    publish_attempts: int = 0
    hook_s: float = 0.0
    baseline_wait_s: float = 0.0
    pull_s: float = 0.0
    pause_s: float = 0.0  # generation paused -> resumed, as the trainer saw it
    apply_s: float = 0.0  # the weight-apply call(s) inside the pause (live or reload)
    apply_mode: str = ""  # "live", "reload" or "mixed" (engines differed)
    elements_scattered: int = 0  # by live applies, summed over engines
    total_s: float = 0.0
    staging_nbytes: int = 0
    snapshot_nbytes: int = 0
    d2h_nbytes: int = 0  # device -> host bytes of the staging (CUDA: changed elements only)
    pulls: list = field(default_factory=list)
    applies: list = field(default_factory=list)  # per engine: mode, call, reason, elements, engine pause
    served: dict = field(default_factory=dict)  # engine -> the version it serves after this sync (None: unknown)
    caught_up: dict = field(default_factory=dict)  # lagging engine -> the version it was first brought up to
    baseline_errors: dict = field(default_factory=dict)  # engine -> why its pull_weights(0) failed

    @property
    def changed_fraction_bytes(self) -> float:
        return self.changed_bytes / self.full_nbytes if self.full_nbytes else 0.0

    @property
    def changed_fraction_elements(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["changed_fraction_bytes"] = self.changed_fraction_bytes
        d["changed_fraction_elements"] = self.changed_fraction_elements
        return d

    def summary(self) -> str:
        kind = f"{self.kind} {self.encoding}" if self.encoding else self.kind
        return (f"v{self.version} {kind} ({self.reason}): changed {self.changed_fraction_bytes:.2%} of bytes, "
                f"{self.changed_fraction_elements:.2%} of elements; wire {self.wire_nbytes} B of {self.full_nbytes} B "
                f"full; gather {self.gather_s:.2f}s encode {self.encode_s:.2f}s publish {self.publish_s:.2f}s "
                f"pull {self.pull_s:.2f}s pause {self.pause_s:.2f}s ({self.apply_mode or 'no apply'}, "
                f"{self.elements_scattered} elements scattered)")


# The syncs whose own metrics a trainer keeps (``SyncHistory``): at 64 engines one sync's metrics
# are some 50 KiB (per-engine pulls, applies, versions), so keeping every sync of a long run would
# take GiB on every rank. Older syncs live on only in ``SyncTotals``.
DEFAULT_HISTORY_SIZE = 100


@dataclass
class SyncTotals:
    """Sums and counts over every sync a ``SyncHistory`` recorded, including those its ring dropped."""

    syncs: int = 0
    first_version: int | None = None
    last_version: int | None = None
    kinds: dict = field(default_factory=dict)  # "full" / "delta" -> syncs
    apply_modes: dict = field(default_factory=dict)  # "live" / "reload" / "mixed" / "" (no engines) -> syncs
    publish_attempts: int = 0
    wire_nbytes: int = 0
    full_nbytes: int = 0
    changed_bytes: int = 0
    elements_scattered: int = 0
    syncs_with_lagging_engines: int = 0  # a sync that first brought engines left behind up
    gather_s: float = 0.0
    encode_s: float = 0.0
    publish_s: float = 0.0
    pull_s: float = 0.0
    pause_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    max_pause_s: float = 0.0
    max_total_s: float = 0.0

    def add(self, m: "SyncMetrics") -> None:
        self.syncs += 1
        if self.first_version is None:
            self.first_version = m.version
        self.last_version = m.version
        self.kinds[m.kind] = self.kinds.get(m.kind, 0) + 1
        self.apply_modes[m.apply_mode] = self.apply_modes.get(m.apply_mode, 0) + 1
        self.publish_attempts += m.publish_attempts
        self.wire_nbytes += m.wire_nbytes
        self.full_nbytes += m.full_nbytes
        self.changed_bytes += m.changed_bytes
        self.elements_scattered += m.elements_scattered
        self.syncs_with_lagging_engines += bool(m.caught_up)
        for name in ("gather_s", "encode_s", "publish_s", "pull_s", "pause_s", "apply_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(m, name))
        self.max_pause_s = max(self.max_pause_s, m.pause_s)
        self.max_total_s = max(self.max_total_s, m.total_s)


class SyncHistory:
    """The metrics of the last ``size`` syncs, oldest first (a ring), and ``totals`` over all of them.

    Indexing and iteration see the ring only: ``history[-1]`` is the newest sync, ``len(history)``
    stops growing at ``size``; ``totals.syncs`` counts every sync recorded.
    """

    def __init__(self, size: int = DEFAULT_HISTORY_SIZE):
        if size < 1:
            raise ValueError(f"a sync history keeps at least one sync, got size {size}")
        self.size = size
        self._ring: deque[SyncMetrics] = deque(maxlen=size)
        self.totals = SyncTotals()

    def append(self, m: "SyncMetrics") -> None:
        self._ring.append(m)
        self.totals.add(m)

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator["SyncMetrics"]:
        return iter(self._ring)

    def __reversed__(self) -> Iterator["SyncMetrics"]:
        return reversed(self._ring)

    def __getitem__(self, index):
        return list(self._ring)[index] if isinstance(index, slice) else self._ring[index]


def engine_phase_bound_s(timeouts: EngineTimeouts) -> float:
    """The longest ``EngineSync.update`` can last under ``timeouts``, counting every call it can make
    (the post-write hook aside: it is the caller's code), each reply within its timeout:

    - one ``pull_weights`` call of the client: retries of "source not ready" start until
      ``not_ready_retry_s`` after the first attempt, retries of a pull to the same target still
      running until ``pull_timeout_s`` after it, and the last attempt may take ``pull_timeout_s``:
      P = max(not_ready_retry_s, pull_timeout_s) + pull_timeout_s;
    - one drive (``_drive``): the pull, then at most five control calls in a row (pause, the live
      apply, the reload after it failed, ``GET /model_info`` after the reload failed, continue):
      P + 5 E;
    - ``update``: the baseline ``pull_weights(0)`` the first sync waits for (P), the catch-up of
      engines a failed sync left behind (a drive), then the drive to the version: 3 P + 10 E.
    """
    # (A backoff sleep is taken only when the attempt after it starts within the retry limit.)
    pull = max(timeouts.not_ready_retry_s, timeouts.pull_timeout_s) + timeouts.pull_timeout_s
    return 3 * pull + 10 * timeouts.engine_timeout_s


def load_hook(path: str | Callable | None) -> Callable | None:
    return load_callable(path, what="--custom-update-weight-post-write-path", error=ValueError)


class EngineSync:
    """The engine side of a sync, run by one trainer process (rank 0).

    Args:
        engines: an ``EngineGroup`` (Ray actor handles or HTTP clients).
        source_dir: the run's source dir (holding ``weight_vNNNNNN/``).
        local_checkpoint_dir: the host-local checkpoint dir on every engine host.
        pause_mode: sglang's pause mode; ``in_place`` keeps the KV cache, so no flush.
        apply_mode: ``auto``, ``live`` or ``reload`` (see the module docstring).
        post_write_hook: called ``hook(args, version_dir, rollout_engines)`` before the pulls.
        hook_args: the ``args`` passed to the hook; rollout_engines: what the hook gets as engines.
        owns_engines: ``close`` also closes the group (True when this side built it).
    """

    def __init__(self, engines: EngineGroup, *, source_dir: str, local_checkpoint_dir: str,
                 pause_mode: str = "retract", apply_mode: str = APPLY_AUTO,
                 post_write_hook: str | Callable | None = None, hook_args: Any = None,
                 rollout_engines: Any = None, owns_engines: bool = False):
        if apply_mode not in APPLY_MODES:
            raise ValueError(f"apply mode {apply_mode!r} is not one of {', '.join(APPLY_MODES)}")
        self.engines = engines
        self.source_dir = source_dir
        self.local_checkpoint_dir = local_checkpoint_dir
        self.pause_mode = pause_mode
        self.apply_mode = apply_mode
        self.hook = load_hook(post_write_hook)
        self.hook_args = hook_args
        self.rollout_engines = rollout_engines if rollout_engines is not None else engines
        self.owns_engines = owns_engines
        self._baseline = None
        self.baseline_results: list | None = None
        self.baseline_errors: dict[str, str] = {}
        self._no_live_route: dict[str, str] = {}  # engine -> why it is reloaded directly (auto)
        self.served: dict[str, int | None] = {name: None for name in engines.names}
        self.newest: int | None = None  # the newest version some engine was brought to
        self._pulled: dict[str, int] = {}  # engine -> the version its local checkpoint holds, by its last pull

    # --- the baseline ---------------------------------------------------------------------

    def start_baseline(self) -> None:
        """Send ``pull_weights(0)`` to every engine without waiting (overlaps the first rollout)."""
        log.info("baseline: asking %d engine(s) to reset their local checkpoint to version 0", len(self.engines.names))
        self._baseline = self.engines.submit("pull_weights", self.local_checkpoint_dir, self.source_dir, 0)

    def finish_baseline(self) -> list | None:
        """Wait for the baseline pulls; a failure is logged, never raised (None: none pending)."""
        if self._baseline is None:
            return None
        pending, self._baseline = self._baseline, None
        outcomes = self.engines.settle(pending)
        self.baseline_errors = {self.engines.names[i]: str(err)
                                for i, (_, err) in zip(pending.indices, outcomes) if err is not None}
        if self.baseline_errors:
            log.warning("baseline pull_weights(0) failed on %d engine(s), going on (the first pull seeds by "
                        "itself): %s", len(self.baseline_errors), "; ".join(self.baseline_errors.values()))
        self.baseline_results = [result for result, _ in outcomes]
        return self.baseline_results

    # --- a sync ---------------------------------------------------------------------------

    def update(self, version: int, version_dir: str, metrics: SyncMetrics) -> SyncMetrics:
        """Hook -> (lagging engines up first) -> pull everywhere -> pause -> apply -> continue.

        Raises:
            EngineSyncError: some engine failed a call; its ``served`` says which version every
                engine serves now, ``metrics`` is this sync's.
        """
        t0 = time.perf_counter()
        self.finish_baseline()
        metrics.baseline_wait_s = time.perf_counter() - t0
        metrics.baseline_errors = dict(self.baseline_errors)
        if self.hook is not None:
            t = time.perf_counter()
            self.hook(self.hook_args, version_dir, self.rollout_engines)
            metrics.hook_s = time.perf_counter() - t
        self._catch_up(version, metrics)
        try:
            self._drive(list(range(len(self.engines.names))), version, metrics)
        except EngineSyncError as e:
            e.served, e.version, e.metrics = dict(self.served), version, metrics
            raise
        finally:
            metrics.served = dict(self.served)
        return metrics

    def lagging(self) -> list[str]:
        """Engines known to serve an older version than the newest one some engine serves, or
        whose version is unknown since a sync failed on them."""
        if self.newest is None:
            return []
        return [name for name, v in self.served.items() if v is None or v < self.newest]

    def _catch_up(self, version: int, metrics: SyncMetrics) -> None:
        """Bring the engines a failed sync left behind to the newest version the others serve,
        before the whole fleet moves on (only they pause). A failure here is logged: the sync
        that follows includes them anyway."""
        newest = self.newest
        if newest is None or newest >= version:
            return
        # One whose local checkpoint already went past it (it pulled a later version whose
        # apply failed) cannot pull it again: the sync to the new version brings it up.
        names = [n for n in self.lagging() if self._pulled.get(n, -1) <= newest]
        if not names:
            return
        log.warning("engines %s lag behind v%d (serving %s): bringing them up first", names, newest,
                    {n: self.served[n] for n in names})
        indices = [self.engines.names.index(n) for n in names]
        try:
            self._drive(indices, newest, SyncMetrics(version=newest, reason="lagging engines brought up"))
            metrics.caught_up = {n: newest for n in names}
        except EngineSyncError as e:
            log.warning("bringing %s up to v%d failed; the sync to v%d includes them: %s", names, newest, version, e)

    def _drive(self, indices: list[int], version: int, metrics: SyncMetrics) -> None:
        """Pull -> pause -> apply -> continue on the engines at ``indices``, timing each part."""
        t = time.perf_counter()
        names = [self.engines.names[i] for i in indices]
        try:
            pulls = self.engines.wait(self.engines.submit_to(
                indices, "pull_weights", self.local_checkpoint_dir, self.source_dir, version))
        except EngineSyncError:
            self._ask_served(indices)  # nothing was applied: each serves what it did
            raise
        metrics.pull_s = time.perf_counter() - t
        metrics.pulls = [_pull_summary(name, r) for name, r in zip(names, pulls)]
        self._pulled.update({name: version for name in names})
        t_pause = time.perf_counter()
        failure: BaseException | None = None
        try:
            self.engines.wait(self.engines.submit_to(indices, "pause_generation", self.pause_mode))
            t = time.perf_counter()
            metrics.applies = self.apply(version, indices)
            metrics.apply_s = time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - re-raised below, after resuming
            failure = e
        # Resume every engine even after a failed pause or reload: some may have paused, sglang
        # restores the old weights when a reload fails, and a paused engine stalls the rollout.
        try:
            self.engines.wait(self.engines.submit_to(indices, "continue_generation"))
        except BaseException:
            if failure is None:
                raise
            log.exception("continue_generation also failed after: %s", failure)
        metrics.pause_s = time.perf_counter() - t_pause
        if failure is not None:
            if isinstance(failure, EngineSyncError) and failure.call != RELOAD_CALL:
                self._ask_served([i for i in indices if self.served[self.engines.names[i]] != version])
            raise failure
        modes = {a["mode"] for a in metrics.applies}
        metrics.apply_mode = modes.pop() if len(modes) == 1 else "mixed"
        metrics.elements_scattered = sum(a["elements_scattered"] for a in metrics.applies)

    def apply(self, version: int, indices: list[int] | None = None) -> list[dict]:
        """Apply ``version`` (already pulled) on every paused engine (or those at ``indices``);
        one outcome per engine. Each engine that applied it serves it from then on.

        Raises:
            EngineSyncError: some engine could apply it neither live nor by a reload (the
                others did; ``served`` has every engine's version).
        """
        names = self.engines.names
        indices = list(range(len(names))) if indices is None else list(indices)
        flush = self.pause_mode != "in_place"
        outcomes: dict[int, dict] = {}
        reload_why: dict[int, str] = {}
        live: list[int] = []
        for i in indices:
            name = names[i]
            if self.apply_mode == APPLY_RELOAD:
                reload_why[i] = "--update-weight-apply reload"
            elif name in self._no_live_route:
                reload_why[i] = self._no_live_route[name]
            else:
                live.append(i)
        if live:
            replies = self.engines.settle(self.engines.submit_to(
                live, LIVE_CALL, self.local_checkpoint_dir, version, flush))
            for i, (reply, err) in zip(live, replies):
                problem = _live_reply_problem(reply, version) if err is None else str(err)
                if problem is None:
                    outcomes[i] = _live_outcome(names[i], reply)
                    self._record_served(names[i], version)
                    continue
                if _is_missing_route(err) and self.apply_mode == APPLY_AUTO:
                    self._no_live_route[names[i]] = f"engine has no /{LIVE_CALL} (an older engine): reloading"
                    log.warning("engine %s has no /%s; reloading it from the local checkpoint from now on",
                                names[i], LIVE_CALL)
                else:
                    log.warning("engine %s: live apply of v%d failed, reloading it instead: %s",
                                names[i], version, problem)
                reload_why[i] = f"live apply failed, reloaded instead: {problem}"
        if reload_why:
            reloading = sorted(reload_why)
            t = time.perf_counter()
            replies = self.engines.settle(self.engines.submit_to(
                reloading, RELOAD_CALL, self.local_checkpoint_dir, str(version), flush))
            seconds = time.perf_counter() - t
            errors: dict[str, BaseException] = {}
            for i, (_, err) in zip(reloading, replies):
                if err is not None:
                    errors[names[i]] = err
                    continue
                outcomes[i] = dict(engine=names[i], mode="reload", call=RELOAD_CALL, reason=reload_why[i],
                                   elements_scattered=0, engine_pause_s=None, call_s=seconds)
                self._record_served(names[i], version)
            if errors:
                # sglang keeps the old weights when a reload fails; the engine says which.
                self._ask_served([names.index(n) for n in errors])
                raise EngineSyncError(RELOAD_CALL, errors, served=self.served, version=version)
        return [outcomes[i] for i in indices]

    def _record_served(self, name: str, version: int) -> None:
        self.served[name] = version
        self.newest = version if self.newest is None else max(self.newest, version)

    def _ask_served(self, indices: list[int]) -> None:
        """After a failure: each engine's own word on the version it serves (None if it cannot say)."""
        if not indices:
            return
        for i, (reply, err) in zip(indices, self.engines.settle(self.engines.submit_to(indices, "weight_version"))):
            self.served[self.engines.names[i]] = _as_version(reply) if err is None else None

    def close(self) -> None:
        if self.owns_engines:
            self.engines.close()


def _as_version(reply: Any) -> int | None:
    """An engine's ``weight_version`` as a version number (None: not one, e.g. "default")."""
    try:
        return int(str(reply))
    except (TypeError, ValueError):
        return None


def _is_missing_route(err: BaseException | None) -> bool:
    if isinstance(err, EngineCallError):
        return err.is_missing_route
    return isinstance(err, AttributeError)  # a Ray engine actor without the method


def _live_reply_problem(reply: Any, version: int) -> str | None:
    """Why a 200 reply of the live route cannot be taken as "the engine serves ``version``"."""
    if not isinstance(reply, dict) or reply.get("success") is not True:
        return f"unexpected reply {reply!r:.200}"
    if reply.get("mode") not in ("live", "reload"):
        return f"reply has mode {reply.get('mode')!r}, expected 'live' or 'reload'"
    served = reply.get("weight_version")
    if served is not None and str(served) != str(version):
        return f"engine reports weight version {served!r} after applying v{version}"
    return None


def _live_outcome(name: str, reply: dict) -> dict:
    return dict(engine=name, mode=reply["mode"], call=LIVE_CALL, reason=reply.get("reason") or "",
                elements_scattered=int(reply.get("elements_scattered") or 0),
                engine_pause_s=reply.get("pause_s"), call_s=None)


def _pull_summary(name: str, result: Any) -> dict:
    """One engine's pull reply, reduced to what the metrics need (per-host actions kept)."""
    if not isinstance(result, dict):
        return {"engine": name, "result": result}
    hosts = result.get("hosts") or []
    return {
        "engine": name,
        "applied_version": result.get("applied_version"),
        "seconds": result.get("seconds"),
        "actions": [h.get("action") for h in hosts] or [result.get("action")],
        "nbytes_read": sum(int(h.get("nbytes_read") or 0) for h in hosts) or int(result.get("nbytes_read") or 0),
        "message": result.get("message"),
    }


def as_engine_group(engines: Any, names: Sequence[str] | None = None,
                    timeouts: EngineTimeouts | None = None) -> tuple[EngineGroup, bool]:
    """(group, built here) from an EngineGroup, a list of Ray actor handles, HTTP clients or URLs.

    With ``timeouts`` (the trainer's flags), every engine's client takes them, whoever built it:
    clients are built from URLs with them, clients and actors passed in are set to them (an
    engine object or actor without ``set_timeouts`` keeps its own, with a warning naming it).
    Without ``timeouts``, each keeps its own.
    """
    if hasattr(engines, "submit_to") and hasattr(engines, "settle"):
        group, owned = engines, False
    else:
        engines = list(engines)
        if engines and all(isinstance(e, str) for e in engines):
            engines = [SGLangEngineClient(url, name=name, **(timeouts or EngineTimeouts()).client_kwargs())
                       for url, name in zip(engines, names or [None] * len(engines))]
        if engines and all(hasattr(e, "pull_weights") and not hasattr(getattr(e, "pull_weights"), "remote")
                           for e in engines):
            group, owned = ThreadEngineGroup(engines), True
        else:
            group, owned = RayEngineGroup(engines, names), True
    if timeouts is not None:
        _set_timeouts(group, timeouts)
    return group, owned


def _set_timeouts(group: EngineGroup, timeouts: EngineTimeouts) -> None:
    setter = getattr(group, "set_timeouts", None)
    unable = list(group.names) if setter is None else setter(timeouts)
    if unable:
        # Not fatal: the other ranks' wait does not depend on these timeouts (a heartbeat), but
        # an explicit --update-weight-engine-wait-timeout-s was checked against them.
        log.warning("engines %s cannot take the timeout flags (%s): no set_timeouts (not an SGLangEngineClient "
                    "or make_engine_actor_class actor); their calls keep timeouts of their own", unable, timeouts)
    log.info("engine clients of %s use %s", ", ".join(n for n in group.names if n not in unable), timeouts)


__all__ = ["APPLY_MODES", "DEFAULT_HISTORY_SIZE", "EngineSync", "SyncHistory", "SyncMetrics", "SyncTotals",
           "as_engine_group", "engine_phase_bound_s"]
