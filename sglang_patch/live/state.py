"""Live apply on one scheduler rank: the parts, put together, and the pause's phases.

Per scheduler rank, one ``LiveApplyState`` (on ``scheduler._weightsync_live``, made by the glue
in ``sglang_patch.live_hooks``). It owns no logic of its own beyond routing; each part is a
module:

- ``version.LiveWeights``: what the live weights hold (the live version and its identity), their
  generation, and the staged slot; the reload witness.
- ``proof.MapProof``: the coordinate map and its proof against the live weights.
- ``staging.Staging``: the update staged while serving, from the verified local checkpoint.
- ``apply.RankWrites``: in the pause, apply with an undo log, then commit, roll back or reload.
- ``check``: each update checked from the live weights; ``results.PauseCosts``: the mode.

The pause is one transaction for the whole engine (``transaction``): the tokenizer sends
``vote``, then ``apply`` and ``commit`` or ``rollback`` (or ``reload``) to every DP group;
``handle_update`` runs each phase on every TP rank at the same loop iteration (sglang broadcasts
the request), all-gathers the stage's items, and stage 0's entry rank replies once every pipeline
stage posted its items through the store (``StageGather``). The work that must not stall the
loop (the undo log, casts, the proof) runs on the scheduler thread between iterations
(``loop_slices``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import weightsync.puller.positions as positions
from weightsync.errors import InvalidRequestError, PathNotAllowedError

from ..paths import ALLOWED_ROOTS_FLAG
from . import check as live_check
from . import results as lr
from . import transaction as tx
from .apply import RankTxn, RankWrites
from .identity import LiveVersion, is_serving, key_of_held
from .loop_slices import LoopSlices, drain
from .mapping import scope as live_scope
from .mapping.coordinate_map import CoordinateMap
from .proof import MapProof
from .scatter.device import pause_fence_for
from .scatter.patch import StagedUpdate, one_intra_op_thread
from .staging import Stager, Staging
from .version import LiveWeights

log = logging.getLogger(__name__)


def digest_params(model: Any, names: Optional[list] = None) -> dict[str, str]:
    """blake2b of every parameter's bytes (name order)."""
    import torch

    out = {}
    for name, p in sorted(model.named_parameters()):
        if names and name not in names:
            continue
        t = p.detach().reshape(-1).cpu().contiguous()
        out[name] = hashlib.blake2b(t.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    return out


class LiveApplyState:
    """One scheduler rank's live apply (see the module docstring)."""

    def __init__(self, *, scheduler: Any, group: Any, host: str, rank: str, seed_dir: Optional[str],
                 allowed_roots: tuple, max_changed_fraction: float, gather: Optional[tx.StageGather] = None,
                 scope: Optional[live_scope.EngineScope] = None,
                 pull_is_running: Callable[[], bool] = lambda: False) -> None:
        self.scheduler = scheduler
        self.group = group
        self.host = host
        self.rank = rank
        self.allowed_roots = allowed_roots
        # one phase's items of every pipeline stage, to stage 0's entry rank (live.transaction)
        self.gather = gather or tx.StageGather(pp_rank=0, pp_size=1, leader=True, channel=None, send=lambda o, r: None)
        self.pause_costs = lr.PauseCosts()  # what the mode is chosen by
        # staging's engine half and the proof (see loop_slices)
        self.loop = LoopSlices(around_slice=one_intra_op_thread, is_idle=lambda: _engine_is_idle(scheduler))
        self.weights = LiveWeights(rank=rank, seed_dir=seed_dir, pull_is_running=pull_is_running)
        self.proof = MapProof(rank=rank, weights=self.weights, model=lambda: self.model, params=self.params,
                              run_steps=self.run_steps, scope=scope)
        self.checker = live_check.UpdateChecker()  # the check after each update: prepared at staging
        self.staging = Staging(rank=rank, weights=self.weights, proof=self.proof, loop=self.loop,
                               model=lambda: self.model, params=self.params, run_steps=self.run_steps,
                               max_changed_fraction=max_changed_fraction, scope=scope,
                               make_fence=lambda: pause_fence_for(self.params(), scheduler),
                               prepare_check=lambda staged: self.checker.prepare_steps(self, staged))
        self.writes = RankWrites(host=host, rank=rank, scheduler=scheduler, weights=self.weights,
                                 pause_costs=self.pause_costs, check=self._check, derivations=self._derivations)
        self._voted: Optional[StagedUpdate] = None
        self._txn: Optional[RankTxn] = None
        # (transaction, phases seen): every rank of every stage sees one transaction's phases in the
        # same order, so the count names the round in the stage-gather key (a repeated reload is a
        # round of its own: a stage's late report of the first can never count for the second)
        self._rounds: tuple[str, int] = ("", 0)

    # --- what the other parts read ---------------------------------------------------------------

    @property
    def model(self):
        return self.scheduler.tp_worker.model_runner.model

    def params(self) -> dict:
        return {name: p.data for name, p in self.model.named_parameters()}

    @property
    def live(self) -> Optional[LiveVersion]:
        return self.weights.live

    @property
    def cmap(self) -> Optional[CoordinateMap]:
        return self.proof.cmap

    def pull_is_running(self) -> bool:
        return self.weights.pull_is_running()

    def _derivations(self) -> dict:
        return self.cmap.derivations if self.cmap is not None else {}

    def _check(self, local_dir: str, version: int, patches) -> lr.RankCheck:
        return self.checker.after_update(self, local_dir, version, patches)

    # --- events from sglang (the glue's hooks) ---------------------------------------------------

    def begin_reload(self, model_path: Optional[str]) -> None:
        self.weights.begin_reload(model_path)

    def after_reload(self, model_path: Optional[str], success: bool) -> None:
        reload_s = self.weights.after_reload(model_path, success)
        if reload_s is not None:
            self.pause_costs.record_reload(reload_s)
        self.proof.prove_after_reload(model_path)

    def after_other_update(self, how: str) -> None:
        self.weights.after_other_update(how)

    def ensure_map_started(self) -> None:
        self.proof.ensure_started()

    def stage_after_pull(self, local_dir: str, source_dir: str, target_version: int, stager: Stager) -> None:
        self.staging.stage_after_pull(local_dir, source_dir, target_version, stager)

    def run_steps(self, steps: Iterator[None], timeout_s: float) -> tuple[object, str]:
        """Run ``steps`` on the scheduler thread between its loop iterations once a loop drives
        ours (see ``loop_slices``), else here, the slow way; ``(their result, where they ran)``.

        Raises:
            LoopWorkTimeout: the loop did not finish them within ``timeout_s``.
        """
        if self.loop.is_driven:
            finished = self.loop.run(steps, timeout_s=timeout_s)
            return finished.result, f"on the scheduler thread: {finished}"
        with _short_gil_switches(), one_intra_op_thread():
            return drain(steps), "on the calling thread (no scheduler loop drives the slices yet)"

    # --- the pause (scheduler thread, every TP rank) -------------------------------------------

    def _vote(self, request: Any) -> lr.LiveDecision:
        try:
            local = _check_local_dir(request.local_checkpoint_dir, self.allowed_roots)
            target = request.target_version
            if isinstance(target, bool) or not isinstance(target, int) or target < 0:
                raise InvalidRequestError(f"target_version must be an integer >= 0, got {target!r}")
            held = positions.held_version(local)
            if held is None or held.version != target:
                raise InvalidRequestError(
                    f"the local checkpoint {local} holds {('v%d' % held.version) if held else 'no verified version'}, "
                    f"not the target v{target}: pull it first (POST /pull_weights)"
                )
        except (InvalidRequestError, PathNotAllowedError) as exc:
            return lr.LiveDecision(rank=self.rank, live=False, error_type=exc.error_type,
                                   http_status=int(exc.http_status), message=str(exc))
        _release_later(self._voted)  # a rolled-back update's memory: not freed inside the pause
        self._voted = None
        if self.weights.pull_is_running():  # the same answer on every rank (see coordinator)
            return lr.LiveDecision(
                rank=self.rank, live=False, error_type="conflict", http_status=409,
                message="a /pull_weights is still running on this engine and may be rewriting the local checkpoint; "
                "wait for its reply, then retry",
            )
        reload_s = self.pause_costs.reload_estimate

        def reload_because(reason: str) -> lr.LiveDecision:
            return lr.LiveDecision(rank=self.rank, live=False, reason=reason, reload_estimate_s=reload_s)

        weights = self.weights
        with weights.lock:
            staged, live = weights.staged, weights.live
            if live is None:
                return reload_because(f"the live version is unknown: {weights.live_reason}")
            if is_serving(live, held):
                # already serving exactly these bytes: nothing to scatter (the cache is still flushed if asked)
                self._voted = StagedUpdate(target, target, held.source_dir, local, weights.generation,
                                           from_key=live.key(), target=live)
                self._hold_generation(weights.generation)
                return lr.LiveDecision(rank=self.rank, live=True, live_estimate_s=0.0, reload_estimate_s=reload_s)
            if staged is None:
                return reload_because(weights.stage_reason or "nothing staged")
            if staged.to_version != target or staged.local_checkpoint_dir != local:
                return reload_because(f"the staged update is for v{staged.to_version} in {staged.local_checkpoint_dir}")
            if staged.generation != weights.generation or staged.from_key != live.key():
                return reload_because("the weights changed after staging")
            if staged.target is None or staged.target.key() != key_of_held(held):
                return reload_because("the local checkpoint holds another run's or seed's version than the one staged")
            self._hold_generation(weights.generation)
        self._voted = staged
        return lr.LiveDecision(rank=self.rank, live=True, elements=staged.elements,
                               live_estimate_s=self.pause_costs.live_estimate(staged.elements), reload_estimate_s=reload_s,
                               ages=self.pause_costs.ages)  # the mode's probes (results.decide_mode)

    def _hold_generation(self, generation: int) -> None:
        """The transaction's view of the weights from its vote on: every later phase checks it
        (``apply.RankWrites``)."""
        if self._txn is not None:
            self._txn.generation = generation

    def _round_key(self, request: Any, phase: str) -> str:
        """This phase's stage-gather key: the transaction, its round on this rank, the phase."""
        txn = getattr(request, "txn", "") or ""
        seen_txn, seen = self._rounds
        self._rounds = (txn, seen + 1 if seen_txn == txn else 1)
        return f"{txn}/{self._rounds[1]}/{phase}"

    def handle_update(self, request: Any, reply_type: Callable[..., Any]) -> Any:
        """One phase of the engine-wide transaction (``live.transaction``) on this rank: every TP
        rank of the stage runs it at the same loop iteration (sglang broadcasts the request); the
        stage's items go to stage 0's entry rank, which replies for the DP group (a ``reply_type``:
        the glue's IPC type)."""
        start = time.perf_counter()
        phase = getattr(request, "phase", tx.VOTE)
        key = self._round_key(request, phase)
        with _no_gc_pause(), _short_gil_switches():
            try:
                item = self._run_phase(request, phase, start)
            except Exception as exc:  # never into the scheduler; the rank still joins the gather
                log.exception("live apply %s: phase %s failed", self.rank, phase)
                item = self._phase_failure(phase, f"update_weights_from_pulled failed inside the scheduler: "
                                                  f"{type(exc).__name__}: {exc}", start)
            items = self._all_gather(item)
        timeout_s = self.gather.timeout_s

        def make_output(all_items: list, missing: list) -> Any:
            if phase == tx.VOTE:
                votes = all_items + [tx.missing_stage_vote(k, timeout_s) for k in missing]
                return reply_type(success=True, message="", votes=votes)
            reports = all_items + [tx.missing_stage_report(k, phase, timeout_s) for k in missing]
            return reply_type(success=all(r.success for r in reports), message="", reports=reports)

        return self.gather.finish(request, key, items, make_output)

    def _run_phase(self, request: Any, phase: str, start: float) -> Any:
        if phase == tx.VOTE:
            self._txn = RankTxn(getattr(request, "txn", ""), start)
            return self._vote(request)
        txn = self._txn
        if txn is None or txn.id != getattr(request, "txn", ""):
            return self._phase_failure(phase, f"phase {phase} of a transaction this rank did not vote in", start)
        if phase in (tx.APPLY, tx.RELOAD):  # from the vote to the next phase: what either mode pays
            self.pause_costs.record_round_trip(start - txn.start)
        if phase == tx.APPLY:
            return self.writes.apply(self._voted, txn)  # what this rank voted on, even if a pull replaced it since
        if phase == tx.COMMIT:
            committed = txn.staged is not None and txn.undo is not None
            report = self.writes.commit(request, txn)
            if committed:  # the update's memory: freed after the pause, not inside it
                _release_later(self._voted)
                self._voted = None
            return report
        if phase == tx.ROLLBACK:
            return self.writes.rollback(txn, request.reason or "another rank failed")
        if phase == tx.RELOAD:  # the transaction stays open: a failed reload is repeated on every rank
            return self.writes.reload(request, request.reason, txn.start)
        return self._phase_failure(phase, f"unknown phase {phase!r}", start)

    def _phase_failure(self, phase: str, message: str, start: float) -> Any:
        if phase == tx.VOTE:
            return lr.LiveDecision(rank=self.rank, live=False, error_type="internal_error", http_status=500, message=message)
        return self.writes.failure(message, start)

    def handle_digest(self, request: Any, reply_type: Callable[..., Any], rank_type: Callable[..., Any]) -> Any:
        """Every parameter's digest on every rank of every stage (``rank_type`` per rank, in one
        ``reply_type``: the glue's IPC types)."""
        try:
            mine = rank_type(
                host=self.host, rank=self.rank, digests=digest_params(self.model, request.names),
                data_ptrs={n: int(p.data.data_ptr()) for n, p in self.model.named_parameters()},
                live_version=self.live.version if self.live else None, live_reason=self.weights.describe(),
                coordinate_map=self.cmap.summary() if self.cmap is not None else {"error": self.proof.status()},
            )
        except Exception as exc:
            log.exception("weights_digest failed")
            mine = rank_type(host=self.host, rank=self.rank, digests={}, live_reason=f"digest failed: {exc}")
        ranks = self._all_gather(mine)
        timeout_s = self.gather.timeout_s

        def make_output(items: list, missing: list) -> Any:
            lost = [rank_type(host=f"pp-stage-{k}", rank=f"pp{k}", digests={},
                                live_reason=f"pipeline stage {k} did not answer within {timeout_s:.0f} s") for k in missing]
            return reply_type(ranks=items + lost)

        # every pipeline stage's ranks (stage 0's entry rank replies once each stage posted)
        return self.gather.finish(request, f"digest/{getattr(request, 'rid', None) or ''}", list(ranks), make_output)

    def _all_gather(self, obj: Any) -> list:
        return self.group.all_gather(obj) if self.group.size > 1 else [obj]


def _engine_is_idle(scheduler: Any) -> bool:
    """No running batch and no request waiting (sglang's own check; False where it has none)."""
    check = getattr(scheduler, "is_fully_idle", None)
    return bool(check()) if callable(check) else False


def _check_local_dir(value: object, allowed_roots: tuple) -> str:
    from ..paths import _check_one

    if not allowed_roots:
        raise PathNotAllowedError(str(value), [], f"no allowed roots are configured; start the server with {ALLOWED_ROOTS_FLAG}")
    return _check_one("local_checkpoint_dir", value, allowed_roots)


def _release_later(staged: Optional[StagedUpdate], delay_s: float = 0.5) -> None:
    """Drop ``staged`` on another thread once the pause is over: freeing a staged update (index,
    values and undo log: up to hundreds of MB) unmaps its pages, which took 15-80 ms measured
    inside the next pause when the scheduler thread let it go."""
    if staged is None:
        return
    holder = [staged]
    timer = threading.Timer(delay_s, holder.clear)
    timer.daemon = True
    timer.name = "weightsync-release"
    timer.start()


@contextlib.contextmanager
def _no_gc_pause() -> Iterator[None]:
    """No cyclic garbage collection inside the pause (a full one over sglang's heap takes tens
    of ms); it runs when the pause is over, while serving."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _short_gil_switches(interval_s: float = 1e-4) -> Iterator[None]:
    """While this thread makes many short calls that give the GIL up (torch ops, syscalls).

    Each must win the GIL back from whichever thread took it meanwhile (in the scheduler
    process there is always one: sglang's loop while we stage, other threads in the pause); at
    the default 5 ms switch interval that wait, not the work, is the cost: hundreds of calls.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, interval_s))
    try:
        yield
    finally:
        sys.setswitchinterval(before)
