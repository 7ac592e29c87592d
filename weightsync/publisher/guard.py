"""The publisher's refusals: each one before this publisher writes anything.

- the version number: at least 1, and the newest committed version plus one (a full version
  may open an empty source dir at any number: a run continuing its numbering in a fresh dir);
- a delta's base: the snapshot the caller seeded must hold what the previous version records
  (``records.recorded_state``), checked once per seeded snapshot;
- a full version's layout: the tensor set, dtypes and shapes of the version before it, unless
  the caller allows a layout change (the index then records it);
- a version already committed: an identical retry is told so, other bytes are a conflict;
- another writer: the writer lease (``lease``) is taken before the first write and checked
  before every index; a landed index is counted as this publisher's only when it names exactly
  the shards this publisher wrote (content-derived names).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from ..errors import (
    BaseMismatchError,
    LayoutChangeError,
    VersionAlreadyPublishedError,
    VersionConflictError,
    VersionNumberError,
)
from ..format.checksum import new_hasher
from ..format.manifest import read_version_index
from .lease import Lease, check_lease, take_lease
from .records import RecordedState, SeedRecord, is_published, newest_committed_version, recorded_layout, recorded_state
from .snapshot import EncodeJob, Snapshot

LAYOUT_CHANGE_KEY = "layout_change"  # a full version's index metadata: the caller allowed a layout change


class PublishGuard:
    def __init__(self, source_dir: str, checksum: str, world_size: int, pool: ThreadPoolExecutor, atomic: bool):
        self.source_dir = source_dir
        self.checksum = checksum
        self.world_size = world_size
        self.pool = pool
        self.atomic = atomic
        self.lease: Lease | None = None
        self.base_checked: int | None = None  # the snapshot version whose bytes are known to be right
        self.seed: SeedRecord | None = None  # this rank's seed digests (v1's delta records them)

    # --- the number ---------------------------------------------------------------------------

    def check_number(self, version: int, full: bool) -> None:
        """Refuse a version that does not follow the newest committed one (see module doc)."""
        newest = newest_committed_version(self.source_dir)
        if version < 1:
            raise VersionNumberError(version, newest + 1, newest, self.source_dir, "; version 0 is the seed dir "
                                     "(the engine's own model) and is never published")
        if version <= newest:
            if is_published(self.source_dir, version):
                raise VersionAlreadyPublishedError(version, self.source_dir)
            raise VersionNumberError(version, newest + 1, newest, self.source_dir,
                                     f"; v{version} is below it and no longer on disk (pruned)")
        if version > newest + 1 and not (newest == 0 and full):
            raise VersionNumberError(version, newest + 1, newest, self.source_dir)

    # --- the base of a delta -------------------------------------------------------------------

    def check_base(self, version: int, snapshot: Snapshot) -> None:
        """The snapshot (a delta's base) holds what version - 1 records; once per seeded snapshot."""
        if self.base_checked == snapshot.version:
            return
        base = version - 1
        rec = recorded_state(self.source_dir, base)
        names = sorted(snapshot.entries)
        wanted = [n for n in names if n in rec.digests or base == 0]
        actual = dict(self.pool.map(lambda n: (n, self._digest(snapshot, n, rec)), wanted))
        mismatches = [(n, rec.digests[n][1], actual[n][1]) for n in names if n in rec.digests and rec.digests[n][1] != actual[n][1]]
        missing: list[str] = []
        extra: list[str] = []
        if rec.names is not None and self.world_size == 1:  # one rank holds every tensor
            missing, extra = sorted(rec.names - set(names)), sorted(set(names) - rec.names)
        if mismatches or missing or extra:
            fmt = rec.digests[mismatches[0][0]][0] if mismatches else ""
            raise BaseMismatchError(version, base, mismatches, missing, extra, fmt)
        if base == 0:
            own = {n: d for n, (fmt, d) in actual.items() if fmt == self.checksum}
            layout = {n: (e.dtype, tuple(e.shape)) for n, e in snapshot.entries.items()}
            self.seed = SeedRecord(self.checksum, own, layout) if len(own) == len(names) else None
        self.base_checked = snapshot.version

    def _digest(self, snapshot: Snapshot, name: str, rec: RecordedState) -> tuple[str, str]:
        entry = snapshot.entries[name]
        fmt = rec.digests[name][0] if name in rec.digests else self.checksum
        if fmt == self.checksum and entry.digest:
            return fmt, entry.digest
        h = new_hasher(fmt)
        h.update(entry.buf)
        digest = h.hexdigest()
        if fmt == self.checksum:
            entry.digest = digest  # the snapshot's cache of its digest, in the publisher's checksum
        return fmt, digest

    # --- the layout of a full version ----------------------------------------------------------

    def check_layout(self, version: int, tensors: Iterable[tuple[str, str, tuple[int, ...]]], *, complete: bool,
                     allowed: bool) -> None:
        """A full version keeps the layout of version - 1 (``complete``: ``tensors`` is the whole set)."""
        if allowed:
            return
        layout, _ = recorded_layout(self.source_dir, version - 1)
        if layout is None:
            return  # nothing recorded to compare with (an upstream run, a fresh dir): nothing to refuse
        changes = []
        given = set()
        for name, dtype, shape in sorted(tensors):
            given.add(name)
            old = layout.get(name)
            if old is None:
                changes.append(f"adds tensor {name} ({dtype} {list(shape)})")
            elif (dtype, tuple(shape)) != (old[0], tuple(old[1])):
                changes.append(f"tensor {name} was {old[0]} {list(old[1])}, is {dtype} {list(shape)}")
        if complete:
            changes += [f"drops tensor {n}" for n in sorted(set(layout) - given)]
        if changes:
            raise LayoutChangeError(version, version - 1, changes)

    # --- a version already committed ------------------------------------------------------------

    def identical_kind(self, version: int, jobs: list[EncodeJob]) -> str:
        """The committed version's kind when ``jobs`` hold exactly its bytes; else VersionConflictError
        (other bytes) or VersionAlreadyPublishedError (what it records cannot tell)."""
        rec = recorded_state(self.source_dir, version)
        names = {j.name for j in jobs}
        if rec.names is not None and rec.names != names:
            raise VersionConflictError(version, self.source_dir, (
                f" with another tensor set (it holds {len(rec.names)} tensors, {len(names)} given; "
                f"missing {sorted(rec.names - names)[:5]}, extra {sorted(names - rec.names)[:5]})"))
        unknown = sorted(names - rec.digests.keys())
        if unknown:
            raise VersionAlreadyPublishedError(version, self.source_dir, (
                f" (what it records, up to {rec.reached}, has no digest for tensors {unknown[:5]}: "
                "cannot tell whether these bytes are the same)"))

        def differs(job: EncodeJob) -> tuple[str, str, str] | None:
            fmt, recorded = rec.digests[job.name]
            h = new_hasher(fmt)
            h.update(job.new)
            actual = h.hexdigest()
            return None if actual == recorded else (job.name, recorded, actual)

        bad = sorted(d for d in self.pool.map(differs, jobs) if d is not None)
        if bad:
            n, e, a = bad[0]
            raise VersionConflictError(version, self.source_dir, (
                f" with other bytes: tensor {n} differs first (recorded {e}, given {a}; {len(bad)} differ)"))
        return read_version_index(self.source_dir, version).kind

    def check_landed_is_ours(self, version: int, weight_maps: Iterable[dict[str, str]]) -> None:
        """A complete index found where this publisher was about to commit counts as its own only
        when it maps every tensor this publisher wrote to the very shard it wrote (the names are
        content-derived: another writer's bytes have other names)."""
        idx = read_version_index(self.source_dir, version)
        for wmap in weight_maps:
            differ = sorted(n for n, f in wmap.items() if idx.weight_map.get(n) != f)
            if differ:
                raise VersionConflictError(version, self.source_dir, (
                    f" by another writer: its index maps tensors {differ[:5]} to other shards than the ones this "
                    "publisher wrote; this publisher did not commit, and wrote nothing over the committed version"))

    # --- the writer lease ------------------------------------------------------------------------

    def hold_lease(self, what: str) -> None:
        """Take the writer lease on first use, then check it is still this publisher's (rank 0)."""
        if self.lease is None:
            os.makedirs(self.source_dir, exist_ok=True)
            self.lease = take_lease(self.source_dir, atomic=self.atomic)
            return
        check_lease(self.source_dir, self.lease, what)


__all__ = ["PublishGuard", "LAYOUT_CHANGE_KEY"]
