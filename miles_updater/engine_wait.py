"""The other ranks' wait for rank 0's engine phase: rank 0 says when it is done, and beats meanwhile.

Role: only rank 0 drives the engines (``engine_sync``); every other trainer rank waits for its
word, then returns rank 0's metrics or raises its error. The wait is not a collective: a gloo
group with a timeout breaks for good after its first timeout, and a timeout derived from the
engine calls misses whatever the derivation forgot. Instead, through the process group's store
(the c10d TCPStore every rank already reaches, over a connection of the wait's own):

    rank 0:  begin(): a thread adds 1 to ``<round>/beat`` every ``beat_s`` while the phase runs
             finish(value): stop beating, set ``<round>/done`` = pickled value, add 1 to ``<round>/seen``
    others:  finish(None): a blocking store wait on ``<round>/done``; give up when ``<round>/beat``
             has not moved for ``heartbeat_timeout_s`` (rank 0 hung or gone) or after ``cap_s``
             (an explicit cap); then add 1 to ``<round>/seen``

Whoever brings ``seen`` to the world size (every rank read or gave up, and rank 0 posted)
deletes the round's keys, so the store holds at most a few keys per round in flight. Rounds
are numbered the same on every rank (each ``finish`` is one round) under a namespace agreed at
construction, so a rank that gave up on round n waits on round n+1 next, never on n's leftovers.

Invariants: a waiting rank never waits longer than the heartbeat allows once rank 0 stops
beating; a timeout leaves nothing behind that fails a later round.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
import time
from contextlib import suppress
from typing import Any

log = logging.getLogger(__name__)

BEAT_S = 1.0  # rank 0's heartbeat period


def connect_store(store, timeout_s: float = 120.0):
    """A connection of this process's own to the TCPStore behind ``store`` (PrefixStores unwrapped),
    so a waiting rank's long blocking wait never holds the lock of the connection torch itself
    uses (NCCL's monitor reads the default store); another kind of store is used as it is."""
    import torch.distributed as dist

    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store
    return dist.TCPStore(inner.host, inner.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class EngineWaitTimeout(RuntimeError):
    """A rank other than 0 gave up waiting for rank 0's engine phase; says why and for how long."""


class RankZeroWait:
    """Rank 0's outcome of a phase handed to the other ranks of a group, with a heartbeat.

    Args:
        store: a c10d store every rank of the group reaches (the default store).
        namespace: key prefix agreed by every rank (unique per updater instance).
        rank, world_size: this rank's place in the group.
        heartbeat_timeout_s: the others give up when rank 0 has not beaten for this long.
        cap_s: the others give up after this long whatever the heartbeat says (None: no cap).
        beat_s: rank 0's beat period.
    """

    def __init__(self, store, namespace: str, rank: int, world_size: int, *, heartbeat_timeout_s: float,
                 cap_s: float | None = None, beat_s: float = BEAT_S):
        self.store = store
        self.namespace = namespace.rstrip("/")
        self.rank = rank
        self.world_size = world_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.cap_s = cap_s
        self.beat_s = min(beat_s, heartbeat_timeout_s / 4)
        self.round = 0
        self._beater: threading.Thread | None = None
        self._stop = threading.Event()

    def _key(self, n: int, what: str) -> str:
        return f"{self.namespace}/{n}/{what}"

    # --- rank 0 -------------------------------------------------------------------------------

    def begin(self) -> None:
        """Rank 0, as its phase starts: beat for the current round until ``finish``."""
        if self.rank != 0 or self.world_size == 1 or self._beater is not None:
            return
        key = self._key(self.round, "beat")
        self._stop.clear()

        def beat():
            while not self._stop.wait(self.beat_s):
                try:
                    self.store.add(key, 1)
                except Exception as e:  # noqa: BLE001 - the others see the beat stop, and say so
                    log.warning("engine-wait heartbeat %s failed: %s", key, e)

        self.store.add(key, 1)
        self._beater = threading.Thread(target=beat, name="engine-wait-heartbeat", daemon=True)
        self._beater.start()

    def _stop_beating(self) -> None:
        if self._beater is not None:
            self._stop.set()
            self._beater.join()
            self._beater = None

    # --- every rank ---------------------------------------------------------------------------

    def finish(self, value: Any) -> Any:
        """Rank 0: post ``value`` and return it. Others: return rank 0's value.

        Raises:
            EngineWaitTimeout: (others) rank 0 stopped beating, or the cap passed.
        """
        n = self.round
        self.round += 1
        if self.world_size == 1:
            return value
        if self.rank == 0:
            self._stop_beating()
            self.store.set(self._key(n, "done"), pickle.dumps(value))
            self._seen(n)
            return value
        try:
            return pickle.loads(self._wait_done(n))
        finally:
            self._seen(n)

    def _wait_done(self, n: int) -> bytes:
        # A blocking store wait returns as soon as rank 0 posts (a polled check() would add its
        # period to every sync); it wakes every half heartbeat timeout to read the beat.
        done, beat = self._key(n, "done"), self._key(n, "beat")
        start = last_move = time.monotonic()
        last_beat = self.store.add(beat, 0)
        while True:
            now = time.monotonic()
            deadline = last_move + self.heartbeat_timeout_s
            if self.cap_s is not None:
                deadline = min(deadline, start + self.cap_s)
            window = max(0.01, min(self.heartbeat_timeout_s / 2, deadline - now))
            try:
                self.store.wait([done], datetime.timedelta(seconds=window))
                return self.store.get(done)
            except RuntimeError as e:  # DistStoreError; anything but a timed-out wait is the store failing
                if "timeout" not in str(e).lower():
                    raise
            beats = self.store.add(beat, 0)
            now = time.monotonic()
            if beats != last_beat:
                last_beat, last_move = beats, now
            if self.cap_s is not None and now - start >= self.cap_s:
                raise EngineWaitTimeout(
                    f"rank 0's engine phase did not end within --update-weight-engine-wait-timeout-s "
                    f"{self.cap_s:g} s (it was still alive: {beats} beat(s)); the engines may still reach the "
                    f"version (update_engines_to brings them)")
            if now - last_move >= self.heartbeat_timeout_s:
                raise EngineWaitTimeout(
                    f"rank 0 said nothing for {now - last_move:.1f} s (--update-weight-engine-heartbeat-timeout-s "
                    f"{self.heartbeat_timeout_s:g}) while driving the engines ({beats} beat(s) in all): it hung or "
                    f"is gone")

    def _seen(self, n: int) -> None:
        """Count this rank out of round ``n``; the last one deletes the round's keys."""
        try:
            if self.store.add(self._key(n, "seen"), 1) >= self.world_size:
                for what in ("done", "beat", "seen"):
                    with suppress(Exception):
                        self.store.delete_key(self._key(n, what))
        except Exception as e:  # noqa: BLE001 - cleanup only: never fails a sync
            log.warning("engine-wait cleanup of round %d failed: %s", n, e)

    def abandon(self) -> None:
        """Rank 0, when its phase is interrupted: stop beating and leave the round (the others give
        up on it), so the next round is numbered as theirs."""
        self._stop_beating()
        n = self.round
        self.round += 1
        if self.world_size > 1:
            self._seen(n)

    def close(self) -> None:
        self._stop_beating()


__all__ = ["RankZeroWait", "EngineWaitTimeout", "BEAT_S", "connect_store"]
