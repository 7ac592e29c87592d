"""The pending version: the one version this rank wrote whose commit is not confirmed yet.

A failed publish of vN leaves vN pending, and one rule follows (``Publisher``'s docstring): vN is
finished with the bytes it was given (a retry reuses what was written, checked to be the same
bytes), or given up (``discard``: its files go, index first). This unit keeps the pending version
and those checks; the ``Publisher`` decides when to stage, confirm, finish or discard.

Invariant: a version is staged only after this rank's shards are durable, and the snapshot then
holds its bytes (the snapshot's own buffers are what a retry writes again).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Mapping

import msgspec
import numpy as np

from ..errors import PendingVersionError, PublishError
from ..format.layout import INDEX_NAME, anchor_dir, version_dir
from ..fsio import fsync_dir
from .encode import PreparedVersion
from .snapshot import RawTensor, Snapshot


class Staged(msgspec.Struct):
    """A version this rank wrote whose commit is not confirmed yet: what a retry reuses."""

    version: int
    kind: str
    prepared: PreparedVersion  # its tensors' ``new`` are the snapshot's own buffers
    manifest: Any = None  # the ShardManifest write() wrote (a landed index must name exactly these shards)


class PendingVersion:
    """The staged version of one rank (None: nothing pending) and the checks a retry of it passes."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot
        self.staged: Staged | None = None

    @property
    def version(self) -> int | None:
        return self.staged.version if self.staged is not None else None

    def stage(self, prepared: PreparedVersion, kind: str) -> Staged:
        """Take the written bytes into the snapshot and keep what a retry reuses."""
        entries = self.snapshot.entries
        changed: list[tuple[str, np.ndarray, str | None]]
        if prepared.encoded:
            changed = [(t.name, t.new, t.digest) for t in prepared.tensors if t.payload is not None]
        else:  # not compared: any passed tensor may have changed, and no digest was computed
            changed = [(t.name, t.new, None) for t in prepared.tensors if t.new is not entries[t.name].buf]
        self.snapshot.advance(prepared.version, changed)
        own = [msgspec.structs.replace(t, new=entries[t.name].buf) for t in prepared.tensors]
        self.staged = Staged(prepared.version, kind, msgspec.structs.replace(prepared, tensors=own))
        return self.staged

    def check_same_bytes(self, tensors: Mapping[str, "RawTensor | np.ndarray"]) -> None:
        """A retry of the staged version passes exactly the bytes it was written with."""
        assert self.staged is not None
        jobs = self.snapshot.jobs(tensors)
        differ = self.snapshot.differing_bytes([(j.name, j.new) for j in jobs])
        if differ:
            raise other_bytes_error(self.staged.version, differ)

    def same_prepared(self, prepared: PreparedVersion) -> PreparedVersion:
        """write() again with another prepared object of the staged version: the staged one,
        when it holds the same bytes."""
        assert self.staged is not None
        differ = self.snapshot.differing_bytes([(t.name, t.new) for t in prepared.tensors])
        if differ:
            raise other_bytes_error(self.staged.version, differ)
        return self.staged.prepared


def other_bytes_error(version: int, differ: list[str]) -> PublishError:
    return PendingVersionError(version, (
        f"v{version} was already written by this rank with other bytes for tensors {differ[:5]}; "
        f"a retry of v{version} must pass the same bytes (its index has not landed, so nothing is lost)"
    ))


def remove_version_files(source_dir: str, version: int) -> None:
    """A discarded version's files (never committed): its side anchor's and its own, each
    index first (an anchor's index lands before the version's: it goes first)."""
    vdir, adir = version_dir(source_dir, version), anchor_dir(source_dir, version)
    for index in (os.path.join(adir, INDEX_NAME), os.path.join(vdir, INDEX_NAME)):
        if os.path.lexists(index):
            os.unlink(index)
    shutil.rmtree(adir, ignore_errors=True)
    shutil.rmtree(vdir, ignore_errors=True)
    fsync_dir(source_dir)


__all__ = ["PendingVersion", "Staged", "other_bytes_error", "remove_version_files"]
