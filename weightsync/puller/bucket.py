"""``pull`` with a bucket URL as the source dir: today's pull on a host-local mirror of the
bucket (``storage.mirror``), which the pre-read hook fills, inside the host lock, with exactly
the objects the plan reads. ``pull`` dispatches here and passes itself in (this module imports
no ``pull``: the dispatch would be a circle).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from ..errors import (
    BucketUnavailableError,
    CorruptArtifactError,
    LocalStateError,
    LockTimeoutError,
    VersionMissingError,
    WeightSyncError,
    name_the_source,
)
from ..format.layout import INDEX_NAME, state_path, version_dir_name
from ..format.manifest import read_applied_state
from ..storage.mirror import Mirror, mirror_dir
from ..storage.source import BucketSource
from ..storage.url import parse_bucket_url
from .lock import acquire_host_lock
from .mirrored import check_mirrored_request, planning_origin, tell_the_fallback
from .mirrored import plan_keys as plan_mirrored_keys
from .seed import HAND_OVER

log = logging.getLogger(__name__)


def pull_from_bucket(
    run_pull: Callable,
    check_local_dir: Callable[[str, bool], None],
    local_checkpoint_dir: str,
    seed_dir: str,
    source_url: str,
    target_version: int,
    pre_read_hook=None,
    *,
    fetch_progress: "Callable[[int, int], None] | None" = None,
    **kwargs,
):
    """Pull ``target_version`` from the bucket ``source_url`` (``run_pull``: ``puller.pull``;
    ``check_local_dir``: its refusal of a local dir that is not ours, run before the mirror is
    created inside it). The pre-read hook gets the URL. ``fetch_progress(bytes_done,
    bytes_total)`` follows the fetch."""
    url = parse_bucket_url(source_url)
    user_hook = check_mirrored_request(local_checkpoint_dir, target_version, pre_read_hook, check_local_dir,
                                       bool(kwargs.get("force", False)))
    source = BucketSource(url)
    if target_version > 0 and not os.path.isdir(local_checkpoint_dir):
        _check_published(source, target_version)  # a version not there yet leaves no trace (no dir, no lock)
    root = mirror_dir(local_checkpoint_dir, url)
    os.makedirs(root, exist_ok=True)
    mirror = Mirror(source, root, fetch_progress)
    mirror.sync_run_file()  # before the no-op check: a new run under the URL is seen

    def plan_keys(target: int) -> tuple[set[str], str]:
        state = read_applied_state(state_path(local_checkpoint_dir))
        return plan_mirrored_keys(local_checkpoint_dir, seed_dir, root, target, planning_origin(root, seed_dir, state))

    def hook(_mirror_root: str, version: int) -> None:
        if user_hook is not None:
            user_hook(str(url), version)  # e.g. a credential refresh: before the first request
            mirror.sync_run_file()
        _check_published(source, version)
        mirror.prepare(version, lambda: plan_keys(version))

    # A seed from a fetched full version or anchor takes the mirror's file (one write, no copy).
    hand_over = HAND_OVER.set(mirror.hand_over)
    try:
        try:
            result = run_pull(local_checkpoint_dir, seed_dir, root, target_version, hook, **kwargs)
        except (CorruptArtifactError, LocalStateError) as first:
            # What reading a placeholder gives (a header that cannot be one); anything else (not
            # ready, a bad request, the lock, the store) is the pull's own answer.
            if not mirror.has_placeholders() or str(getattr(first, "path", "")).endswith(INDEX_NAME):
                raise  # an index is never a placeholder (the mirror holds each whole, or one over the limit)
            # A fallback inside the pull (a replay, another anchor) planned past what was fetched.
            first_said = str(name_the_source(first, root, str(url)))
            log.warning("pull v%d from %s: %s; fetching every shard up to v%d and pulling once more",
                        target_version, url, first_said, target_version)
            mirror.materialize_all = True
            result = run_pull(local_checkpoint_dir, seed_dir, root, target_version, hook, **kwargs)
            tell_the_fallback(result, first_said, "with every shard up to the target fetched")
    except WeightSyncError as e:
        name_the_source(e, root, str(url))
        raise
    finally:
        HAND_OVER.reset(hand_over)
    result.hook_ran = result.hook_ran and user_hook is not None
    _empty_the_spool(local_checkpoint_dir, mirror, deferred=not result.durable)
    return result


def _empty_the_spool(local: str, mirror: Mirror, deferred: bool) -> None:
    """The fetched shards go back to placeholders once the pull no longer needs them, under the
    host lock (another pull may be reading the mirror). After a sync pull: now, if the lock is
    free (else the next pull's refresh does it). After a deferred one, whose flush holds the lock
    until the marker is written: from a thread that waits for it."""

    def evict(timeout_s: float) -> None:
        try:
            held = acquire_host_lock(local, timeout_s)
        except (LockTimeoutError, OSError):
            return
        if held is None:
            return
        try:
            freed = mirror.evict_fetched()
            if freed:
                log.info("%s: spool emptied (%d bytes)", mirror.source.name, freed)
        except OSError as e:
            log.warning("%s: emptying the spool failed (%s); the next pull does it", mirror.source.name, e)
        finally:
            held.release()

    if deferred:
        threading.Thread(target=evict, args=(600.0,), name="weightsync-spool", daemon=True).start()
    else:
        evict(0.0)


def _check_published(source: BucketSource, version: int) -> None:
    """Something is under the version's prefix (one LIST, which reads no object: an index over
    the index limit is refused by its listed size, not downloaded): its index, or an index-less
    version, which the directory pull's rules judge on the mirror (a full version, or "still
    publishing" naming what it found). Nothing there: "not ready"."""
    d = version_dir_name(version)
    key = f"{d}/{INDEX_NAME}"
    try:
        if source.list(d + "/"):
            return
    except BucketUnavailableError:
        # A bucket not created yet answers a LIST with an error but a GET with "not found":
        # the GET decides, and a store that is down fails it too.
        try:
            source.read(key)
            return
        except FileNotFoundError:
            pass
    raise VersionMissingError(version, f"{source.name}/{key}") from None


__all__ = ["pull_from_bucket"]
