"""Scheduler side of live apply: the live version, the map, staging, the pause, and the hooks.

Per scheduler rank, one ``LiveApplyState`` (on ``scheduler._weightsync_live``):

- **The live version** (``live.identity.LiveVersion``): version, source dir, run and seed
  fingerprint, as the core's marker records them; at start-up version 0 (the seed dir the
  engine loaded, fingerprinted then). After a reload from a local checkpoint dir
  (``/update_weights_from_disk`` or our reload route) it is what that dir named before the
  reload if it names the same after it and no pull ran meanwhile (``live.identity.
  reload_outcome``); after any other weight update (another path, tensors, distributed, IPC) it
  is unknown until the next reload from a dir.
  Every weight update also bumps ``generation``, which voids a proof or a staging in flight.
- **The map**: built once per engine lifetime on a thread started at the first loop
  iteration, then proven against the seed dir while the live weights still hold version 0.
  The proof's torch work runs on the scheduler thread itself, a ~2 ms slice per loop
  iteration (10 ms while the engine is fully idle) (``loop``: ``loop_slices.LoopSlices``, driven from our hook on
  ``process_input_requests``); the map thread waits for it.
- **Staging**: ``stage_after_pull`` runs in each rank's pull thread once the core verified
  the local checkpoint: the helper process does the heavy half, the scheduler thread the
  engine half in slices as above (see ``live.patch``). From a side thread every torch call
  waited for the GIL held by sglang's busy loop (about 9 ms a call here).
- **The pause**: one transaction for the whole engine (``live.transaction``): the tokenizer
  sends ``vote``, then ``apply`` (every rank writes and keeps its undo log) and ``commit`` or
  ``rollback`` (or ``reload``) to every DP group; ``handle_update`` runs each phase on every TP
  rank at the same loop iteration (sglang broadcasts the request), all-gathers the stage's
  items, and stage 0's entry rank replies once every pipeline stage posted its items through
  the store (``StageGather``). A rank whose restore fails says "not restored" and every rank
  reloads.

Test-only switches (environment, read by the scheduler processes):
``WEIGHTSYNC_TEST_FAULT_DIR``: a file ``live-apply-fault-<rank label with / as _>`` there
makes that rank fail once in the middle of its next scatter, ``live-restore-fault-<rank>`` in
the middle of its next restore (each file is removed when it fires);
``WEIGHTSYNC_TEST_POST_LOAD_TRANSFORM=param``: after every load, nudge one element of that
parameter by one ulp (a stand-in for AMX packing or an MoE shuffle; see ``plugin``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import weightsync.codecs.positions as positions
from weightsync.errors import InvalidRequestError, PathNotAllowedError
from weightsync.identity import seed_fingerprint as fingerprint_seed
from weightsync.lock import shared_host_lock

from .. import compat
from ..paths import ALLOWED_ROOTS_FLAG
from . import check as live_check
from . import results as lr
from . import scope as live_scope
from . import transaction as tx
from .coordinate_map import CheckpointReader, CoordinateMap, MapNotLearnable, ProofAttempts, build_coordinate_map, prove_map_steps
from .identity import (LiveVersion, ReloadWitness, from_held, is_serving, key_of_held, reload_outcome, seed_version,
                       why_not_base)
from .loop_slices import LoopSlices, LoopWorkTimeout, drain
from .patch import (RestoreFailed, StagedUpdate, StagingRefused, UndoLog, finish_staging_steps, one_intra_op_thread,
                    reload_only_reasons, scatter_with_undo, undo_log_steps)
from .stage import Patch, StageJob, StageReply

log = logging.getLogger(__name__)

FAULT_DIR_ENV = "WEIGHTSYNC_TEST_FAULT_DIR"
RELOAD_GATE_ENV = "WEIGHTSYNC_TEST_RELOAD_GATE"
RELOAD_DELAY_ENV = "WEIGHTSYNC_TEST_RELOAD_DELAY_S"
LOOP_STAGING_TIMEOUT_S = 120.0  # the loop runs a slice every iteration; only a stalled loop takes this long
LOOP_PROOF_TIMEOUT_S = 1800.0  # O(model): a few seconds for 1.3 GB here, minutes for the largest


class InjectedFault(RuntimeError):
    """The test-only fault of ``WEIGHTSYNC_TEST_FAULT_DIR``."""


def fault_file(rank: str, prefix: str = "live-apply-fault-") -> Optional[str]:
    directory = os.environ.get(FAULT_DIR_ENV)
    return os.path.join(directory, prefix + rank.replace("/", "_")) if directory else None


@dataclass
class _Txn:
    """This rank's part of one engine-wide transaction, from its vote to its commit or rollback."""

    id: str
    start: float  # when this rank saw the vote (the pause, as this rank sees it)
    staged: Optional[StagedUpdate] = None
    undo: Optional[UndoLog] = None
    written: int = 0
    scatter_s: float = 0.0
    restore_failure: Optional[str] = None  # why this rank is not restored (it must reload)
    before_restore: Optional[Callable[[int, str], None]] = None


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
    """One scheduler rank's live-apply state (see the module docstring)."""

    def __init__(self, *, scheduler: Any, group: Any, host: str, rank: str, seed_dir: Optional[str],
                 allowed_roots: tuple, max_changed_fraction: float, gather: Optional[tx.StageGather] = None,
                 scope: Optional[live_scope.EngineScope] = None,
                 pull_is_running: Callable[[], bool] = lambda: False) -> None:
        self.scheduler = scheduler
        self.group = group
        self.host = host
        self.rank = rank
        self.seed_dir = seed_dir
        self.allowed_roots = allowed_roots
        self.max_changed_fraction = max_changed_fraction
        self.pull_is_running = pull_is_running  # whether this rank's pull is under way (the pull's glue knows)
        self._lock = threading.Lock()
        self.generation = 0
        # v0's identity is the seed's fingerprint, taken now (right after sglang loaded it)
        self.live: Optional[LiveVersion] = seed_version(fingerprint_seed(seed_dir)) if seed_dir else None
        self.live_reason = "" if seed_dir else "the engine's model path is not a local dir"
        # the dir of the last load that named a verified version (a map built later is proven against it)
        self.live_dir: Optional[str] = seed_dir
        self.cmap: Optional[CoordinateMap] = None
        self.map_error: Optional[str] = None
        self.scope = scope  # the allow-list and engine-wide reasons to reload (None: a bare model in a test)
        self.scope_reason: Optional[str] = None  # why this engine reloads on every update (live.scope)
        self.proof_attempts = ProofAttempts()  # proofs after reloads: one at a time, one per identity
        self._map_thread: Optional[threading.Thread] = None
        self.staged: Optional[StagedUpdate] = None
        self._voted: Optional[StagedUpdate] = None
        self._txn: Optional[_Txn] = None
        # one phase's items of every pipeline stage, to stage 0's entry rank (live.transaction)
        self.gather = gather or tx.StageGather(pp_rank=0, pp_size=1, leader=True, channel=None, send=lambda o, r: None)
        self.stage_reason: Optional[str] = "nothing staged yet (pull the target version first)"
        self._phase: dict[str, float] = {}  # seconds into the last update call, per step (logged)
        self.pause_costs = lr.PauseCosts()  # what the mode is chosen by
        self._reload_witness: Optional[ReloadWitness] = None
        self._reload_started: Optional[float] = None
        # staging's engine half and the proof (see loop_slices)
        self.loop = LoopSlices(around_slice=one_intra_op_thread, is_idle=lambda: _engine_is_idle(scheduler))

    # --- the model ---------------------------------------------------------------------------

    @property
    def model(self):
        return self.scheduler.tp_worker.model_runner.model

    def params(self) -> dict:
        return {name: p.data for name, p in self.model.named_parameters()}

    # --- the live version --------------------------------------------------------------------

    def _is_seed_dir(self, path: Optional[str]) -> bool:
        return bool(path and self.seed_dir and os.path.realpath(path) == os.path.realpath(self.seed_dir))

    def _identity_of_dir(self, path: Optional[str]) -> Optional[LiveVersion]:
        """What a load of ``path`` now would give: its marker's (or verified note's) version and
        origin; the seed dir is v0 with its fingerprint now; None: no verified version."""
        if not path or not os.path.isdir(path):
            return None
        held = positions.held_version(path)
        if held is not None:
            return from_held(held, f"reload from {path} ({held.how})")
        return seed_version(fingerprint_seed(path), f"reload from the seed dir {path}") if self._is_seed_dir(path) else None

    def begin_reload(self, model_path: Optional[str]) -> None:
        """Before sglang's update_weights_from_disk (ours or anyone's): what the dir names now."""
        before = self._identity_of_dir(model_path)
        witness = ReloadWitness(model_path, before.key() if before else None, self.pull_is_running())
        with self._lock:
            self.generation += 1
            self.staged = None
            self._reload_witness = witness
        self._reload_started = time.perf_counter()

    def after_reload(self, model_path: Optional[str], success: bool) -> None:
        """After sglang's update_weights_from_disk (ours or anyone's): the live version is what
        the dir named before the reload, if it names the same now and no pull ran meanwhile."""
        _test_reload_delay()
        if success and self._reload_started is not None:
            self.pause_costs.record_reload(time.perf_counter() - self._reload_started)
        self._reload_started = None
        _wait_at_reload_gate(self.rank)
        after = self._identity_of_dir(model_path) if success else None
        with self._lock:
            witness, self._reload_witness = self._reload_witness, None
        why = reload_outcome(witness, model_path, success, after.key() if after else None, self.pull_is_running())
        with self._lock:
            self.generation += 1
            self.staged = None
            self.stage_reason = "the weights were reloaded after the last staging"
            if why is None and after is not None:
                self.live, self.live_reason, self.live_dir = after, "", model_path
            else:
                self.live, self.live_dir = None, None
                self.live_reason = why or f"a reload from {model_path} named no version"
        log.info("live apply %s: live version now %s", self.rank, self.describe_live())
        if self.live is not None and self.cmap is not None and not self.cmap.proven and model_path:
            # the start-up proof was voided by a weight change: prove against this dir instead,
            # once per identity (O(model) work must not repeat after every unproven reload)
            expected, path = self.live, model_path
            why_not = self.proof_attempts.begin((os.path.realpath(path), expected.key()))
            if why_not is not None:
                log.info("live apply %s: no proof after this reload: %s", self.rank, why_not)
                return
            threading.Thread(
                target=lambda: self._prove_quietly(path, expected), name="weightsync-proof", daemon=True
            ).start()

    def _prove_quietly(self, checkpoint_dir: str, expected: LiveVersion) -> None:
        try:
            self._prove_in_dir(checkpoint_dir, expected)
        finally:
            self.proof_attempts.end()

    def _prove_in_dir(self, checkpoint_dir: str, expected: LiveVersion) -> None:
        try:
            # the seed dir has no marker and no pull writes there
            self.prove(CheckpointReader(checkpoint_dir), expected,
                       checkpoint_dir=None if self._is_seed_dir(checkpoint_dir) else checkpoint_dir)
        except Exception:
            log.exception("live apply %s: the proof against %s failed", self.rank, checkpoint_dir)

    def after_other_update(self, how: str) -> None:
        with self._lock:
            self.generation += 1
            self.staged = None
            self.live, self.live_dir = None, None
            self.live_reason = f"the weights were last updated through {how}"
            self.stage_reason = self.live_reason

    def describe_live(self) -> str:
        return self.live.describe() if self.live else f"unknown ({self.live_reason})"

    # --- the map -----------------------------------------------------------------------------

    def ensure_map_started(self) -> None:
        if self._map_thread is None:
            self._map_thread = threading.Thread(target=self._build_and_prove, name="weightsync-map", daemon=True)
            self._map_thread.start()

    def _build_and_prove(self) -> None:
        try:
            if self.seed_dir is None:
                raise RuntimeError("the engine's model path is not a local dir: no checkpoint to map")
            scope = self.scope.why_reload_only(self.model) if self.scope is not None else None
            if scope is not None:
                self.scope_reason = scope
                log.warning("live apply %s: off for this engine, every update reloads: %s", self.rank, scope)
                return
            reader = CheckpointReader(self.seed_dir)
            try:
                cmap = build_coordinate_map(self.model, reader.specs())
            except MapNotLearnable as exc:
                raise MapNotLearnable(f"it could not be learnt on a storage-free copy of the model: {exc}") from exc
            log.info(
                "live apply %s: coordinate map built in %.3fs: %d placements for %d tensors, %d B; reload-only: %s",
                self.rank, cmap.build_s, cmap.placement_count(), len(cmap.placements), cmap.nbytes(),
                {**cmap.reload_only_tensors, **cmap.reload_only_params} or "none",
            )
            self.cmap = cmap
            with self._lock:
                live, live_dir = self.live, self.live_dir
            if live is not None and live_dir is not None and live_dir != self.seed_dir:
                # a reload from a local checkpoint landed while the map was built: prove against it
                self.prove(CheckpointReader(live_dir), live, checkpoint_dir=live_dir)
            else:
                self.prove(reader, expected=LiveVersion(0, None, ""))
        except Exception as exc:
            log.exception("live apply %s: the coordinate map could not be built", self.rank)
            self.map_error = f"{type(exc).__name__}: {exc}"

    def prove(self, reader: CheckpointReader, expected: LiveVersion, checkpoint_dir: Optional[str] = None) -> None:
        """Prove the map while the live weights hold ``expected`` (the reader's version).

        ``checkpoint_dir``: a local checkpoint that a pull may rewrite during the proof. The proof
        counts only if the dir still holds ``expected`` when it ends: a pull's new bytes would
        otherwise make every parameter they touch reload-only for the engine's lifetime.
        """
        cmap = self.cmap
        with self._lock:
            generation, live = self.generation, self.live
        if cmap is None or live is None or live.version != expected.version:
            return

        def still_valid() -> bool:
            if self.generation != generation:
                return False
            if checkpoint_dir is None:  # the seed dir: no pull writes there
                return True
            held = positions.held_version(checkpoint_dir)
            if held is None or held.version != expected.version:
                return False
            return expected.seed is None or key_of_held(held) == expected.key()

        # A shared hold of the host's pull lock: a pull (exclusive) from any co-located rank
        # waits until every rank's proof has read the dir. Without it a trainer that pulls
        # right after a fallback reload voids every proof, and the engine reloads for ever.
        held = shared_host_lock(checkpoint_dir) if checkpoint_dir is not None else contextlib.nullcontext()
        steps = prove_map_steps(cmap, self.params(), reader.tensor, still_valid=still_valid)
        with held:
            try:
                result, where = self._run_steps(steps, LOOP_PROOF_TIMEOUT_S)
            except LoopWorkTimeout as exc:
                log.warning("live apply %s: the proof did not finish: %s", self.rank, exc)
                return
        ok = bool(result)
        log.info("live apply %s: the proof ran %s", self.rank, where)
        log.info("live apply %s: proof %s in %.3fs: %s", self.rank,
                 "done" if ok else "voided (the weights or the checkpoint changed meanwhile)", cmap.proof_s, cmap.proof_reason)

    def map_status(self) -> Optional[str]:
        """None when the map is ready to use, else why not."""
        if self.scope_reason:
            return f"live apply is off for this engine: {self.scope_reason}"
        if self.map_error:
            return f"the coordinate map failed: {self.map_error}"
        if self.cmap is None:
            return "the coordinate map is still being built"
        if not self.cmap.proven:
            return "the coordinate map is not proven against the live weights yet"
        return None

    # --- staging (pull thread) ---------------------------------------------------------------

    def stage_after_pull(self, local_dir: str, source_dir: str, target_version: int, stager: "Stager") -> None:
        """Stage ``live -> target`` from the verified local dir; never raises (the pull succeeded)."""
        with self._lock:
            generation, live = self.generation, self.live
            self.staged = None
        try:
            staged = self._stage(local_dir, source_dir, target_version, generation, live, stager)
            reason = None
        except StagingRefused as exc:
            staged, reason = None, exc.reason
        except Exception as exc:
            log.exception("live apply %s: staging v%d failed", self.rank, target_version)
            staged, reason = None, f"staging failed: {type(exc).__name__}: {exc}"
        with self._lock:
            if self.generation != generation:
                staged, reason = None, "the weights changed while the update was being staged"
            self.staged, self.stage_reason = staged, reason
        if staged is not None:
            log.info(
                "live apply %s: staged v%d -> v%d: %d elements of %d tensors (%d B host memory) in %.3fs "
                "(helper %.3fs, engine %.3fs %s)",
                self.rank, staged.from_version, staged.to_version, staged.elements, staged.tensors, staged.nbytes,
                staged.stage_s, staged.helper_s, staged.engine_s, staged.engine_where,
            )
        else:
            log.info("live apply %s: v%d not staged: %s", self.rank, target_version, reason)

    def _stage(self, local_dir: str, source_dir: str, target: int, generation: int, live: Optional[LiveVersion],
               stager: "Stager") -> StagedUpdate:
        start = time.perf_counter()
        if live is None:
            raise StagingRefused(f"the live version is unknown: {self.live_reason}")
        status = self.map_status() or (self.scope.why_refused_now(self.model) if self.scope is not None else None)
        if status is not None:
            raise StagingRefused(status)
        source_real = os.path.realpath(source_dir)
        held = positions.held_version(local_dir)  # the pull that verified it holds the host lock
        if held is None or held.version != target:
            raise StagingRefused(f"the local checkpoint holds {('v%d' % held.version) if held else 'no verified version'}, "
                                 f"not the pulled v{target}")
        why = why_not_base(live, held)  # the chain must extend exactly the bytes the weights hold
        if why is not None:
            raise StagingRefused(why)
        if target <= live.version:
            raise StagingRefused(f"the live version v{live.version} is not below the target v{target}")
        assert self.cmap is not None
        job = StageJob(
            local_checkpoint_dir=local_dir, source_dir=source_dir, from_version=live.version, to_version=target,
            max_elements=int(self.max_changed_fraction * self.cmap.mapped_elements),
            placements=self.cmap.placements, unused=sorted(self.cmap.unused_tensors),
            reload_only=reload_only_reasons(self.cmap),
        )
        staged = StagedUpdate(live.version, target, source_real, os.path.realpath(local_dir), generation,
                              from_key=live.key(), target=from_held(held, f"live apply from {local_dir}"))
        early: list = []  # the undo log's loop job, started as soon as the positions are readable

        def positions_ready(patches: list[Patch]) -> None:
            # the undo log needs the positions only: the loop takes it while the helper still
            # gathers the values (the loop would otherwise wait for the helper, and then the
            # helper's caller for the loop)
            if self.loop.is_driven:
                early.append((patches, self.loop.submit(undo_log_steps(patches, self.params(), staged))))

        try:
            reply, patches = stager(job, positions_ready)
            if reply.error is not None:
                raise StagingRefused(f"staging failed: {reply.error}")
            if reply.refused is not None:
                raise StagingRefused(reply.refused)
            staged.elements, staged.tensors, staged.helper_s = reply.elements, reply.tensors, reply.stage_s
            saved, where = None, ""
            if early and early[0][0] is patches:
                finished = self.loop.wait(early.pop()[1], timeout_s=LOOP_STAGING_TIMEOUT_S)
                saved, where = finished.result, f"undo log while the helper gathered the values: {finished}; then "
            _, rest = self._run_steps(finish_staging_steps(patches, self.params(), staged, saved), LOOP_STAGING_TIMEOUT_S)
            staged.engine_where = where + rest
        except LoopWorkTimeout as exc:
            raise StagingRefused(f"staging did not finish: {exc}") from exc
        finally:
            for _, job_ in early:  # a refusal or a failure: its undo log is not wanted
                self.loop.cancel(job_)
        staged.stage_s = time.perf_counter() - start
        return staged

    def _run_steps(self, steps: Iterator[None], timeout_s: float) -> tuple[object, str]:
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
        if self.pull_is_running():  # the same answer on every rank (see coordinator)
            return lr.LiveDecision(
                rank=self.rank, live=False, error_type="conflict", http_status=409,
                message="a /pull_weights is still running on this engine and may be rewriting the local checkpoint; "
                "wait for its reply, then retry",
            )
        reload_s = self.pause_costs.reload_estimate

        def reload_because(reason: str) -> lr.LiveDecision:
            return lr.LiveDecision(rank=self.rank, live=False, reason=reason, reload_estimate_s=reload_s)

        with self._lock:
            staged, live = self.staged, self.live
            if live is None:
                return reload_because(f"the live version is unknown: {self.live_reason}")
            if is_serving(live, held):
                # already serving exactly these bytes: nothing to scatter (the cache is still flushed if asked)
                self._voted = StagedUpdate(target, target, held.source_dir, local, self.generation,
                                           from_key=live.key(), target=live)
                return lr.LiveDecision(rank=self.rank, live=True, live_estimate_s=0.0, reload_estimate_s=reload_s)
            if staged is None:
                return reload_because(self.stage_reason or "nothing staged")
            if staged.to_version != target or staged.local_checkpoint_dir != local:
                return reload_because(f"the staged update is for v{staged.to_version} in {staged.local_checkpoint_dir}")
            if staged.generation != self.generation or staged.from_key != live.key():
                return reload_because("the weights changed after staging")
            if staged.target is None or staged.target.key() != key_of_held(held):
                return reload_because("the local checkpoint holds another run's or seed's version than the one staged")
        self._voted = staged
        return lr.LiveDecision(rank=self.rank, live=True, elements=staged.elements,
                               live_estimate_s=self.pause_costs.live_estimate(staged.elements), reload_estimate_s=reload_s)

    def handle_update(self, request: Any, reply_type: Callable[..., Any]) -> Any:
        """One phase of the engine-wide transaction (``live.transaction``) on this rank: every TP
        rank of the stage runs it at the same loop iteration (sglang broadcasts the request); the
        stage's items go to stage 0's entry rank, which replies for the DP group (a ``reply_type``:
        the glue's IPC type)."""
        start = time.perf_counter()
        phase = getattr(request, "phase", tx.VOTE)
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

        return self.gather.finish(request, f"{getattr(request, 'txn', '')}/{phase}", items, make_output)

    def _run_phase(self, request: Any, phase: str, start: float) -> Any:
        if phase == tx.VOTE:
            self._txn = _Txn(getattr(request, "txn", ""), start)
            return self._vote(request)
        txn = self._txn
        if txn is None or txn.id != getattr(request, "txn", ""):
            return self._phase_failure(phase, f"phase {phase} of a transaction this rank did not vote in", start)
        if phase in (tx.APPLY, tx.RELOAD):  # from the vote to the next phase: what either mode pays
            self.pause_costs.record_round_trip(start - txn.start)
        if phase == tx.APPLY:
            return self._apply_live(request, txn)
        if phase == tx.COMMIT:
            return self._commit(request, txn)
        if phase == tx.ROLLBACK:
            return self._rollback(txn, request.reason or "another rank failed")
        if phase == tx.RELOAD:
            self._txn = None
            return self._reload(request, request.reason, txn.start)
        return self._phase_failure(phase, f"unknown phase {phase!r}", start)

    def _phase_failure(self, phase: str, message: str, start: float) -> Any:
        if phase == tx.VOTE:
            return lr.LiveDecision(rank=self.rank, live=False, error_type="internal_error", http_status=500, message=message)
        return lr.LiveRankReport(host=self.host, rank=self.rank, success=False, mode=lr.LIVE, message=message,
                                 pause_s=time.perf_counter() - start)

    def _apply_live(self, request: Any, txn: "_Txn") -> lr.LiveRankReport:
        """Write what this rank voted on and keep the undo log; commit nothing yet."""
        staged = self._voted  # what this rank voted on, even if a pull thread replaced it since
        if staged is None:
            return self._phase_failure(tx.APPLY, "this rank voted for no live update", txn.start)
        txn.staged = staged
        fault = fault_file(self.rank)
        restore_fault = fault_file(self.rank, "live-restore-fault-")

        def before_write(k: int, param: str) -> None:
            if fault and k == len(staged.patches) // 2 and os.path.exists(fault):
                os.unlink(fault)
                raise InjectedFault(f"injected fault on {self.rank} while writing {param} (patch {k} of {len(staged.patches)})")

        def before_restore(k: int, param: str) -> None:
            if restore_fault and k == len(staged.patches) // 2 and os.path.exists(restore_fault):
                os.unlink(restore_fault)
                raise InjectedFault(f"injected fault on {self.rank} while restoring {param}")

        txn.before_restore = before_restore
        t0 = time.perf_counter()
        try:
            txn.undo, txn.written = scatter_with_undo(staged, before_write=before_write, before_restore=before_restore)
        except RestoreFailed as exc:
            txn.restore_failure = exc.result.describe()
            log.error("live apply %s: scatter failed and this rank was not restored: %s", self.rank, exc)
            return self._phase_failure(tx.APPLY, f"{exc}", txn.start)
        except Exception as exc:
            log.warning("live apply %s: scatter failed, this rank restored: %s", self.rank, exc)
            return self._phase_failure(tx.APPLY, f"{type(exc).__name__}: {exc}", txn.start)
        txn.scatter_s = time.perf_counter() - t0
        self._phase["scattered"] = time.perf_counter() - txn.start
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=True, mode=lr.LIVE, message=f"patched {txn.written} elements live",
            weight_version=staged.to_version, elements_scattered=txn.written, pause_s=time.perf_counter() - txn.start,
            scatter_s=txn.scatter_s, stage_s=staged.stage_s, staged_nbytes=staged.nbytes,
        )

    def _commit(self, request: Any, txn: "_Txn") -> lr.LiveRankReport:
        """Every rank applied: this rank takes the new version and flushes its cache.

        The flush is here, on every rank at once, not in ``apply``: the TP ranks' schedulers must
        keep identical caches (one rank flushed and another not diverged their batches and took
        the server down after a rollback)."""
        staged = txn.staged
        if staged is None or txn.undo is None:
            return self._phase_failure(tx.COMMIT, "this rank applied nothing to commit", txn.start)
        ok, message = compat.flush_cache_after_weight_update(self.scheduler.weight_updater, request,
                                                             f"patched {txn.written} elements live")
        compat.record_weight_version(self.scheduler.weight_updater, staged.to_version)
        self._take_applied_version(staged)
        # every written element and a fresh sample against the checkpoint (live.check); a
        # mismatch on any rank makes the coordinator send the reload phase: the transaction stays
        # open until the next vote, as after a rollback
        check = live_check.check_after_update(self, staged.local_checkpoint_dir, staged.to_version, staged.patches)
        _release_later(self._voted)
        self._voted = None
        pause_s = time.perf_counter() - txn.start
        self.pause_costs.record_live(txn.written, txn.scatter_s, pause_s)
        log.info("live apply %s: v%d committed, %d elements, pause %.4fs (scatter %.4fs)", self.rank, staged.to_version,
                 txn.written, pause_s, txn.scatter_s)
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=ok, mode=lr.LIVE, message=message,
            weight_version=staged.to_version, elements_scattered=txn.written, pause_s=pause_s,
            scatter_s=txn.scatter_s, stage_s=staged.stage_s, staged_nbytes=staged.nbytes, check=check,
        )

    def _take_applied_version(self, staged: StagedUpdate) -> None:
        with self._lock:
            self.generation += 1
            self.live = staged.target  # the identity the local checkpoint named when staged
            self.live_reason = "" if staged.target is not None else "a live apply of an update staged without an identity"
            self.staged = None
            self.stage_reason = f"v{staged.to_version} was applied; nothing staged since"

    def _rollback(self, txn: "_Txn", reason: str) -> lr.LiveRankReport:
        """Some rank failed: write this rank's undo log back and check it. The staged update is
        kept, so a retry can succeed; a rank that is not restored holds an unknown version."""
        staged = txn.staged
        if txn.undo is not None:
            result = txn.undo.restore(before_write=txn.before_restore)
            txn.undo = None
            if not result.restored:
                txn.restore_failure = result.describe()
        # The transaction stays open until the next vote: when any rank of the engine was not
        # restored, the coordinator sends every rank (restored or not) the reload phase next.
        if txn.restore_failure is not None:
            with self._lock:
                self.generation += 1
                self.staged, self.live, self.live_dir = None, None, None
                self.live_reason = f"a live apply's restore failed on this rank ({txn.restore_failure})"
                self.stage_reason = self.live_reason
            log.error("live apply %s: NOT restored: %s", self.rank, txn.restore_failure)
            return lr.LiveRankReport(
                host=self.host, rank=self.rank, success=False, mode=lr.LIVE, rolled_back=False,
                message=f"live apply failed ({reason}) and this rank was {txn.restore_failure}",
                pause_s=time.perf_counter() - txn.start,
            )
        live = self.live
        log.warning("live apply %s: rolled back%s: %s", self.rank,
                    f" v{staged.to_version} -> v{staged.from_version}" if staged else "", reason)
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=False, mode=lr.LIVE, rolled_back=True,
            message=f"live apply failed, rolled back: {reason}", weight_version=live.version if live else None,
            pause_s=time.perf_counter() - txn.start, stage_s=staged.stage_s if staged else 0.0,
            staged_nbytes=staged.nbytes if staged else 0,
        )

    def _reload(self, request: Any, reason: Optional[str], start: float) -> lr.LiveRankReport:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        local = os.path.realpath(request.local_checkpoint_dir)
        load_format = getattr(self.scheduler.server_args, "load_format", None)
        out = self.scheduler.weight_updater.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(
                model_path=local, load_format=load_format, weight_version=str(request.target_version),
                flush_cache=request.flush_cache,
            )
        )
        live = self.live
        check = live_check.check_after_update(self, local, request.target_version) if out.success else None
        return lr.LiveRankReport(
            host=self.host, rank=self.rank, success=bool(out.success), mode=lr.RELOAD, reason=reason,
            message=out.message, weight_version=live.version if (out.success and live) else None,
            pause_s=time.perf_counter() - start, check=check,
        )

    def handle_digest(self, request: Any, reply_type: Callable[..., Any], rank_type: Callable[..., Any]) -> Any:
        """Every parameter's digest on every rank of every stage (``rank_type`` per rank, in one
        ``reply_type``: the glue's IPC types)."""
        try:
            mine = rank_type(
                host=self.host, rank=self.rank, digests=digest_params(self.model, request.names),
                data_ptrs={n: int(p.data.data_ptr()) for n, p in self.model.named_parameters()},
                live_version=self.live.version if self.live else None, live_reason=self.describe_live(),
                coordinate_map=self.cmap.summary() if self.cmap is not None else {"error": self.map_status()},
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


# ``stager(job, positions_ready)``: runs the heavy half of staging; may call
# ``positions_ready(patches)`` once their positions are readable (their values not yet)
Stager = Callable[[StageJob, Callable[[list[Patch]], None]], "tuple[StageReply, list[Patch]]"]


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


def _test_reload_delay() -> None:
    """Test-only (``WEIGHTSYNC_TEST_RELOAD_DELAY_S``): every reload takes that much longer, as a
    real model's does: on the tiny test models a reload is as fast as a live apply's fixed cost,
    so the measured choice would reload where a test means to exercise live apply."""
    delay = os.environ.get(RELOAD_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def _wait_at_reload_gate(rank: str, timeout_s: float = 120.0) -> None:
    """Test-only (``WEIGHTSYNC_TEST_RELOAD_GATE``, a dir holding a file ``hold``): between a
    reload's load and its reading of the dir's identity, create ``reloaded-<rank>`` there and
    wait until ``hold`` is gone, so a test can make a pull rewrite the dir in that window."""
    directory = os.environ.get(RELOAD_GATE_ENV)
    if not directory or not os.path.exists(os.path.join(directory, "hold")):
        return
    open(os.path.join(directory, "reloaded-" + rank.replace("/", "_")), "w").close()
    deadline = time.monotonic() + timeout_s
    while os.path.exists(os.path.join(directory, "hold")) and time.monotonic() < deadline:
        time.sleep(0.02)
