"""Where a publisher's versions go, behind one small interface, so the publisher never asks
whether it holds a directory or a bucket:

- ``dir``: the local directory the publisher writes into and commits in (the source dir itself,
  or a bucket's host-local staging copy, ``storage.bucket_publish``);
- ``name``: what readers call it (the dir, or the bucket URL): errors name it, not ``dir``;
- ``write_run_identity(atomic)``: the run file, created once (a bucket's was settled when it was
  opened: created only if absent in the bucket, and copied into the staging dir);
- ``publish_committed()``: after each commit, make what was committed in ``dir`` visible to
  readers (a directory: it already is; a bucket: shards uploaded, then the index created only
  if absent);
- ``mirror_pruned()``: after pruning ``dir``, remove the same versions where readers look
  (a bucket: index first, then its shards);
- ``hold_lease(record, what)``: the writer lease (``publisher.lease``, taken in ``dir``) where
  every other publisher of the run sees it too (a directory: ``dir`` is that place; a bucket:
  its lease object, put once and checked before every index it creates).

``open_destination`` refuses, before anything is written, what cannot be published into (an
HTTP(S) source is read-only).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Protocol

from ..errors import InvalidRequestError
from ..format.layout import run_path
from ..format.manifest import encode_run_identity
from ..fsio import fsync_dir, write_bytes
from .url import is_bucket_url


class Destination(Protocol):
    @property
    def dir(self) -> str: ...

    @property
    def name(self) -> str: ...

    def write_run_identity(self, atomic: bool) -> None: ...

    def publish_committed(self) -> None: ...

    def mirror_pruned(self) -> None: ...

    def hold_lease(self, record: bytes, what: str) -> None: ...


class DirectoryDestination:
    """A directory readers read directly: a commit in it is the publication."""

    def __init__(self, path: str):
        self.dir = path
        self.name = path

    def write_run_identity(self, atomic: bool) -> None:
        write_run_identity(self.dir, atomic)

    def publish_committed(self) -> None:
        pass

    def mirror_pruned(self) -> None:
        pass

    def hold_lease(self, record: bytes, what: str) -> None:
        pass  # the lease file is in this dir already, where every publisher of it looks


def write_run_identity(directory: str, atomic: bool) -> None:
    """The run file of ``directory``, created with a fresh id when absent (never replaced)."""
    path = run_path(directory)
    if os.path.exists(path):
        return
    write_bytes(path, encode_run_identity(uuid.uuid4().hex, time.time()), atomic=atomic)
    fsync_dir(directory)


def open_destination(source_dir: str, rank: int, world_size: int) -> "Destination":
    """The destination ``Publisher(source_dir)`` writes to: a bucket URL (its target, after
    refusing a store without conditional create and settling the run identity), or a directory."""
    if isinstance(source_dir, str) and source_dir.startswith(("http://", "https://")):
        # An HTTP(S) source is read-only (docs/FLEET.md): publish into the dir or bucket it serves.
        raise InvalidRequestError(
            f"{source_dir} is an HTTP(S) source, which is read-only: publish into the directory or bucket "
            "that server (or cache) serves, and let the engines pull from the URL"
        )
    if is_bucket_url(source_dir):
        from .bucket_publish import open_bucket_target

        return open_bucket_target(source_dir, rank, world_size)
    return DirectoryDestination(source_dir)


__all__ = ["Destination", "DirectoryDestination", "open_destination", "write_run_identity"]
