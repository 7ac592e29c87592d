"""The per-host pull lock: an exclusive flock on host-local disk.

The lock lives in the local checkpoint dir (host-local disk), never on the shared filesystem:
flock silently succeeds on some NFS and Lustre mounts, which would let two pulls on one host
patch the same bytes at once. A held lock can be handed to another thread (deferred
durability: the flush and the marker finish after the pull has returned).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from typing import Callable, Iterator

from .. import knobs, progress
from ..errors import LockTimeoutError
from ..format.layout import lock_path, sync_dir
from ..fsio import is_pid_alive

log = logging.getLogger(__name__)


class HeldLock:
    def __init__(self, fd: int, path: str, waited_s: float):
        self.fd = fd
        self.path = path
        self.waited_s = waited_s

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1


def acquire_host_lock(
    local_checkpoint_dir: str, timeout_s: float | None = None, give_up: Callable[[], bool] | None = None
) -> HeldLock | None:
    """Take the host's pull lock, waiting up to ``timeout_s`` (0: try once).

    ``give_up`` is asked while waiting; when it answers True the wait ends and None is returned
    (a co-located caller learning that the holder already did its work).
    """
    timeout = float(knobs.LOCK_TIMEOUT_S.get() if timeout_s is None else timeout_s)
    os.makedirs(sync_dir(local_checkpoint_dir), exist_ok=True)
    path = lock_path(local_checkpoint_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    start = time.monotonic()
    next_log = start
    log_every = knobs.LOCK_LOG_EVERY_S.get()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _note_holder(fd)
                return HeldLock(fd, path, time.monotonic() - start)
            except BlockingIOError:
                if give_up is not None and give_up():
                    os.close(fd)
                    return None
                now = time.monotonic()
                if now - start >= timeout:
                    raise LockTimeoutError(path, timeout) from None
                if now >= next_log:
                    progress.notice(f"waiting for the pull lock {path}, held by {_holder(fd)} on this host")
                    next_log = now + log_every
                time.sleep(0.02)
    except BaseException:
        os.close(fd)
        raise


def _note_holder(fd: int) -> None:
    """Write our pid into the lock file, for whoever waits to name (advisory: never read to decide)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _holder(fd: int) -> str:
    """'pid N' of the last exclusive holder when it is alive, else 'another process' (a shared
    holder, such as verify, writes no pid)."""
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        pid = 0
    return f"pid {pid}" if pid > 0 and is_pid_alive(pid) else "another process"


@contextlib.contextmanager
def host_lock(local_checkpoint_dir: str, timeout_s: float | None = None) -> Iterator[float]:
    """Hold the host's pull lock for a block; yields the seconds spent waiting for it."""
    held = acquire_host_lock(local_checkpoint_dir, timeout_s)
    assert held is not None  # no give_up: the wait ends with the lock or an error
    try:
        yield held.waited_s
    finally:
        held.release()


@contextlib.contextmanager
def shared_host_lock(local_checkpoint_dir: str) -> Iterator[None]:
    """Hold the host's pull lock *shared* for a block: readers of the local checkpoint that a
    pull must not rewrite meanwhile (several at once; a pull, exclusive, waits for them all).
    Waits out a pull or its deferred flush in progress."""
    os.makedirs(sync_dir(local_checkpoint_dir), exist_ok=True)
    fd = os.open(lock_path(local_checkpoint_dir), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the description releases the lock
