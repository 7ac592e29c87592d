"""Prune versions no pull can need: those older than the newest full version (the anchor).

A pull to any target at or above the anchor seeds from the anchor (or chains from a local state
at or above it), so nothing below it is read again. The newest ``keep`` versions stay regardless.
A pruned version loses its index first, so a reader never sees a half-deleted version as published.
"""

from __future__ import annotations

import logging
import os
import shutil

from .errors import WeightSyncError
from .fsio import fsync_dir
from .layout import index_path, list_versions, version_dir
from .manifest import read_version_index

log = logging.getLogger(__name__)


def newest_full_version(source_dir: str) -> int | None:
    for v in reversed(list_versions(source_dir)):
        try:
            if read_version_index(source_dir, v).kind == "full":
                return v
        except WeightSyncError:
            continue  # an unpublished or broken version anchors nothing
    return None


def prunable_versions(source_dir: str, keep: int) -> list[int]:
    anchor = newest_full_version(source_dir)
    if anchor is None:
        return []
    versions = list_versions(source_dir)
    protected = set(versions[-keep:]) if keep > 0 else set()
    return [v for v in versions if v < anchor and v not in protected]


def prune_versions(source_dir: str, keep: int = 0, *, dry_run: bool = False) -> list[int]:
    """Delete versions older than the newest full version, keeping the newest ``keep``.

    Returns the versions deleted (or that would be, with ``dry_run``).
    """
    doomed = prunable_versions(source_dir, keep)
    if dry_run:
        return doomed
    for v in doomed:
        vdir = version_dir(source_dir, v)
        try:
            os.unlink(index_path(vdir))
        except FileNotFoundError:
            pass
        fsync_dir(vdir)
        shutil.rmtree(vdir, ignore_errors=True)
        log.info("pruned v%d (older than the newest full version)", v)
    if doomed:
        fsync_dir(source_dir)
    return doomed
