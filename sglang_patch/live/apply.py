"""One rank's writes in the pause: apply, then commit, roll back, or reload.

``apply`` writes what the rank voted on and keeps the undo log (``patch.scatter_with_undo``);
nothing is committed until every rank of every stage and DP group applied (``transaction``).
``commit`` takes the new version, flushes the cache (on every rank at once) and checks the live
weights (``check``). ``rollback`` writes the undo log back and checks it; a rank that cannot
prove its restore holds an unknown version, and the coordinator makes every rank ``reload``.
Every phase first checks the weights' generation against the one this rank's transaction holds
(``RankTxn.generation``: taken at the vote, moved on by our own writes): another writer of the
weights (a reload, ``reset_tensors``, any of ``compat.WEIGHT_WRITERS``) landing between two phases
(while generation is paused nothing else keeps it out) makes the apply write nothing, the commit
take nothing, and the rollback write no undo log over the other writer's bytes; the rank then
says it is not restored and the coordinator makes every rank reload the target (issue 28, point 2).
State a loader derives from a written parameter (MLA's ``w_kc``/``w_vc``, ``live.mapping.derived``) is
re-derived right after the scatter and again after a restore, from the parameter as it then is.

Test-only switch (environment, read by the scheduler processes): ``WEIGHTSYNC_TEST_FAULT_DIR``:
a file ``live-apply-fault-<rank label with / as _>`` there makes that rank fail once in the
middle of its next scatter, ``live-restore-fault-<rank>`` in the middle of its next restore
(each file is removed when it fires); ``live-reload-fault-<rank>`` makes that rank's next reload
phase fail before it loads anything, as many times as the file says (default once).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from .. import compat
from . import results as lr
from .mapping import derived as live_derived
from .scatter.patch import RestoreFailed, RestoreResult, StagedUpdate, UndoLog, scatter_with_undo
from .version import LiveWeights

log = logging.getLogger(__name__)

FAULT_DIR_ENV = "WEIGHTSYNC_TEST_FAULT_DIR"

# ``check(local_dir, version, patches) -> RankCheck``: the check of the live weights once they
# hold ``version`` (``check.check_after_update`` on this rank)
Check = Callable[[str, int, Iterable], lr.RankCheck]


class InjectedFault(RuntimeError):
    """The test-only fault of ``WEIGHTSYNC_TEST_FAULT_DIR``."""


def fault_file(rank: str, prefix: str = "live-apply-fault-") -> Optional[str]:
    directory = os.environ.get(FAULT_DIR_ENV)
    return os.path.join(directory, prefix + rank.replace("/", "_")) if directory else None


def _fires(path: Optional[str]) -> bool:
    """Whether a counted test fault fires now: the file holds how many more times (default once)."""
    if not path or not os.path.exists(path):
        return False
    with open(path) as f:
        left = int(f.read().strip() or 1) - 1
    if left > 0:
        with open(path, "w") as f:
            f.write(str(left))
    else:
        os.unlink(path)
    return True


@dataclass
class RankTxn:
    """This rank's part of one engine-wide transaction, from its vote to its commit or rollback."""

    id: str
    start: float  # when this rank saw the vote (the pause, as this rank sees it)
    staged: Optional[StagedUpdate] = None
    undo: Optional[UndoLog] = None
    written: int = 0
    scatter_s: float = 0.0
    restore_failure: Optional[str] = None  # why this rank is not restored (it must reload)
    derived: int = 0  # layers whose derived state (live.mapping.derived) the apply re-derived
    before_restore: Optional[Callable[[int, str], None]] = None
    generation: Optional[int] = None  # the weights' generation as this transaction holds them (set at the vote)


class RankWrites:
    """Apply, commit, roll back or reload on one rank (see the module docstring)."""

    def __init__(self, *, host: str, rank: str, scheduler: Any, weights: LiveWeights, check: Check,
                 pause_costs: lr.PauseCosts, derivations: Callable[[], Mapping[str, Any]] = dict) -> None:
        self.host = host
        self.derivations = derivations  # parameter -> its proven derived-state rule (the map's)
        self.rank = rank
        self.scheduler = scheduler
        self.weights = weights
        self.check = check
        self.pause_costs = pause_costs

    def failure(self, message: str, start: float) -> lr.LiveRankReport:
        return lr.LiveRankReport(host=self.host, rank=self.rank, success=False, mode=lr.LIVE, message=message,
                                 pause_s=time.perf_counter() - start)

    def apply(self, staged: Optional[StagedUpdate], txn: RankTxn) -> lr.LiveRankReport:
        """Write ``staged`` (what this rank voted on) and keep the undo log; commit nothing yet."""
        if staged is None:
            return self.failure("this rank voted for no live update", txn.start)
        if txn.generation is None:  # driven without our vote (``state`` always records it): from now on
            txn.generation = self.weights.generation
        moved = self._moved(txn)
        if moved is not None:  # before any write: the staged patch extends bytes the weights no longer hold
            txn.restore_failure = f"not restored: {moved} (nothing was written)"
            return self.failure(f"the weights were written by {moved} after the vote: nothing applied", txn.start)
        txn.staged = staged
        fault = fault_file(self.rank)
        restore_fault = fault_file(self.rank, "live-restore-fault-")

        def before_write(k: int, param: str) -> None:
            if k == len(staged.patches) // 2 and _fires(fault):
                raise InjectedFault(f"injected fault on {self.rank} while writing {param} (patch {k} of {len(staged.patches)})")

        def before_restore(k: int, param: str) -> None:
            if k == len(staged.patches) // 2 and _fires(restore_fault):
                raise InjectedFault(f"injected fault on {self.rank} while restoring {param}")

        txn.before_restore = before_restore
        derivations = self.derivations()
        stale = live_derived.why_stale(derivations, staged.patches)
        if stale is not None:  # before any write
            return self.failure(f"derived state would go stale: {stale}", txn.start)
        t0 = time.perf_counter()
        try:
            txn.undo, txn.written = scatter_with_undo(staged, before_write=before_write, before_restore=before_restore)
            txn.derived = self._rederive(txn, derivations)
        except RestoreFailed as exc:
            txn.restore_failure = exc.result.describe()
            log.error("live apply %s: scatter failed and this rank was not restored: %s", self.rank, exc)
            return self.failure(f"{exc}", txn.start)
        except Exception as exc:
            log.warning("live apply %s: scatter failed, this rank restored: %s", self.rank, exc)
            return self.failure(f"{type(exc).__name__}: {exc}", txn.start)
        txn.scatter_s = time.perf_counter() - t0
        # our own writes: a staging that read the weights meanwhile is voided
        txn.generation = self.weights.written_by_us(txn.generation, f"a live apply of v{staged.to_version}")
        derived = f" and re-derived {txn.derived} layer(s)' w_kc/w_vc" if txn.derived else ""
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=True, mode=lr.LIVE, message=f"patched {txn.written} elements live{derived}",
            weight_version=staged.to_version, elements_scattered=txn.written, pause_s=time.perf_counter() - txn.start,
            scatter_s=txn.scatter_s, stage_s=staged.stage_s, staged_nbytes=staged.nbytes,
        )

    def _rederive(self, txn: RankTxn, derivations: Mapping[str, Any]) -> int:
        """After the scatter: the written parameters' derived state. If that fails, the parameters
        are restored and their state derived again from them (``RestoreFailed`` if not)."""
        try:
            return live_derived.refresh(derivations, txn.staged.patches, txn.staged.fence)
        except Exception as exc:
            result = txn.undo.restore(before_write=txn.before_restore)
            txn.undo = None
            if result.restored:
                why = self._rederive_after_restore(txn, derivations)
                result = RestoreResult(False, (why,)) if why is not None else result
            if not result.restored:
                raise RestoreFailed(result, exc) from exc
            raise

    def _rederive_after_restore(self, txn: RankTxn, derivations: Mapping[str, Any]) -> Optional[str]:
        """Derived state again from the restored parameters: exact, as the derivation is a function of
        its source (no undo log of its own); why not, or None."""
        try:
            if txn.staged is not None:
                live_derived.refresh(derivations, txn.staged.patches, txn.staged.fence)
        except Exception as exc:
            return f"re-deriving w_kc/w_vc failed: {type(exc).__name__}: {exc}"
        return None

    def commit(self, request: Any, txn: RankTxn) -> lr.LiveRankReport:
        """Every rank applied: this rank takes the new version and flushes its cache.

        The flush is here, on every rank at once, not in ``apply``: the TP ranks' schedulers must
        keep identical caches (one rank flushed and another not diverged their batches and took
        the server down after a rollback)."""
        staged = txn.staged
        if staged is None or txn.undo is None:
            return self.failure("this rank applied nothing to commit", txn.start)
        moved = self._moved(txn)
        if moved is not None or not self.weights.take_applied(staged, txn.generation):
            return self._written_before_commit(moved or self.weights.changed_by, txn)
        ok, message = compat.flush_cache_after_weight_update(self.scheduler.weight_updater, request,
                                                             f"patched {txn.written} elements live")
        compat.record_weight_version(self.scheduler.weight_updater, staged.to_version)
        # the written storages still the engine's (each element was read back in the scatter)
        # and a fresh sample against the checkpoint (live.check); a
        # mismatch on any rank makes the coordinator send the reload phase: the transaction stays
        # open until the next vote, as after a rollback
        check = self.check(staged.local_checkpoint_dir, staged.to_version, staged.patches)
        if check is not None and txn.undo.read_back is not None:  # the written elements were compared there
            check = check.with_read_back(txn.undo.read_back.seconds)
        pause_s = time.perf_counter() - txn.start
        self.pause_costs.record_live(txn.written, txn.scatter_s, pause_s)
        log.info("live apply %s: v%d committed, %d elements, pause %.4fs (scatter %.4fs)", self.rank, staged.to_version,
                 txn.written, pause_s, txn.scatter_s)
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=ok, mode=lr.LIVE, message=message,
            weight_version=staged.to_version, elements_scattered=txn.written, pause_s=pause_s,
            scatter_s=txn.scatter_s, stage_s=staged.stage_s, staged_nbytes=staged.nbytes, check=check,
        )

    def rollback(self, txn: RankTxn, reason: str) -> lr.LiveRankReport:
        """Some rank failed: write this rank's undo log back and check it. The staged update is
        kept, so a retry can succeed; a rank that is not restored holds an unknown version."""
        staged = txn.staged
        moved = self._moved(txn)
        if moved is not None and txn.restore_failure is None:
            # the undo log holds the bytes before our apply at our positions: written over another
            # writer's weights it would make a mix of both, and "restored" would be a lie
            txn.undo = None
            txn.restore_failure = f"not restored: the weights were written by {moved} during the transaction"
        if txn.undo is not None:
            result = txn.undo.restore(before_write=txn.before_restore)
            txn.undo = None
            if not result.restored:
                txn.restore_failure = result.describe()
            else:
                why = self._rederive_after_restore(txn, self.derivations())
                txn.restore_failure = f"not restored: {why}" if why is not None else None
            if txn.restore_failure is None and self.weights.restored(txn.generation, staged) is None:
                txn.restore_failure = f"not restored: the weights were written by {self.weights.changed_by} during the restore"
        # The transaction stays open until the next vote: when any rank of the engine was not
        # restored, the coordinator sends every rank (restored or not) the reload phase next.
        if txn.restore_failure is not None:
            self.weights.forget(f"a live apply's restore failed on this rank ({txn.restore_failure})")
            log.error("live apply %s: NOT restored: %s", self.rank, txn.restore_failure)
            return lr.LiveRankReport(
                host=self.host, rank=self.rank, success=False, mode=lr.LIVE, rolled_back=False,
                message=f"live apply failed ({reason}) and this rank was {txn.restore_failure}",
                pause_s=time.perf_counter() - txn.start,
            )
        live = self.weights.live
        log.warning("live apply %s: rolled back%s: %s", self.rank,
                    f" v{staged.to_version} -> v{staged.from_version}" if staged else "", reason)
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=False, mode=lr.LIVE, rolled_back=True,
            message=f"live apply failed, rolled back: {reason}", weight_version=live.version if live else None,
            pause_s=time.perf_counter() - txn.start, stage_s=staged.stage_s if staged else 0.0,
            staged_nbytes=staged.nbytes if staged else 0,
        )

    def _moved(self, txn: RankTxn) -> Optional[str]:
        """What wrote the weights since this transaction last held them (None: nothing did)."""
        if txn.generation is None:
            return "an unknown writer (the vote recorded no generation)"
        return self.weights.moved_since(txn.generation)

    def _written_before_commit(self, moved: str, txn: RankTxn) -> lr.LiveRankReport:
        """Another writer replaced the weights between the apply and the commit: nothing is taken
        (the live version stays what that writer left), and the check reports it could not vouch for
        the target, so every rank reloads it (``transaction``: a failed check)."""
        staged = txn.staged
        txn.undo = None
        why = f"the weights were written by {moved} between the apply and the commit: v{staged.to_version} is not held"
        log.error("live apply %s: %s", self.rank, why)
        check = lr.RankCheck(rank=self.rank, failed=True, detail=why)
        return lr.LiveRankReport(host=self.host, rank=self.rank, success=False, mode=lr.LIVE, message=why,
                                 pause_s=time.perf_counter() - txn.start, check=check)

    def reload(self, request: Any, reason: Optional[str], start: float) -> lr.LiveRankReport:
        """sglang's own reload of the local checkpoint (its hooks keep the live version), checked."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        local = os.path.realpath(request.local_checkpoint_dir)
        if _fires(fault_file(self.rank, "live-reload-fault-")):  # this rank's load fails, its weights stay
            return lr.LiveRankReport(host=self.host, rank=self.rank, success=False, mode=lr.RELOAD, reason=reason,
                                     message=f"injected reload fault on {self.rank}: its weights were not reloaded",
                                     pause_s=time.perf_counter() - start)
        load_format = getattr(self.scheduler.server_args, "load_format", None)
        out = self.scheduler.weight_updater.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(
                model_path=local, load_format=load_format, weight_version=str(request.target_version),
                flush_cache=request.flush_cache,
            )
        )
        live = self.weights.live
        check = self.check(local, request.target_version, ()) if out.success else None
        if check is not None:  # a reload through this route pays its check too: the mode weighs it
            self.pause_costs.record_reload_check(check.check_s)
        if check is not None and lr.check_failed(check):
            # the weights are not known to be the target's bytes (a tensor the dir lacks keeps the
            # old one): they name no version, so the next update reloads instead of patching them;
            # the reply is a failure (live.results.summarize)
            self.weights.forget(f"the check after the reload of v{request.target_version} did not hold: {check.detail}")
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=bool(out.success), mode=lr.RELOAD, reason=reason,
            message=out.message, weight_version=live.version if (out.success and live) else None,
            pause_s=time.perf_counter() - start, check=check,
        )
