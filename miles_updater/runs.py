"""The runs under ``--update-weight-disk-dir``: one source dir per trainer run, versions that never go back.

    disk_dir/
    ├── run-20261201-083000-1a2b3c4d/   an earlier run (crashed at v5): weight_v000001 .. v000005
    └── run-20261201-091500-5e6f7a8b/   this run: its first version is weight_v000006, a full version

Rules (the updater applies them at start, on rank 0, and every rank follows rank 0's plan):
- Version numbers continue across runs: a run's first version is one past the newest version
  published by any run in the disk dir. An engine's ``weight_version`` therefore never goes
  backwards across a trainer restart, with a fresh run id or a stable one.
- A run id given again (a stable id, e.g. the job's own id on a restart) reopens its own dir and
  continues after its newest published version. A version dir above that with no complete index
  (the crashed trainer's partial write) is removed before anything is written.
- The first version after a restart is a full version: the restarted trainer's snapshot holds
  ``--hf-checkpoint``, not the newest version's bytes, so a delta against it would not apply.
  Every engine seeds from that full version, whatever its local state, so no baseline is needed.
- Retention: once this run has published its first version, only the newest ``keep_runs`` run
  dirs stay, this one included, ordered by their newest published version; older ones are
  removed, index files first (a reader then sees "not ready", never half a version).
  ``keep_runs=0`` removes nothing. Engines never read an older run again once they pulled this
  run's first version, which is a full one (or v1 from the seed).
"""

from __future__ import annotations

import logging
import os
import shutil

import msgspec

from weightsync.format.layout import INDEX_NAME, VERSION_DIR_RE, index_path, list_versions, version_dir
from weightsync.format.manifest import is_committed
from weightsync.storage.url import is_bucket_url

log = logging.getLogger(__name__)

RUN_PREFIX = "run-"


class RunStart(msgspec.Struct, frozen=True):
    """How a run starts: after which version, and why (agreed by every rank)."""

    newest_version: int  # the version the run continues after (0: a first run)
    reason: str
    reopened: bool = False  # this run's own dir held versions (a stable run id)
    removed: list[str] = []  # unpublished version dirs of this run that were removed

    @property
    def first_is_full(self) -> bool:
        return self.newest_version > 0


def run_dir(disk_dir: str, run_id: str) -> str:
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} must be a plain name (it names the dir {RUN_PREFIX}<id>)")
    if is_bucket_url(disk_dir):
        return f"{disk_dir.rstrip('/')}/{RUN_PREFIX}{run_id}"
    return os.path.join(disk_dir, f"{RUN_PREFIX}{run_id}")


def newest_published_version(source_dir: str) -> int:
    """The newest version of ``source_dir`` with a complete index (0 when none)."""
    if is_bucket_url(source_dir):
        return max(_BucketRuns(source_dir).published(""), default=0)
    for v in reversed(list_versions(source_dir)):
        if _is_published(source_dir, v):
            return v
    return 0


def list_runs(disk_dir: str) -> list[tuple[int, str]]:
    """(newest published version, path) of every run dir, oldest first."""
    if is_bucket_url(disk_dir):
        return _BucketRuns(disk_dir).runs()
    try:
        names = sorted(n for n in os.listdir(disk_dir) if n.startswith(RUN_PREFIX))
    except FileNotFoundError:
        return []
    runs = [(newest_published_version(os.path.join(disk_dir, n)), os.path.join(disk_dir, n)) for n in names]
    return sorted(r for r in runs if os.path.isdir(r[1]))


def plan_run_start(disk_dir: str, source_dir: str) -> RunStart:
    """Where this run's numbering continues, removing its own unpublished leftovers (rank 0)."""
    own = newest_published_version(source_dir)
    removed = remove_unpublished_above(source_dir, own)
    newest = max([own] + [v for v, path in list_runs(disk_dir) if not _same(path, source_dir)])
    if newest == 0:
        return RunStart(0, "a first run: v1 follows the seed", removed=removed)
    if own == newest:
        why = f"run dir reopened (a stable run id): continuing after its v{own}"
    else:
        why = f"an earlier run in {disk_dir} published up to v{newest}: continuing after it"
    return RunStart(newest, f"{why}; the first version is full (this trainer's snapshot is the seed)",
                    reopened=own > 0, removed=removed)


def remove_unpublished_above(source_dir: str, version: int) -> list[str]:
    """Remove version dirs above ``version`` that have no complete index (a crashed write)."""
    if is_bucket_url(source_dir):
        return _BucketRuns(source_dir).remove_unpublished_above(version)
    removed = []
    for v in list_versions(source_dir):
        if v > version and not _is_published(source_dir, v):
            path = version_dir(source_dir, v)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed %s: never published (no complete index), left by an earlier trainer", path)
    return removed


def prune_runs(disk_dir: str, keep_runs: int, current: str) -> list[str]:
    """Remove run dirs older than the newest ``keep_runs`` (this one always stays); the removed paths."""
    if keep_runs <= 0:
        return []
    others = [path for _, path in list_runs(disk_dir) if not _same(path, current)]
    doomed = others[: max(0, len(others) - (keep_runs - 1))]
    if is_bucket_url(disk_dir):
        for path in doomed:
            _BucketRuns(disk_dir).remove_run(path)
            log.info("removed old run %s (keeping the newest %d run(s))", path, keep_runs)
        return doomed
    for path in doomed:
        for v in list_versions(path):  # index files first: a reader sees "not ready", not half a version
            try:
                os.unlink(index_path(version_dir(path, v)))
            except FileNotFoundError:
                pass
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed old run dir %s (keeping the newest %d run(s))", path, keep_runs)
    return doomed


def _is_published(source_dir: str, version: int) -> bool:
    # The core's rule: a complete index counts (even a bad one: never rewrite what a reader may
    # have judged); none, or one cut short while being written, does not.
    return is_committed(version_dir(source_dir, version))


def _same(a: str, b: str) -> bool:
    if is_bucket_url(a) or is_bucket_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


class _BucketRuns:
    """The run dirs under a bucket URL, from one LIST (keys relative to ``url``)."""

    def __init__(self, url: str):
        from weightsync.storage.source import BucketSource

        self.url = url.rstrip("/")
        self.source = BucketSource(self.url)
        self.keys = set(self.source.list())

    def published(self, run: str) -> list[int]:
        """The versions of ``run`` ("" for the URL itself, "run-x/" for a run under it) whose index exists."""
        out = []
        for k in self.keys:
            if not k.startswith(run):
                continue
            d, _, name = k[len(run):].partition("/")
            m = VERSION_DIR_RE.match(d)
            if m and name == INDEX_NAME:
                out.append(int(m.group(1)))
        return sorted(out)

    def runs(self) -> list[tuple[int, str]]:
        names = {k.split("/", 1)[0] for k in self.keys if k.startswith(RUN_PREFIX) and "/" in k}
        return sorted((max(self.published(n + "/"), default=0), f"{self.url}/{n}") for n in names)

    def remove_unpublished_above(self, version: int) -> list[str]:
        published = set(self.published(""))
        doomed: dict[str, list[str]] = {}
        for k in self.keys:
            d = k.split("/", 1)[0]
            m = VERSION_DIR_RE.match(d)
            if m and int(m.group(1)) > version and int(m.group(1)) not in published:
                doomed.setdefault(d, []).append(k)
        for d, keys in sorted(doomed.items()):
            self.source.delete(sorted(keys))
            log.info("removed %s/%s: never published (no index), left by an earlier trainer", self.url, d)
        return [f"{self.url}/{d}" for d in sorted(doomed)]

    def remove_run(self, path: str) -> None:
        run = path.rstrip("/")[len(self.url) + 1:] + "/"
        keys = sorted(k for k in self.keys if k.startswith(run))
        # index objects first: a reader sees "not ready", never half a version
        self.source.delete([k for k in keys if k.endswith("/" + INDEX_NAME)])
        self.source.delete([k for k in keys if not k.endswith("/" + INDEX_NAME)])


__all__ = ["RunStart", "run_dir", "plan_run_start", "prune_runs", "newest_published_version", "list_runs"]
