"""Ranks on several nodes publishing one version to one bucket, each with its own staging copy
(``WEIGHTSYNC_BUCKET_RANK_REPORTS=1`` on every rank).

Without a shared staging dir rank 0 cannot read the other ranks' shards. So each other rank,
after writing its shards into its own staging copy, uploads them under their content keys (the
keys ``bucket_publish`` gives them: our shard names end in a hash of what they hold) and then
creates a small *report*: its manifest (what rank 0's commit merges into the index), the file
digest and size of every shard, and the dtype and shape of every tensor of its full shards (what
rank 0's commit would otherwise read from their headers). Rank 0 waits for every rank's report,
checks that every shard a report names is in the bucket with the reported size, and commits from
the reports and its own shards; it reads none of the other ranks' bytes or headers.

A report's key, ``weight_vNNNNNN/.ranks/<scope>/rNNNNN-<16 hex of the report's xxh3>.json``:

- the hash binds the key to the report's bytes: the manifest a rank's ``write`` returns names
  its report's key, so a rank 0 given that manifest by the caller's barrier reads exactly this
  attempt's report, never one an earlier attempt left with other bytes;
- ``<scope>`` is the token of the writer lease in the bucket when the rank reported (``none``
  before the first lease): a rank 0 not given a rank's manifest takes only a report under its
  own lease, and refuses two of one rank (it cannot tell which is this attempt's).

Reports live under the version's prefix: the commit's cleanup (keys the index does not name)
deletes them once the index is created, and pruning deletes whatever is left with the version.
"""

from __future__ import annotations

import json
import os
import time

import msgspec
import xxhash

# The errors live with every other typed error; named here too, for callers that import them from here.
from ..errors import RankReportMismatchError, RankReportMissingError
from ..format.layout import INDEX_NAME, RUN_NAME, anchor_dir_name, version_dir_name
from ..fsio import fsync_dir, write_bytes
from ..knobs import Knob

RANK_REPORTS = Knob(
    "WEIGHTSYNC_BUCKET_RANK_REPORTS", 0,
    "1: the ranks of a bucket publish have their own staging dirs (several nodes): each uploads its shards and "
    "reports them, rank 0 commits from the reports; 0: they share one staging dir and rank 0 uploads",
)
REPORT_WAIT_S = Knob("WEIGHTSYNC_BUCKET_RANK_REPORT_WAIT_S", 120, "seconds rank 0's commit waits for the other ranks' reports")
REPORTS_DIR = ".ranks"
NO_SCOPE = "none"


def rank_reports_wanted() -> bool:
    return RANK_REPORTS.get() != 0


class RankReport(msgspec.Struct, frozen=True):
    """What one rank other than 0 wrote and uploaded for one version."""

    version: int
    rank: int
    scope: str  # the bucket's writer lease token when the rank reported (NO_SCOPE: none yet)
    shards: dict[str, int]  # bucket key -> bytes: every shard the rank uploaded for the version
    manifest: dict  # the publisher's manifest of the rank (opaque here)


def reports_prefix(version: int) -> str:
    return f"{version_dir_name(version)}/{REPORTS_DIR}/"


class RankReports:
    """The report protocol over one bucket target (``bucket_publish.BucketTarget``)."""

    def __init__(self, target):
        self.target = target
        self.source = target.source
        self.url = str(target.url)

    # --- a rank other than 0 ------------------------------------------------------------------

    def committed_index(self, version: int) -> "dict | None":
        """The bucket's index of ``version`` (parsed), None when it is not committed there."""
        try:
            return json.loads(self.source.read(f"{version_dir_name(version)}/{INDEX_NAME}"))
        except FileNotFoundError:
            return None

    def upload_and_report(self, version: int, rank: int, files: dict[str, list[str]], manifest: dict) -> str:
        """Upload this rank's shards (``files``: staging dir name -> shard file names, all
        content-named) unless their key is there with their size, then create the report; its key."""
        staging = self.target.staging_dir
        shards: dict[str, int] = {}
        uploads: list[tuple[str, str]] = []
        for dname, names in sorted(files.items()):
            there = self.source.list(prefix=f"{dname}/") if names else {}
            for fname in sorted(names):
                path = os.path.join(staging, dname, fname)
                key = f"{dname}/{fname}"
                size = os.path.getsize(path)
                shards[key] = size
                if key not in there or there[key].size != size:
                    uploads.append((key, path))
        self.target.put_all(uploads)
        scope = self.lease_scope()
        body = msgspec.json.encode(RankReport(version, rank, scope, shards, manifest))
        key = f"{reports_prefix(version)}{scope}/r{rank:05d}-{xxhash.xxh3_128(body).hexdigest()[:16]}.json"
        self.source.create(key, body)  # refused: the same key holds the same bytes (the hash)
        return key

    def lease_scope(self) -> str:
        return self.target.current_lease_token() or NO_SCOPE

    def delete_report(self, key: str) -> None:
        if key:
            self.source.delete([key])

    def adopt_committed(self, version: int) -> bool:
        """Rank 0 committed ``version``: its index (and its side anchor's) into this rank's
        staging copy, and the bucket's run file (v1 adds the seed record), so this rank's
        version numbers, base checks and retention see it. False when the bucket has no index
        of it. The indexes name the same shard names as this staging copy (content-named)."""
        staging = self.target.staging_dir
        vname, aname = version_dir_name(version), anchor_dir_name(version)
        try:
            vindex = self.source.read(f"{vname}/{INDEX_NAME}")
        except FileNotFoundError:
            return False
        try:
            run = self.source.read(RUN_NAME)
            write_bytes(os.path.join(staging, RUN_NAME), run)
        except FileNotFoundError:
            pass
        try:
            aindex: bytes | None = self.source.read(f"{aname}/{INDEX_NAME}")
        except FileNotFoundError:
            aindex = None
        adir = os.path.join(staging, aname)
        if aindex is not None:
            os.makedirs(adir, exist_ok=True)
            write_bytes(os.path.join(adir, INDEX_NAME), aindex)
        elif os.path.isdir(adir):  # written here, but the version was committed without an anchor
            import shutil

            shutil.rmtree(adir, ignore_errors=True)
        vdir = os.path.join(staging, vname)
        os.makedirs(vdir, exist_ok=True)
        write_bytes(os.path.join(vdir, INDEX_NAME), vindex)  # last: the commit point here too
        fsync_dir(vdir)
        return True

    # --- rank 0 -------------------------------------------------------------------------------

    def collect(self, version: int, want: dict[int, "str | None"], scope: str | None) -> dict[int, RankReport]:
        """Every rank's report of ``version``: ``want[rank]`` is its report's key when the
        caller passed its manifest, else None (then the one report under ``scope``, rank 0's
        lease token). Waits up to REPORT_WAIT_S; every shard a report names must be in the
        bucket with its size."""
        wait_s = float(REPORT_WAIT_S.get())
        deadline = time.monotonic() + wait_s
        prefix = reports_prefix(version)
        found: dict[int, RankReport] = {}
        while True:
            listing = self.source.list(prefix=prefix)
            for rank, key in sorted(want.items()):
                if rank in found:
                    continue
                if key:
                    candidates = [key] if key in listing else []
                else:
                    mine = f"{prefix}{scope or NO_SCOPE}/r{rank:05d}-"
                    candidates = sorted(k for k in listing if k.startswith(mine))
                    if len(candidates) > 1:
                        raise RankReportMismatchError(version, self.url, rank, (
                            f"is there {len(candidates)} times under this writer's lease ({candidates[:3]}), with other "
                            "bytes each time: which one is this attempt's cannot be told"))
                if candidates:
                    found[rank] = self._read_checked(version, rank, candidates[0])
            missing = sorted(set(want) - set(found))
            if not missing:
                return found
            if time.monotonic() >= deadline:
                stale = sorted({k.split("/")[2] for k in listing if k.count("/") >= 3})
                detail = (f"; reports under other leases ({stale[:3]}) are earlier attempts' and are not used"
                          if stale and any(not want[r] for r in missing) else "")
                raise RankReportMissingError(version, self.url, missing, wait_s, detail)
            time.sleep(0.2)

    def _read_checked(self, version: int, rank: int, key: str) -> RankReport:
        body = self.source.read(key)
        if not key.endswith(f"-{xxhash.xxh3_128(body).hexdigest()[:16]}.json"):
            raise RankReportMismatchError(version, self.url, rank, f"({key}) does not hash to its key (damaged)")
        try:
            report = msgspec.json.decode(body, type=RankReport)
        except msgspec.ValidationError as e:
            raise RankReportMismatchError(version, self.url, rank, f"({key}) is unreadable: {e}") from None
        if report.version != version or report.rank != rank:
            raise RankReportMismatchError(version, self.url, rank, f"({key}) is for v{report.version} rank {report.rank}")
        for dname in sorted({k.split("/")[0] for k in report.shards}):
            there = self.source.list(prefix=f"{dname}/")
            for k, size in sorted(report.shards.items()):
                if k.split("/")[0] == dname and (k not in there or there[k].size != size):
                    have = there[k].size if k in there else "no such key"
                    raise RankReportMismatchError(version, self.url, rank, (
                        f"names {k} of {size} bytes, and the bucket has {have}"))
        return report

    def delete_reports(self, version: int, scope: str | None) -> None:
        """Rank 0 discards ``version``: the reports under its lease go (earlier attempts' stay
        unused under theirs, and go with the version's cleanup or pruning)."""
        prefix = f"{reports_prefix(version)}{scope or NO_SCOPE}/"
        self.source.delete(sorted(self.source.list(prefix=prefix)))


__all__ = [
    "RANK_REPORTS", "REPORT_WAIT_S", "RankReport", "RankReports", "RankReportMissingError", "RankReportMismatchError",
    "rank_reports_wanted", "reports_prefix",
]
