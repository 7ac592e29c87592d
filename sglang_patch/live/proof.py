"""The coordinate map of one rank and its proof against the live weights.

The map is built once per engine lifetime, on a thread started at the first loop iteration
(``coordinate_map.build_coordinate_map``, on a storage-free copy of the model), then proven
while the live weights still hold version 0. The proof's torch work runs on the scheduler
thread itself, a ~2 ms slice per loop iteration (10 ms while the engine is fully idle); the map
thread waits for it. A weight change voids a proof in flight (the generation); after a reload
that leaves the map unproven, the proof runs again against that dir, once per identity.

A proof against a local checkpoint holds the host's pull lock shared, so that a pull waits for
it instead of voiding it, but only for half of a pull's own wait for that lock
(``proof_lock_hold_s``): a proof of a large model (up to ``LOOP_PROOF_TIMEOUT_S``) made a pull
time out. Past that it runs on unguarded; its end check voids it if a pull rewrote the dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Generator, Iterator, Optional

import weightsync.puller.positions as positions
from weightsync import knobs
from weightsync.puller.lock import shared_host_lock

from .identity import LiveVersion, key_of_held
from .loop_slices import LoopWorkTimeout
from .mapping import derived as live_derived
from .mapping import scope as live_scope
from .mapping.coordinate_map import CheckpointReader, CoordinateMap, MapNotLearnable, ProofAttempts, build_coordinate_map, prove_map_steps
from .version import LiveWeights

log = logging.getLogger(__name__)

LOOP_PROOF_TIMEOUT_S = 1800.0  # O(model): a few seconds for 1.3 GB here, minutes for the largest

# ``run_steps(steps, timeout_s) -> (their result, where they ran)``: on the scheduler thread
# between loop iterations (``LiveApplyState.run_steps``)
RunSteps = Callable[[Iterator[None], float], "tuple[object, str]"]


def proof_lock_hold_s() -> float:
    """How long a proof holds the host's pull lock: half of what a pull waits for that lock
    (``WEIGHTSYNC_LOCK_TIMEOUT_S``, read by this engine's own pulls too), so a pull that comes
    during a proof waits out the rest of the hold and never times out because of it."""
    return 0.5 * float(knobs.LOCK_TIMEOUT_S.get())


class BoundedPullLockHold:
    """A shared hold of the host's pull lock for one proof, released at the first step boundary
    past ``limit_s`` (``bound``) or when the proof ends (``release``), whichever comes first.
    Steps run on the scheduler thread, the end on the proof's: releasing is idempotent and locked."""

    def __init__(self, checkpoint_dir: str, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stack = contextlib.ExitStack()
        self._guard = threading.Lock()
        self._stack.enter_context(shared_host_lock(checkpoint_dir))  # waits out a pull in progress
        self._clock = clock
        self.limit_s = limit_s
        self.deadline = clock() + limit_s
        self.released_early = False

    def release(self) -> None:
        with self._guard:
            self._stack.close()

    def bound(self, steps: Generator[None, None, Any]) -> Generator[None, None, Any]:
        """``steps``, with the hold released between two of them once past the deadline."""
        while True:
            if not self.released_early and self._clock() >= self.deadline:
                self.released_early = True
                self.release()
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            yield


class MapProof:
    """The map of one rank, why there is none, and its proof (see the module docstring)."""

    def __init__(self, *, rank: str, weights: LiveWeights, model: Callable[[], Any], params: Callable[[], dict],
                 run_steps: RunSteps, scope: Optional[live_scope.EngineScope] = None) -> None:
        self.rank = rank
        self.weights = weights
        self.model = model
        self.params = params
        self.run_steps = run_steps
        self.scope = scope  # the allow-list and engine-wide reasons to reload (None: a bare model in a test)
        self.cmap: Optional[CoordinateMap] = None
        self.map_error: Optional[str] = None
        self.scope_reason: Optional[str] = None  # why this engine reloads on every update (live.mapping.scope)
        self.attempts = ProofAttempts()  # proofs after reloads: one at a time, one per identity
        self.thread: Optional[threading.Thread] = None

    def status(self) -> Optional[str]:
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

    def ensure_started(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.build_and_prove, name="weightsync-map", daemon=True)
            self.thread.start()

    def build_and_prove(self) -> None:
        seed_dir = self.weights.seed_dir
        try:
            if seed_dir is None:
                raise RuntimeError("the engine's model path is not a local dir: no checkpoint to map")
            scope = self.scope.why_reload_only(self.model()) if self.scope is not None else None
            if scope is not None:
                self.scope_reason = scope
                log.warning("live apply %s: off for this engine, every update reloads: %s", self.rank, scope)
                return
            reader = CheckpointReader(seed_dir)
            try:
                model = self.model()
                cmap = build_coordinate_map(model, reader.specs(), derivable=live_derived.derivable_params(model))
            except MapNotLearnable as exc:
                raise MapNotLearnable(f"it could not be learnt on a storage-free copy of the model: {exc}") from exc
            log.info(
                "live apply %s: coordinate map built in %.3fs: %d placements for %d tensors, %d B; reload-only: %s",
                self.rank, cmap.build_s, cmap.placement_count(), len(cmap.placements), cmap.nbytes(),
                {**cmap.reload_only_tensors, **cmap.reload_only_params} or "none",
            )
            self.cmap = cmap
            with self.weights.lock:
                live, live_dir = self.weights.live, self.weights.live_dir
            if live is not None and live_dir is not None and live_dir != seed_dir:
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
        with self.weights.lock:
            generation, live = self.weights.generation, self.weights.live
        if cmap is None or live is None or live.version != expected.version:
            return

        def still_valid() -> bool:
            if self.weights.generation != generation:
                return False
            if checkpoint_dir is None:  # the seed dir: no pull writes there
                return True
            held = positions.held_version(checkpoint_dir)
            if held is None or held.version != expected.version:
                return False
            return expected.seed is None or key_of_held(held) == expected.key()

        # A shared hold of the host's pull lock: a pull (exclusive) from any co-located rank
        # waits until every rank's proof has read the dir. Without it a trainer that pulls
        # right after a fallback reload voids every proof, and the engine reloads for ever. The
        # hold is bounded (``proof_lock_hold_s``): a pull must not time out behind a long proof.
        steps = prove_map_steps(cmap, self.params(), reader.tensor, still_valid=still_valid,
                                prove_derived=live_derived.prover(self.model()))
        hold = BoundedPullLockHold(checkpoint_dir, proof_lock_hold_s()) if checkpoint_dir is not None else None
        try:
            result, where = self.run_steps(hold.bound(steps) if hold is not None else steps, LOOP_PROOF_TIMEOUT_S)
        except LoopWorkTimeout as exc:
            log.warning("live apply %s: the proof did not finish: %s", self.rank, exc)
            return
        finally:
            if hold is not None:
                hold.release()
        if hold is not None and hold.released_early:
            log.info("live apply %s: the proof held the pull lock for its limit (%.0fs) and ran on unguarded",
                     self.rank, hold.limit_s)
        ok = bool(result)
        log.info("live apply %s: the proof ran %s", self.rank, where)
        log.info("live apply %s: proof %s in %.3fs: %s", self.rank,
                 "done" if ok else "voided (the weights or the checkpoint changed meanwhile)", cmap.proof_s, cmap.proof_reason)

    def prove_after_reload(self, model_path: Optional[str]) -> None:
        """A reload voided the start-up proof: prove against the reloaded dir instead, on a
        thread, once per identity (O(model) work must not repeat after every unproven reload)."""
        expected = self.weights.live
        if expected is None or self.cmap is None or self.cmap.proven or not model_path:
            return
        why_not = self.attempts.begin((os.path.realpath(model_path), expected.key()))
        if why_not is not None:
            log.info("live apply %s: no proof after this reload: %s", self.rank, why_not)
            return
        threading.Thread(
            target=lambda: self._prove_quietly(model_path, expected), name="weightsync-proof", daemon=True
        ).start()

    def _prove_quietly(self, checkpoint_dir: str, expected: LiveVersion) -> None:
        try:
            # the seed dir has no marker and no pull writes there
            self.prove(CheckpointReader(checkpoint_dir), expected,
                       checkpoint_dir=None if self.weights.is_seed_dir(checkpoint_dir) else checkpoint_dir)
        except Exception:
            log.exception("live apply %s: the proof against %s failed", self.rank, checkpoint_dir)
        finally:
            self.attempts.end()
