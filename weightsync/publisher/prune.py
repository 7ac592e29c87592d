"""Prune what no cheap pull needs, in O(1) amortized per commit.

*Anchor points* are full versions and side anchors (``anchor_vNNNNNN/``). The *prune point* P is
the newer of the newest full version F and the second-newest anchor point A2:

- nothing below F is read by a pull to a target at or above F (a chain cannot cross a full
  version: a pull seeds from it or from a newer anchor);
- a plan that chains across A2 reads the deltas between A2 and the newest anchor point, which
  weigh about one full size (the anchor budget): seeding from the newest anchor costs no
  more, so the planner takes that, and nothing below A2 is needed either.

Only an anchor bound to its version (``manifest.check_anchor``: both indexes name one commit
id) is an anchor point: a pull may seed only from such an anchor, so only it makes the chain
below it prunable. An anchor of an earlier attempt at a version now committed without it, or
with another commit id (an orphan), is deleted; one without a commit id (an older publisher's)
is never an anchor point and goes once it falls below P.

Versions below P go, except the newest ``keep``; side anchors below P go. A kept version below P
lowers P to the anchor point under it, so that what is kept can still be pulled by a fresh host. Each is deleted once,
index first, so a reader never sees a half-deleted version as published. The publisher keeps
this record itself (a restarted one scans the source dir once), so a commit reads no index.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import deque
from typing import NamedTuple

from ..errors import WeightSyncError
from ..format.file_digests import FileDigest, read_file_digests
from ..format.layout import anchor_dir, index_path, list_anchors, list_versions, version_dir
from ..format.manifest import VersionIndex, check_anchor, is_committed, read_version_index
from ..fsio import fsync_dir

log = logging.getLogger(__name__)


class Retention:
    """What the source dir holds, as far as pruning cares: versions, and the anchor points."""

    def __init__(self, source_dir: str, keep: int):
        self.source_dir = source_dir
        self.keep = max(0, int(keep))
        self.versions: deque[int] = deque()  # on disk, ascending
        self.fulls: deque[int] = deque()  # full versions still on disk, ascending
        self.anchors: deque[int] = deque()  # side anchors still on disk, ascending
        self.points: deque[int] = deque()  # anchor points (fulls and bound side anchors), ascending
        self.orphans: list[int] = []  # side anchors of an earlier attempt at a committed version
        self.unreadable: dict[int, str] = {}  # versions whose index could not be read at load: why

    def load(self, upto: int | None = None) -> None:
        """Scan the source dir once (a restarted publisher, or the command line)."""
        indexes = {}
        for v in list_versions(self.source_dir):
            if upto is not None and v > upto:
                continue
            try:
                indexes[v] = read_version_index(self.source_dir, v)
                kind = indexes[v].kind
            except (WeightSyncError, RecursionError) as e:
                kind = None  # unpublished or broken: still a version dir to prune in turn
                if is_committed(version_dir(self.source_dir, v)):  # complete but unreadable now: flag it
                    self.unreadable[v] = f"{type(e).__name__}: {e}"
                    log.warning("v%d: its index is unreadable (%s); its side anchor, if any, is kept", v, e)
            self.versions.append(v)
            if kind == "full":
                self.fulls.append(v)
                self.points.append(v)
        newest = max(indexes, default=None)
        bound = []
        for a in list_anchors(self.source_dir):
            if upto is not None and a > upto:
                continue
            if a in self.unreadable:
                # Its version's index cannot be read right now (damaged, mid-restore): whether the
                # anchor is bound is unknown, so it stays, and is no anchor point for this prune.
                # An anchor is deleted only with its version, or once its version's index,
                # read fine, names another commit id.
                self.anchors.append(a)
                continue
            check = check_anchor(self.source_dir, a, indexes.get(a))
            if check.state == "bound":
                bound.append(a)
            elif check.state == "orphan" or (
                a not in indexes and newest is not None and a < newest and not os.path.isdir(version_dir(self.source_dir, a))
            ):
                # Its version is committed without it, or gone below a committed version
                # (removed after a failed attempt): no pull can ever use it.
                self.orphans.append(a)
                continue
            if check.state != "pending" or a <= (newest or 0):
                self.anchors.append(a)  # on disk: deleted once below the prune point
        self.points = deque(sorted(set(self.points) | set(bound)))

    def since_anchor(self, upto: int) -> tuple[int, int]:
        """(bytes, count) of the delta versions after the newest anchor point at or below ``upto``."""
        newest = max((p for p in self.points if p <= upto), default=0)
        nbytes = count = 0
        for v in self.versions:
            if newest < v <= upto:
                try:
                    idx = read_version_index(self.source_dir, v)
                except WeightSyncError:
                    continue
                count += 1
                nbytes += _version_nbytes(idx)
        return nbytes, count

    def record(self, version: int, kind: str, anchor: bool) -> None:
        if not self.versions or self.versions[-1] < version:
            self.versions.append(version)
        if kind == "full":
            self.fulls.append(version)
        if anchor:
            self.anchors.append(version)
        if kind == "full" or anchor:  # an anchor this publisher wrote is bound: it wrote both indexes
            self.points.append(version)

    def prune_point(self) -> int | None:
        candidates = []
        if self.fulls:
            candidates.append(self.fulls[-1])
        if len(self.points) >= 2:
            candidates.append(self.points[-2])
        if not candidates:
            return None
        return self._keep_pullable(max(candidates))

    def _keep_pullable(self, point: int) -> int | None:
        """Lower ``point`` so that every kept version stays pullable by a fresh host: a kept
        delta below the point needs the anchor point under it and the chain from there (a kept
        v4 whose full v3 went would be on disk yet unservable). None: a kept version chains from
        the seed dir, so no version may go."""
        if self.keep == 0 or not self.versions:
            return point
        oldest_kept = self.versions[-min(self.keep, len(self.versions))]
        if oldest_kept >= point:
            return point
        # The points queue holds only what is at or above the last prune point: short.
        return max((q for q in self.points if q <= oldest_kept), default=None)

    def doomed(self) -> tuple[list[int], list[int]]:
        """(versions, side anchors) that pruning would delete now (orphaned anchors included)."""
        p = self.prune_point()
        if p is None:
            return [], sorted(self.orphans)
        n_old = max(0, len(self.versions) - self.keep)
        versions = [v for i, v in enumerate(self.versions) if i < n_old and v < p and v not in self.unreadable]
        staying = set(self.versions) - set(versions)
        return versions, sorted(set(self.orphans) | {a for a in self.anchors if a < p and a not in staying})

    def prune(self) -> list[int]:
        """Delete what ``doomed`` names; returns the versions deleted. Amortized O(1) per commit:
        only the front of each queue is looked at, and each item leaves once."""
        while self.orphans:
            a = self.orphans.pop()
            _delete(anchor_dir(self.source_dir, a))
            log.info("pruned side anchor of v%d: an earlier attempt's, not bound to the committed v%d", a, a)
        p = self.prune_point()
        if p is None:
            return []
        gone: list[int] = []
        skipped: list[int] = []
        while len(self.versions) - len(skipped) > self.keep and self.versions[0] < p:
            v = self.versions.popleft()
            if v in self.unreadable:  # flagged, not judged: it may be mid-restore; a later prune sees it again
                skipped.append(v)
                log.warning("prune: kept v%d, its index is unreadable (%s)", v, self.unreadable[v])
                continue
            _delete(version_dir(self.source_dir, v))
            gone.append(v)
            log.info("pruned v%d (older than the prune point v%d)", v, p)
        self.versions.extendleft(reversed(skipped))
        kept_anchors: list[int] = []
        while self.anchors and self.anchors[0] < p:
            a = self.anchors.popleft()
            if a in self.versions:  # an anchor goes only with its own version
                kept_anchors.append(a)
                continue
            _delete(anchor_dir(self.source_dir, a))
            log.info("pruned side anchor of v%d (older than the prune point v%d)", a, p)
        self.anchors.extendleft(reversed(kept_anchors))
        while self.fulls and self.fulls[0] < p:
            self.fulls.popleft()
        while self.points and self.points[0] < p:
            self.points.popleft()
        if gone:
            fsync_dir(self.source_dir)
        return gone


def _version_nbytes(idx: VersionIndex) -> int:
    """The bytes of a version's payload files, as its index's ``file_digests`` records them; a
    file it records no size for is sized on disk (an upstream writer's or an older publisher's
    index). Not from disk first: with a staging copy per node (``storage.rank_reports``) a rank's
    copy holds only its own shards, and ranks that sized from disk would disagree on whether a
    side anchor is due after a restart."""
    recorded = _recorded_file_digests(idx.path)
    total = 0
    for fname in set(idx.weight_map.values()):
        if fname in recorded:
            total += recorded[fname].nbytes
            continue
        try:
            total += os.path.getsize(os.path.join(idx.path, fname))
        except OSError:
            pass  # neither recorded nor here: it adds nothing (as before the index recorded sizes)
    return total


def _recorded_file_digests(directory: str) -> dict[str, FileDigest]:
    """The index's well-formed ``file_digests`` entries; none when it has no such key, or when the
    index cannot be read again (gone meanwhile: the version was pruned, its bytes count no more)."""
    try:
        with open(index_path(directory), "rb") as f:
            obj = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return {}
    return read_file_digests(obj)


def _delete(directory: str) -> None:
    try:
        os.unlink(index_path(directory))  # first: the dir stops being published
    except FileNotFoundError:
        pass
    fsync_dir(directory)
    shutil.rmtree(directory, ignore_errors=True)


def newest_full_version(source_dir: str) -> int | None:
    for v in reversed(list_versions(source_dir)):
        try:
            if read_version_index(source_dir, v).kind == "full":
                return v
        except WeightSyncError:
            continue  # an unpublished or broken version anchors nothing
    return None


def prunable_versions(source_dir: str, keep: int) -> list[int]:
    retention = Retention(source_dir, keep)
    retention.load()
    return retention.doomed()[0]


class PruneReport(NamedTuple):
    pruned: list[int]  # the versions deleted (or that would be, on a dry run)
    unreadable: dict[int, str]  # committed versions whose index could not be read: skipped (why)


def prune_source(source_dir: str, keep: int = 0, *, dry_run: bool = False) -> PruneReport:
    """``prune_versions``, also naming the versions it skipped because their index was unreadable
    (damaged, mid-restore, nested too deeply): they, and their side anchors, are kept. A bucket
    URL: ``prune_bucket``."""
    from ..storage.url import is_bucket_url

    if is_bucket_url(source_dir):
        return prune_bucket(source_dir, keep, dry_run=dry_run)
    retention = Retention(source_dir, keep)
    retention.load()
    pruned = retention.doomed()[0] if dry_run else retention.prune()
    return PruneReport(pruned, dict(retention.unreadable))


def prune_bucket(url: str, keep: int = 0, *, dry_run: bool = False) -> PruneReport:
    """``prune_source`` on a bucket: the same ``Retention`` judges a read-only local view of it
    (every index and side file whole, shards as placeholders: the rules read no shard), and what
    it dooms is deleted in the bucket in the order ``Retention.prune`` deletes: versions, then
    side anchors, each dir's index first (it stops being published), then its other keys in bulk."""
    from ..format.layout import anchor_dir_name, version_dir_name
    from ..storage.view import BucketView

    with BucketView(url) as view:
        view.load()
        retention = Retention(view.root, keep)
        retention.load()
        versions, anchors = retention.doomed()
        if not dry_run:
            for v in versions:
                view.delete_dir(version_dir_name(v))
                log.info("pruned %s/%s", url, version_dir_name(v))
            for a in anchors:
                view.delete_dir(anchor_dir_name(a))
                log.info("pruned %s/%s", url, anchor_dir_name(a))
        return PruneReport(versions, {v: view.named(why) for v, why in retention.unreadable.items()})


def prune_versions(source_dir: str, keep: int = 0, *, dry_run: bool = False) -> list[int]:
    """Delete the versions (and side anchors) below the prune point, keeping the newest ``keep``.

    Returns the versions deleted (or that would be, with ``dry_run``). Reads every index once.
    """
    retention = Retention(source_dir, keep)
    retention.load()
    if dry_run:
        return retention.doomed()[0]
    return retention.prune()
