"""The per-host pull lock: an exclusive flock on host-local disk.

The lock lives in the local checkpoint dir (host-local disk), never on the shared filesystem:
flock silently succeeds on some NFS and Lustre mounts, which would let two pulls on one host
patch the same bytes at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from typing import Iterator

from . import knobs
from .errors import LockTimeoutError
from .layout import lock_path, sync_dir

log = logging.getLogger(__name__)


@contextlib.contextmanager
def host_lock(local_checkpoint_dir: str, timeout_s: float | None = None) -> Iterator[float]:
    """Hold the host's pull lock; yields the seconds spent waiting for it.

    ``timeout_s=0`` tries once (a caller that wants "conflict" rather than a queue).
    """
    timeout = float(knobs.LOCK_TIMEOUT_S.get() if timeout_s is None else timeout_s)
    os.makedirs(sync_dir(local_checkpoint_dir), exist_ok=True)
    path = lock_path(local_checkpoint_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_log = start
        log_every = knobs.LOCK_LOG_EVERY_S.get()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= timeout:
                    raise LockTimeoutError(path, timeout) from None
                if now >= next_log:
                    log.info("waiting for the pull lock %s (held by another pull on this host)", path)
                    next_log = now + log_every
                time.sleep(0.02)
        waited = time.monotonic() - start
        try:
            yield waited
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
