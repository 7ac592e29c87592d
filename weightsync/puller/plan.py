"""Plan a pull before touching anything: no-op, seed, or a chain of deltas, with the reason.

A local state counts only if its marker matches this pull's origin (the seed dir's fingerprint,
the source dir's path and run id; see ``identity``); otherwise there is none and the pull seeds.
Candidates, priced by the bytes they read:

- chain the deltas after the applied version (the local state);
- seed from a full version in the chain (a chain cannot cross one) and chain the tail;
- seed from the newest side anchor (``anchor_vNNNNNN/``) at or below the target and chain the tail,
  only an anchor bound to its version (``manifest.check_anchor``: both indexes name one commit
  id); the seed then checks every tensor against the anchor's digests, and a pull whose anchor
  fails plans again with that anchor in ``skip_anchors`` (an older anchor, or the chain);
- seed from the seed dir (version 0) and chain every delta, when nothing else is there.

The walk goes down from the target, reading one index per version, and stops as soon as the
tail alone costs more than the best candidate found, so it reads a bounded number of indexes
however long the run. Planning reads index files and file sizes only.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import msgspec

from ..errors import (
    AnchorUnusableError,
    BackwardPullError,
    ChainBrokenError,
    CorruptArtifactError,
    InvalidRequestError,
    SourceNotReadyError,
    VersionMissingError,
)
from ..format.layout import (
    anchor_dir,
    anchor_dir_name,
    checked_join,
    index_path,
    list_anchors,
    state_path,
    version_dir,
    version_dir_name,
)
from ..format.manifest import (
    VersionIndex,
    check_anchor,
    checkpoint_weight_files,
    is_committed,
    parse_version_number,
    read_applied_state,
    read_version_index,
)
from .identity import Origin, mismatch, source_origin

log = logging.getLogger(__name__)


class SeedSource(msgspec.Struct, frozen=True):
    kind: Literal["seed_dir", "full", "anchor"]
    version: int
    path: str
    shard_files: tuple[str, ...] = ()  # the weight files its index names (full versions, anchors)
    # What every seeded tensor must hash to (an anchor's binding, or our full version's index):
    # checked before the marker. None: an upstream full version (headers checked only).
    digests: dict[str, str] | None = None
    checksum_format: str | None = None
    # Its version was published with --allow-layout-change (``allows_layout_change``): its
    # layout need not be the seed dir's.
    layout_change: bool = False
    # Each tensor's dtype and shape as its index records them (ours): what its headers must say.
    layout: "dict[str, tuple[str, tuple[int, ...]]] | None" = None


# Index metadata of a full version published with --allow-layout-change: our publisher writes
# ``layout_change`` (a non-empty note of who allowed it); ``allow_layout_change: "true"`` is
# accepted from other writers.
LAYOUT_CHANGE_KEYS = ("layout_change", "allow_layout_change")


def allows_layout_change(index: "VersionIndex | None") -> bool:
    if index is None:
        return False
    note = index.metadata.get(LAYOUT_CHANGE_KEYS[0], "").strip()
    return bool(note) or index.metadata.get(LAYOUT_CHANGE_KEYS[1], "").strip().lower() == "true"


class PullPlan(msgspec.Struct, frozen=True):
    target_version: int
    applied_version: int | None
    seed: SeedSource | None
    deltas: list[int]
    reason: str
    read_nbytes: int = 0  # what the plan reads from the source dir (file sizes), seed included
    origin: Origin | None = None

    @property
    def action(self) -> str:
        if self.seed and self.deltas:
            return "seed+chain"
        if self.seed:
            return "seed"
        return "chain" if self.deltas else "noop"


class _Candidate(msgspec.Struct, frozen=True):
    cost: int  # bytes to read
    start: int  # the version the local dir holds before the tail is applied
    seed: SeedSource | None
    why: str


def check_target_version(target_version: object) -> int:
    if isinstance(target_version, bool) or not isinstance(target_version, int) or target_version < 0:
        raise InvalidRequestError(f"target_version must be an integer >= 0, got {target_version!r}")
    return target_version


def read_applied_version(local_checkpoint_dir: str, origin: Origin | None = None) -> tuple[int | None, str]:
    """(applied version or None, why). With ``origin``, a marker of another origin counts as none."""
    state = read_applied_state(state_path(local_checkpoint_dir))
    if state is None:
        return None, "no applied-version marker (fresh or torn local state)"
    applied = parse_version_number(state.version, "version", state_path(local_checkpoint_dir))
    if origin is not None:
        why = mismatch(state, applied, origin)
        if why is not None:
            return None, why
        why = _sizes_differ(local_checkpoint_dir, state.files)
        if why is not None:
            return None, why
    return applied, f"local state at v{applied}"


def _sizes_differ(local_checkpoint_dir: str, files: "dict[str, int] | None") -> str | None:
    """Why the local weight files are not the ones the marker was written over (a file cut
    short, grown or gone), or None. A marker without sizes (an older puller's) proves nothing
    here; its origin checks still hold."""
    for name, nbytes in sorted((files or {}).items()):
        try:
            size = os.stat(checked_join(local_checkpoint_dir, name, state_path(local_checkpoint_dir))).st_size
        except (OSError, CorruptArtifactError):
            return f"local file {name} is gone (the marker names it): reseeding"
        if size != nbytes:
            return f"local file {name} is {size} bytes, the marker recorded {nbytes} (cut short or rewritten): reseeding"
    return None


def files_nbytes(directory: str, names: "set[str] | list[str] | tuple[str, ...]") -> int:
    """Sum of the sizes of the named files (absent ones count 0: loading reports them)."""
    total = 0
    for name in names:
        try:
            total += os.stat(checked_join(directory, name, directory)).st_size
        except OSError:
            pass
    return total


def _seed_dir_nbytes(seed_dir: str) -> int:
    try:
        return files_nbytes(seed_dir, checkpoint_weight_files(seed_dir))
    except (OSError, CorruptArtifactError):
        return 0


def newest_anchor(
    source_dir: str, target: int, above: int | None, indexes: "dict[int, VersionIndex] | None" = None,
    skip: "frozenset[int] | set[int]" = frozenset(), passed_over: "list[tuple[int, str]] | None" = None,
) -> tuple[VersionIndex, int] | None:
    """(index, bytes) of the newest complete side anchor in (above, target] that is bound to
    its version, or None.

    An anchor is an optimisation beside the chain, so one that is incomplete, unreadable or
    not bound (an earlier attempt's, or an older publisher's without a commit id) is skipped
    (with a log line) in favour of the chain, which is verified on its own. ``indexes``: the
    version indexes read so far (reused, and the ones read here added). ``skip``: anchors that
    failed their check in this pull. ``passed_over`` gets (version, why) of each complete anchor
    passed over (damaged, unbound), newest first, for the error when nothing else serves.
    """
    indexes = {} if indexes is None else indexes
    for a in reversed(list_anchors(source_dir)):
        if a > target or (above is not None and a <= above) or a in skip:
            continue
        if a not in indexes:
            try:
                indexes[a] = read_version_index(source_dir, a)
            except (SourceNotReadyError, CorruptArtifactError):
                continue  # the chain walk meets that version, and reports it, if it needs it
        check = check_anchor(source_dir, a, indexes[a])
        if check.state != "bound" or check.index is None:
            if check.state != "pending":
                log.warning("ignoring side anchor %s (%s): %s", anchor_dir_name(a), check.state, check.why)
                if passed_over is not None:
                    passed_over.append((a, f"{check.state}: {check.why}"))
            continue
        idx = check.index
        files = sorted(set(idx.weight_map.values()))
        absent = [f for f in files if not os.path.exists(os.path.join(idx.path, f))]
        if absent:
            log.warning("ignoring side anchor %s: its index names %s, not there", anchor_dir_name(a), absent[:3])
            if passed_over is not None:
                passed_over.append((a, f"its index names {absent[:3]}, which are not there"))
            continue
        return idx, files_nbytes(idx.path, files)
    return None


def plan_pull(
    local_checkpoint_dir: str, seed_dir: str, source_dir: str, target_version: int, *, force_reseed: bool = False,
    origin: Origin | None = None, use_anchors: bool = True, skip_anchors: "frozenset[int] | set[int]" = frozenset(),
) -> tuple[PullPlan, dict[int, VersionIndex]]:
    """The plan and the delta indexes it read (the executor reuses them). ``skip_anchors``: plan
    as if those side anchors were not there (they failed their check); ``use_anchors=False``: as
    if there were none."""
    check_target_version(target_version)
    origin = origin or source_origin(source_dir, seed_dir)
    applied, why = read_applied_version(local_checkpoint_dir, origin)
    if force_reseed:
        applied, why = None, "reseeding after a failed apply"
    seed0 = SeedSource("seed_dir", 0, seed_dir)
    if target_version == 0:
        if applied == 0:
            return PullPlan(0, 0, None, [], "no-op: already at version 0", origin=origin), {}
        return PullPlan(0, applied, seed0, [], f"reset to the engine's own model ({why})", origin=origin), {}
    if applied == target_version:
        return PullPlan(target_version, applied, None, [], f"no-op: already at v{target_version}", origin=origin), {}
    if applied is not None and target_version < applied:
        raise BackwardPullError(target_version, applied)
    indexes: dict[int, VersionIndex] = {target_version: read_version_index(source_dir, target_version)}
    skip = skip_anchors if use_anchors else None
    best = _cheapest_plan(source_dir, seed_dir, target_version, applied, why, indexes, seed0, skip)
    deltas = list(range(best.start + 1, target_version + 1))
    reason = best.why
    if deltas:
        reason += f"; chain {len(deltas)} delta(s) v{deltas[0]}..v{deltas[-1]}"
    reason += f" ({best.cost} bytes to read)"
    used = {v: indexes[v] for v in deltas}
    return PullPlan(target_version, applied, best.seed, deltas, reason, best.cost, origin), used


def _anchor_still_there(source_dir: str, version: int) -> bool:
    """Whether a passed-over anchor still has its index file and its version is committed: one
    a prune removed meanwhile (index first, then the files) is gone, not damaged, and the pull is
    "not ready, retry" (the retry plans from what is kept, or names the version pruned). Its
    index's presence, not its completeness: a damaged index can read as incomplete JSON."""
    return os.path.exists(index_path(anchor_dir(source_dir, version))) and is_committed(version_dir(source_dir, version))


def _cheapest_plan(
    source_dir: str, seed_dir: str, target: int, applied: int | None, why: str, indexes: dict[int, VersionIndex],
    seed0: SeedSource, skip: "frozenset[int] | set[int] | None",
) -> _Candidate:
    passed_over: list[tuple[int, str]] = []
    anchor = newest_anchor(source_dir, target, applied, indexes, skip, passed_over) if skip is not None else None
    best: _Candidate | None = None

    def consider(c: _Candidate) -> None:
        nonlocal best
        if best is None or c.cost < best.cost:
            best = c

    tail = 0  # bytes of the deltas v+1..target
    v = target
    while True:
        if anchor is not None and v == anchor[0].version:
            idx, nbytes = anchor
            files = tuple(sorted(set(idx.weight_map.values())))
            source = SeedSource("anchor", v, idx.path, files, idx.digests, idx.checksum_format,
                                allows_layout_change(indexes.get(v)) or allows_layout_change(idx), idx.layout)
            consider(_Candidate(nbytes + tail, v, source,
                                f"seed from side anchor {anchor_dir_name(v)} (cheaper than the chain; {why})"))
        if v == applied:
            consider(_Candidate(tail, v, None, why))
            break
        if applied is None and v == 0:
            consider(_Candidate(_seed_dir_nbytes(seed_dir) + tail, 0, seed0,
                                f"seed from the engine's own model, version 0 ({why})"))
            break
        if best is not None and tail >= best.cost:
            break  # going further down only adds bytes
        if v not in indexes:
            try:
                indexes[v] = read_version_index(source_dir, v)
            except VersionMissingError as e:
                if best is not None:
                    break  # pruned below a cheaper start: nobody needs it
                damaged = [(a, why) for a, why in passed_over if _anchor_still_there(source_dir, a)]
                if damaged:  # a retry cannot help: say which anchor would have served
                    raise AnchorUnusableError(damaged[0][0], damaged[0][1], target, v) from None
                raise ChainBrokenError(v, target, e.path) from None
        idx = indexes[v]
        if idx.kind == "full":
            files = tuple(sorted(set(idx.weight_map.values())))
            full = SeedSource("full", v, idx.path, files, idx.digests, idx.checksum_format, allows_layout_change(idx),
                              idx.layout)
            consider(_Candidate(files_nbytes(idx.path, files) + tail, v, full,
                                f"seed from {version_dir_name(v)} (newest full version <= v{target}; {why})"))
            break
        tail += files_nbytes(idx.path, set(idx.weight_map.values()))
        v -= 1
    assert best is not None  # every exit of the walk considers a candidate or raises
    return best
