"""The writer lease of a source dir: one publisher (rank 0) commits at a time.

A restarted trainer may start publishing while the old process still encodes. The newer
publisher takes the lease (``weightsync-writer.json``: an epoch one above the last, and a random
token) before it writes anything; the older one checks the lease before every index it writes
and fails loud (``SupersededPublisherError``) once the token is not its own. So the older one
never commits after the newer one started, and never takes the newer one's landed index for its
own (a committed version's files are never replaced: shard names are content-derived, and a
complete index is never written over).

The lease lives beside ``weightsync-run.json``, not in it: the run identity is read by every pull
(the marker binds to it) and stays as written, while the lease changes with every publisher
start. Upstream readers and writers never look at it.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import msgspec

from ..errors import SupersededPublisherError
from ..fsio import fsync_dir, write_bytes

WRITER_NAME = "weightsync-writer.json"


class Lease(msgspec.Struct, frozen=True):
    epoch: int
    token: str
    pid: int = 0
    host: str = ""
    since_unix_s: float = 0.0

    def who(self) -> str:
        return f"pid {self.pid} on {self.host or '?'}"


def lease_path(source_dir: str) -> str:
    return os.path.join(source_dir, WRITER_NAME)


def read_lease(source_dir: str) -> Lease | None:
    try:
        with open(lease_path(source_dir), "rb") as f:
            return msgspec.json.decode(f.read(1 << 12), type=Lease)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def take_lease(source_dir: str, *, atomic: bool) -> Lease:
    """Take the writer lease: an epoch above the current one, under a fresh token. Fails loud
    when another publisher took it at the same moment (the last write wins; the loser sees it)."""
    current = read_lease(source_dir)
    mine = Lease((current.epoch if current is not None else 0) + 1, uuid.uuid4().hex, os.getpid(),
                 socket.gethostname(), time.time())
    os.makedirs(source_dir, exist_ok=True)
    write_bytes(lease_path(source_dir), msgspec.json.encode(mine), atomic=atomic)
    fsync_dir(source_dir)
    check_lease(source_dir, mine, "taking the writer lease")
    return mine


def check_lease(source_dir: str, mine: Lease, what: str) -> None:
    """Raise SupersededPublisherError unless the lease on disk is still ``mine``."""
    current = read_lease(source_dir)
    if current is not None and current.token == mine.token:
        return
    raise SupersededPublisherError(
        source_dir, mine.epoch, current.epoch if current is not None else None,
        current.who() if current is not None else "the lease file is gone or unreadable", what,
    )


__all__ = ["Lease", "WRITER_NAME", "read_lease", "take_lease", "check_lease", "lease_path"]
