"""What one rank's live weights hold, as far as live apply can tell: the live version and its
identity, the weights' generation, and the update staged for them.

- **The live version** (``identity.LiveVersion``): version, source dir, run and seed
  fingerprint, as the core's marker records them; at start-up version 0 (the seed dir the
  engine loaded, fingerprinted then). After a reload from a local checkpoint dir
  (``/update_weights_from_disk`` or our reload phase) it is what that dir named before the
  reload, if it names the same after it and no pull ran meanwhile (``identity.reload_outcome``);
  after any other weight update (another path, tensors, distributed, IPC) it is unknown until
  the next reload from a dir.
- **The generation**: every write of the weights bumps it (a reload, any other writer of sglang's
  in ``compat.WEIGHT_WRITERS``, and our own apply, commit and rollback), which voids a proof or a
  staging in flight; a transaction checks it at every phase (``apply.RankWrites``), so another
  writer landing between two phases is never taken for our own writes. ``changed_by`` says what
  bumped it last.
- **The staged slot**: the update staging made for the current generation, or why there is none.

Every field is read and written under ``lock``: the pull thread stages, the map thread proves,
the scheduler thread votes and applies.

Test-only switches (environment, read by the scheduler processes):
``WEIGHTSYNC_TEST_RELOAD_DELAY_S``: every reload takes that much longer, as a real model's does;
``WEIGHTSYNC_TEST_RELOAD_GATE``: a reload waits between its load and its reading of the dir's
identity (see ``_wait_at_reload_gate``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import weightsync.puller.positions as positions
from weightsync.puller.identity import seed_fingerprint as fingerprint_seed

from .identity import LiveVersion, ReloadWitness, from_held, reload_outcome, seed_version
from .scatter.patch import StagedUpdate

log = logging.getLogger(__name__)

RELOAD_GATE_ENV = "WEIGHTSYNC_TEST_RELOAD_GATE"
RELOAD_DELAY_ENV = "WEIGHTSYNC_TEST_RELOAD_DELAY_S"


class LiveWeights:
    """One rank's live version, generation and staged slot (see the module docstring)."""

    def __init__(self, *, rank: str, seed_dir: Optional[str], pull_is_running: Callable[[], bool]) -> None:
        self.rank = rank
        self.seed_dir = seed_dir
        self.pull_is_running = pull_is_running
        self.lock = threading.Lock()
        self.generation = 0
        self.changed_by = "nothing since start-up"  # the last write of the weights (for the replies)
        # v0's identity is the seed's fingerprint, taken now (right after sglang loaded it)
        self.live: Optional[LiveVersion] = seed_version(fingerprint_seed(seed_dir)) if seed_dir else None
        self.live_reason = "" if seed_dir else "the engine's model path is not a local dir"
        # the dir of the last load that named a verified version (a map built later is proven against it)
        self.live_dir: Optional[str] = seed_dir
        self.staged: Optional[StagedUpdate] = None
        self.stage_reason: Optional[str] = "nothing staged yet (pull the target version first)"
        self._reload_witness: Optional[ReloadWitness] = None
        self._reload_started: Optional[float] = None

    def describe(self) -> str:
        return self.live.describe() if self.live else f"unknown ({self.live_reason})"

    def is_seed_dir(self, path: Optional[str]) -> bool:
        return bool(path and self.seed_dir and os.path.realpath(path) == os.path.realpath(self.seed_dir))

    def identity_of_dir(self, path: Optional[str]) -> Optional[LiveVersion]:
        """What a load of ``path`` now would give: its marker's (or verified note's) version and
        origin; the seed dir is v0 with its fingerprint now; None: no verified version."""
        if not path or not os.path.isdir(path):
            return None
        held = positions.held_version(path)
        if held is not None:
            return from_held(held, f"reload from {path} ({held.how})")
        return seed_version(fingerprint_seed(path), f"reload from the seed dir {path}") if self.is_seed_dir(path) else None

    # --- weight updates ------------------------------------------------------------------------

    def begin_reload(self, model_path: Optional[str]) -> None:
        """Before sglang's update_weights_from_disk (ours or anyone's): what the dir names now."""
        before = self.identity_of_dir(model_path)
        witness = ReloadWitness(model_path, before.key() if before else None, self.pull_is_running())
        with self.lock:
            self._bump(f"a reload from {model_path} (update_weights_from_disk)")
            self.staged = None
            self._reload_witness = witness
        self._reload_started = time.perf_counter()

    def after_reload(self, model_path: Optional[str], success: bool) -> Optional[float]:
        """After sglang's update_weights_from_disk (ours or anyone's): the live version is what
        the dir named before the reload, if it names the same now and no pull ran meanwhile.
        Returns the reload's pause when it succeeded (what the mode is chosen by)."""
        _test_reload_delay()
        reload_s = None
        if success and self._reload_started is not None:
            reload_s = time.perf_counter() - self._reload_started
        self._reload_started = None
        _wait_at_reload_gate(self.rank)
        after = self.identity_of_dir(model_path) if success else None
        with self.lock:
            witness, self._reload_witness = self._reload_witness, None
        why = reload_outcome(witness, model_path, success, after.key() if after else None, self.pull_is_running())
        with self.lock:
            self._bump(f"a reload from {model_path} (update_weights_from_disk)")
            self.staged = None
            self.stage_reason = "the weights were reloaded after the last staging"
            if why is None and after is not None:
                self.live, self.live_reason, self.live_dir = after, "", model_path
            else:
                self.live, self.live_dir = None, None
                self.live_reason = why or f"a reload from {model_path} named no version"
        log.info("live apply %s: live version now %s", self.rank, self.describe())
        return reload_s

    def after_other_update(self, how: str) -> None:
        self.forget(f"the weights were last updated through {how}")

    def forget(self, reason: str) -> None:
        """The weights hold no version live apply can name (until the next reload from a dir)."""
        with self.lock:
            self._bump(reason)
            self.staged, self.live, self.live_dir = None, None, None
            self.live_reason = reason
            self.stage_reason = reason

    def _bump(self, why: str) -> int:
        """The weights were written (call under ``lock``); the new generation."""
        self.generation += 1
        self.changed_by = why
        return self.generation

    def moved_since(self, generation: int) -> Optional[str]:
        """What wrote the weights since ``generation`` (None: nothing did)."""
        with self.lock:
            return None if self.generation == generation else self.changed_by

    def written_by_us(self, generation: int, why: str) -> Optional[int]:
        """Our own transaction wrote the weights (an apply or a restore), which it holds at
        ``generation``: bump it, so that a staging that read them meanwhile is voided. None, and
        nothing bumped, when another writer moved them since ``generation``."""
        with self.lock:
            if self.generation != generation:
                return None
            return self._bump(why)

    def restored(self, generation: int, staged: Optional[StagedUpdate]) -> Optional[int]:
        """A rollback wrote the undo log back, proven equal: bump the generation (a staging that
        read the weights mid-transaction is voided) and keep ``staged`` in the slot, valid for a
        retry: the weights hold exactly the bytes it was staged against. None when another writer
        moved the weights since ``generation``."""
        with self.lock:
            if self.generation != generation:
                return None
            new = self._bump("a live apply's rollback")
            if staged is not None and self.staged is staged:
                staged.generation = new
            return new

    def take_applied(self, staged: StagedUpdate, generation: Optional[int] = None) -> bool:
        """A live apply of ``staged`` committed: the weights hold its target. False (nothing taken)
        when another writer moved the weights since ``generation`` (the transaction's)."""
        with self.lock:
            if generation is not None and self.generation != generation:
                return False
            self._bump(f"a live apply of v{staged.to_version}")
            self.live = staged.target  # the identity the local checkpoint named when staged
            self.live_reason = "" if staged.target is not None else "a live apply of an update staged without an identity"
            self.staged = None
            self.stage_reason = f"v{staged.to_version} was applied; nothing staged since"
            return True

    # --- the staged slot -----------------------------------------------------------------------

    def begin_staging(self) -> tuple[int, Optional[LiveVersion]]:
        """Empty the slot; ``(generation, live)`` to stage against."""
        with self.lock:
            self.staged = None
            return self.generation, self.live

    def finish_staging(self, generation: int, staged: Optional[StagedUpdate], reason: Optional[str]) -> Optional[StagedUpdate]:
        """Fill the slot, unless the weights changed since ``begin_staging``; what it now holds."""
        with self.lock:
            if self.generation != generation:
                staged, reason = None, "the weights changed while the update was being staged"
            self.staged, self.stage_reason = staged, reason
            return staged


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
