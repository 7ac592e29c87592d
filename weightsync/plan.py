"""Plan a pull before touching anything: no-op, seed, or a chain of deltas, with the reason.

Seed from the newest full version at or below the target that is newer than the local state
(or from the seed dir, version 0, when there is no usable local state), then chain the deltas
after it. Planning reads only index files.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from .errors import BackwardPullError, ChainBrokenError, InvalidRequestError, VersionMissingError
from .layout import state_path, version_dir_name
from .manifest import VersionIndex, parse_version_number, read_applied_state, read_version_index


class SeedSource(msgspec.Struct, frozen=True):
    kind: Literal["seed_dir", "full"]
    version: int
    path: str


class PullPlan(msgspec.Struct, frozen=True):
    target_version: int
    applied_version: int | None
    seed: SeedSource | None
    deltas: list[int]
    reason: str

    @property
    def action(self) -> str:
        if self.seed and self.deltas:
            return "seed+chain"
        if self.seed:
            return "seed"
        return "chain" if self.deltas else "noop"


def check_target_version(target_version: object) -> int:
    if isinstance(target_version, bool) or not isinstance(target_version, int) or target_version < 0:
        raise InvalidRequestError(f"target_version must be an integer >= 0, got {target_version!r}")
    return target_version


def read_applied_version(local_checkpoint_dir: str, source_dir: str | None = None) -> tuple[int | None, str]:
    """(applied version or None, why). A marker from another source dir counts as unknown."""
    state = read_applied_state(state_path(local_checkpoint_dir))
    if state is None:
        return None, "no applied-version marker (fresh or torn local state)"
    applied = parse_version_number(state.version, "version", state_path(local_checkpoint_dir))
    if (
        applied > 0
        and source_dir is not None
        and state.source_dir is not None
        and state.source_dir != os.path.realpath(source_dir)
    ):
        return None, f"local state came from another source dir ({state.source_dir})"
    return applied, f"local state at v{applied}"


def plan_pull(
    local_checkpoint_dir: str, seed_dir: str, source_dir: str, target_version: int, *, force_reseed: bool = False
) -> tuple[PullPlan, dict[int, VersionIndex]]:
    """The plan and the indexes it read (the executor reuses them)."""
    check_target_version(target_version)
    applied, why = read_applied_version(local_checkpoint_dir, source_dir)
    if force_reseed:
        applied, why = None, "reseeding after a failed apply"
    seed0 = SeedSource("seed_dir", 0, seed_dir)
    if target_version == 0:
        if applied == 0:
            return PullPlan(0, 0, None, [], "no-op: already at version 0"), {}
        return PullPlan(0, applied, seed0, [], f"reset to the engine's own model ({why})"), {}
    if applied == target_version:
        return PullPlan(target_version, applied, None, [], f"no-op: already at v{target_version}"), {}
    if applied is not None and target_version < applied:
        raise BackwardPullError(target_version, applied)
    floor = applied if applied is not None else 0
    indexes: dict[int, VersionIndex] = {}
    full_at = None
    v = target_version
    while v > floor:
        try:
            idx = read_version_index(source_dir, v)
        except VersionMissingError as e:
            if v == target_version:
                raise
            raise ChainBrokenError(v, target_version, e.path) from None
        indexes[v] = idx
        if idx.kind == "full":
            full_at = v
            break
        v -= 1
    if full_at is not None:
        deltas = list(range(full_at + 1, target_version + 1))
        seed = SeedSource("full", full_at, indexes[full_at].path)
        reason = f"seed from {version_dir_name(full_at)} (newest full version <= v{target_version}; {why})"
    elif applied is None:
        deltas = list(range(1, target_version + 1))
        seed = seed0
        reason = f"seed from the engine's own model, version 0 ({why})"
    else:
        deltas = list(range(applied + 1, target_version + 1))
        seed = None
        reason = f"{why}"
    if deltas:
        reason += f"; chain {len(deltas)} delta(s) v{deltas[0]}..v{deltas[-1]}"
    return PullPlan(target_version, applied, seed, deltas, reason), indexes
