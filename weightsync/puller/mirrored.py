"""What the pulls through a host-local mirror share (``puller.bucket``, ``puller.http``): the
request's checks before anything is made, the origin the plan is priced with, and the keys a plan
reads."""

from __future__ import annotations

import os
from typing import Callable

from ..errors import InvalidRequestError, SourceNotReadyError
from ..format.layout import run_path, version_dir_name
from ..format.manifest import read_run_id
from ..hooks import load_callable
from .identity import NO_SEED, Origin, source_origin
from .plan import check_target_version, plan_pull


def check_mirrored_request(local_checkpoint_dir, target_version, pre_read_hook,
                           check_local_dir: Callable[[str, bool], None], force: bool):
    """Refuse a bad request before the mirror is made inside LOCAL; returns the user's hook."""
    check_target_version(target_version)
    if not isinstance(local_checkpoint_dir, str) or not local_checkpoint_dir:
        raise InvalidRequestError(f"local_checkpoint_dir must be a non-empty path, got {local_checkpoint_dir!r}")
    user_hook = load_callable(pre_read_hook, what="pre-read hook", error=InvalidRequestError)
    check_local_dir(local_checkpoint_dir, force)
    return user_hook


def planning_origin(root: str, seed_dir: str, state) -> Origin:
    """The seed's fingerprint as the marker recorded it, when there is one: the pull computes the
    real one right after the hook (reading a tmpfs seed in full), so computing it here too would
    double that cost. Should the seed have changed since, the pull plans past what was fetched,
    fails typed, and the caller's fallback fetches everything."""
    if state is not None and state.seed:
        return Origin(os.path.realpath(root), read_run_id(run_path(root)), state.seed)
    if state is None:
        # No marker: the plan seeds whatever the seed's fingerprint is (it is compared with a
        # marker's only), so it is not computed here as well as by the pull.
        return Origin(os.path.realpath(root), read_run_id(run_path(root)), NO_SEED)
    return source_origin(root, seed_dir)


def plan_keys(local_checkpoint_dir: str, seed_dir: str, root: str, target: int, origin: Origin) -> tuple[set[str], str]:
    """The mirror's keys the pull's plan reads (the chain's delta shards, a full or anchor seed's
    shards), and the plan's reason."""
    plan, indexes = plan_pull(local_checkpoint_dir, seed_dir, root, target, origin=origin)
    keys: set[str] = set()
    # The mirror holds a file (its bytes or a placeholder) for every object the source lists, and
    # nothing else: a file the plan names that is not there is not in the source either. Said
    # here, in the words the directory pull uses when it meets the same gap (puller.apply,
    # puller.seed), before anything is fetched.
    for v in plan.deltas:
        index = indexes[v]
        for f in sorted(set(index.weight_map.values())):
            if not os.path.lexists(os.path.join(index.path, f)):
                raise SourceNotReadyError(
                    f"v{index.version}: the index names shard {f}, which is not in {index.path}. "
                    "The source may not show it yet (a publish in flight, or a pruner); retry later."
                )
        keys |= {f"{version_dir_name(v)}/{f}" for f in set(index.weight_map.values())}
    if plan.seed is not None and plan.seed.kind in ("full", "anchor"):
        d = os.path.basename(plan.seed.path.rstrip(os.sep))
        label = "side anchor" if plan.seed.kind == "anchor" else "full version"
        for f in sorted(plan.seed.shard_files):
            if not os.path.lexists(os.path.join(plan.seed.path, f)):
                raise SourceNotReadyError(
                    f"{label} v{plan.seed.version} names shard {f}, which is not in {plan.seed.path} yet"
                )
        keys |= {f"{d}/{f}" for f in plan.seed.shard_files}
    return keys, plan.reason


def tell_the_fallback(result, first: str, how: str, reseed: bool = True) -> None:
    """A pull through the mirror that failed once and succeeded on its second run (``how``: what
    that run had more of). The first failure (a replay after a reseed reaching an unfetched
    shard) cleared the marker, so the second run says "no applied-version marker"; what happened
    is a reseed after that failure: ``reseeded`` says so when the second run seeded and the
    first failure was one a reseed answers (``reseed``), and the reason names the failure."""
    if reseed and "seed" in result.action:
        result.reseeded = True
    result.reason = f"{result.reason} (the first try, with only the planned files fetched, failed: {first}; the second, {how}, succeeded)"
