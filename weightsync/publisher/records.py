"""What the source dir already records about a version: the publisher's checks read it.

Before anything is written, a publish is checked against the run as published: the version
number follows the newest committed one; a delta's base holds the bytes the previous version
records (its digests, or the run's seed digests for v1); a full version keeps the layout
(tensor set, dtypes, shapes) of the version before it; a version that is already committed is
either an identical retry or a conflict. All of it is read from the indexes and shard headers
(small files), never from tensor data.

``recorded_state(source_dir, v)`` walks back from ``v``: a delta's shard headers give the
digests of the tensors it changed, an older version the rest, until a full version or a bound
side anchor (their index names every tensor's digest), or version 0 (the seed digests that
``weightsync-run.json`` records). What it cannot see (a pruned or unreadable version, an
upstream writer's full version without digests, a run without seed digests) stays unknown and
is not checked: older runs and upstream writers still publish.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..errors import WeightSyncError
from ..format.layout import INDEX_NAME, anchor_dir, list_versions, version_dir
from ..format.manifest import check_anchor, is_committed, read_version_index
from ..format.safetensors_io import read_header
from ..format.seed_record import SeedRecord, encode_run_file_with_seed, read_seed_record

# A walk back stops after this many versions (a run with anchors off and no full version for
# this long): what lies further back stays unknown, as for a pruned chain.
MAX_WALK = 4096


class RecordedState(NamedTuple):
    """What version ``version`` holds as far as the source dir records it."""

    version: int
    digests: dict[str, tuple[str, str]]  # tensor -> (checksum format, digest of its bytes)
    names: frozenset[str] | None  # the version's whole tensor set, when the walk reached a record of it
    layout: dict[str, tuple[str, tuple[int, ...]]] | None  # tensor -> (dtype, shape), when known
    reached: str  # what the walk ended at ("full version v3", "the seed record", "v2 pruned", ...)


def is_published(source_dir: str, version: int) -> bool:
    """A complete index, or an upstream writer's index-less full version (one complete
    ``model.safetensors``): what a publisher must never write again."""
    vdir = version_dir(source_dir, version)
    if is_committed(vdir):
        return True
    if os.path.isdir(vdir) and not os.path.lexists(os.path.join(vdir, INDEX_NAME)):
        try:
            read_version_index(source_dir, version)  # index-less: published only as a complete single file
            return True
        except (WeightSyncError, OSError):
            return False
    return False


def newest_committed_version(source_dir: str) -> int:
    """The newest published version (``is_published``; 0: none)."""
    for v in reversed(list_versions(source_dir)):
        if is_published(source_dir, v):
            return v
    return 0


def _full_layout(idx) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """dtype and shape of every tensor of a full version or anchor, from its shard headers."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    try:
        for fname, names in idx.shards().items():
            hdr = read_header(os.path.join(idx.path, fname))
            for n in names:
                e = hdr.tensors.get(n)
                if e is None:
                    return None
                out[n] = (e.dtype, tuple(e.shape))
    except (OSError, WeightSyncError, RecursionError):
        return None
    return out


def recorded_state(source_dir: str, version: int, *, want_layout: bool = False) -> RecordedState:
    """Walk back from ``version`` collecting each tensor's newest recorded digest (see module doc)."""
    digests: dict[str, tuple[str, str]] = {}
    blocked: set[str] = set()  # changed at a version whose record is unreadable: older digests are stale
    v = version
    for _ in range(MAX_WALK):
        if v <= 0:
            seed = read_seed_record(source_dir)
            if seed is None:
                return RecordedState(version, digests, None, None, "version 0 (no seed digests recorded)")
            for n, d in seed.digests.items():
                if n not in digests and n not in blocked:
                    digests[n] = (seed.checksum_format, d)
            layout = dict(seed.layout) if seed.layout and set(seed.layout) == set(seed.digests) else None
            return RecordedState(version, digests, frozenset(seed.digests), layout, "the run's seed record")
        anchored = _bound_anchor(source_dir, v)
        if anchored is not None:
            return _stop_at_full(version, digests, blocked, anchored, want_layout, f"the side anchor of v{v}")
        try:
            idx = read_version_index(source_dir, v)
        except (WeightSyncError, RecursionError) as e:
            return RecordedState(version, digests, None, None, f"v{v} unreadable ({type(e).__name__})")
        if idx.kind == "full":
            return _stop_at_full(version, digests, blocked, idx, want_layout, f"the full version v{v}")
        for fname, names in idx.shards().items():
            wanted = names - digests.keys() - blocked
            if not wanted:
                continue
            try:
                meta = read_header(os.path.join(idx.path, fname)).metadata
            except (OSError, WeightSyncError, RecursionError):
                blocked |= wanted
                continue
            for n in wanted:
                if n in meta:
                    digests[n] = (idx.checksum_format or "xxh3-128", meta[n])
                else:
                    blocked.add(n)
        v -= 1
    return RecordedState(version, digests, None, None, f"the walk stopped after {MAX_WALK} versions")


def _bound_anchor(source_dir: str, version: int):
    if not os.path.isdir(anchor_dir(source_dir, version)):
        return None
    try:
        check = check_anchor(source_dir, version)
    except (WeightSyncError, RecursionError):
        return None
    return check.index if check.state == "bound" else None


def _stop_at_full(version, digests, blocked, idx, want_layout, reached) -> RecordedState:
    for n, d in (idx.digests or {}).items():
        if n not in digests and n not in blocked:
            digests[n] = (idx.checksum_format or "xxh3-128", d)
    layout = _trusted_layout(idx) if want_layout else None
    return RecordedState(version, digests, frozenset(idx.weight_map), layout, reached)


def _trusted_layout(idx) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The layout of a full version or anchor: its index's record where its shard headers say the
    same, the headers where it records none. A record the headers contradict is damage (a byte of
    the index or a header changed): neither side can be told right, so the layout is unknown and
    a publish is not refused on its account (the pull refuses such a version or anchor itself)."""
    headers = _full_layout(idx)
    recorded = getattr(idx, "layout", None)
    if not recorded:
        return headers
    recorded = {n: (d, tuple(s)) for n, (d, s) in recorded.items()}
    if headers is not None and headers != recorded:
        return None
    return recorded


def recorded_layout(source_dir: str, version: int) -> tuple[dict[str, tuple[str, tuple[int, ...]]] | None, str]:
    """(tensor -> (dtype, shape), where from) of ``version``: its newest full version or bound
    anchor at or below it (deltas keep the layout), or the seed record; None when unknown."""
    state = recorded_state(source_dir, version, want_layout=True)
    return state.layout, state.reached


__all__ = [
    "SeedRecord", "RecordedState", "recorded_state", "recorded_layout", "newest_committed_version",
    "read_seed_record", "encode_run_file_with_seed",
]
