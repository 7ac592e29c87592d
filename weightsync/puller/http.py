"""``pull`` with an HTTP(S) URL as the source dir (a static server, or a caching tier in front
of one): the bucket's mirror path (``puller.bucket``), with the source listed by walking indexes
(``storage.http``). ``pull`` dispatches here and passes itself in (this module imports no
``pull``: the dispatch would be a circle).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..errors import (
    BucketCredentialsError,
    BucketUnavailableError,
    CorruptArtifactError,
    InvalidRequestError,
    LocalStateError,
    PayloadFileMismatchError,
    SourceNotReadyError,
    VersionMissingError,
    WeightSyncError,
    name_the_source,
)
from ..format.layout import INDEX_NAME, state_path, version_dir_name
from ..format.manifest import parse_version_number, read_applied_state
from ..storage.http import NO_CACHE, HttpSource, parse_http_url
from ..storage.mirror import Mirror, mirror_dir
from .mirrored import check_mirrored_request, planning_origin, tell_the_fallback
from .mirrored import plan_keys as plan_mirrored_keys
from .seed import HAND_OVER

log = logging.getLogger(__name__)


def pull_from_http(
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
    """Pull ``target_version`` from an HTTP(S) source (``run_pull``: ``puller.pull``): the
    bucket's mirror path (``puller.bucket``), with this source's listing by walking indexes.
    The walk first stops at the local version; a pull whose plan needs more (a reseed, another
    origin) fails typed on an unfetched file, and is run once more with every version down to a
    full one or v1 fetched: the slower sound path."""
    url = parse_http_url(source_url)
    user_hook = check_mirrored_request(local_checkpoint_dir, target_version, pre_read_hook, check_local_dir,
                                       bool(kwargs.get("force", False)))
    source = HttpSource(url)

    def check_published(version: int) -> None:
        key = f"{version_dir_name(version)}/{INDEX_NAME}"
        try:
            source._get(source.origin, key, NO_CACHE)
        except FileNotFoundError:
            raise VersionMissingError(version, f"{source.origin}/{key}") from None

    if target_version > 0 and not os.path.isdir(local_checkpoint_dir):
        check_published(target_version)  # a version not there yet leaves no trace
    # Named after the origin, not the cache: a host that changes caches keeps its local state.
    root = mirror_dir(local_checkpoint_dir, source.origin)  # type: ignore[arg-type]  # hashes str() only
    os.makedirs(root, exist_ok=True)
    mirror = Mirror(source, root, fetch_progress)  # type: ignore[arg-type]  # duck-typed source
    source.target = target_version
    mirror.sync_run_file()

    state = read_applied_state(state_path(local_checkpoint_dir))
    if state is not None and os.path.realpath(state.source_dir or "") == os.path.realpath(root):
        try:
            source.floor = parse_version_number(state.version, "version", state_path(local_checkpoint_dir))
        except WeightSyncError:
            source.floor = None

    def plan_keys(target: int) -> tuple[set[str], str]:
        # The marker as read before the pull, as the bucket's pull prices its plan.
        return plan_mirrored_keys(local_checkpoint_dir, seed_dir, root, target, planning_origin(root, seed_dir, state))

    def hook(_mirror_root: str, version: int) -> None:
        if user_hook is not None:
            user_hook(str(url), version)
            mirror.sync_run_file()
        source.target = version
        check_published(version)
        mirror.prepare(version, lambda: plan_keys(version))

    # A seed from a fetched full version or anchor takes the mirror's file (one write, no copy).
    hand_over = HAND_OVER.set(mirror.hand_over)
    try:
        try:
            result = run_pull(local_checkpoint_dir, seed_dir, root, target_version, hook, **kwargs)
        except (InvalidRequestError, BucketCredentialsError, BucketUnavailableError, PayloadFileMismatchError):
            raise
        except WeightSyncError as first:
            if isinstance(first, SourceNotReadyError) and source.floor is None:
                raise
            if source.floor is None and not mirror.has_placeholders():
                raise
            if str(getattr(first, "path", "")).endswith(INDEX_NAME):
                raise  # an index the mirror holds whole: listing or fetching more cannot change it
            first_said = str(name_the_source(first, root, str(url)))
            log.warning("pull v%d from %s: %s; listing every version down to a full one and pulling once more",
                        target_version, url, first_said)
            source.floor = None
            mirror.materialize_all = True
            result = run_pull(local_checkpoint_dir, seed_dir, root, target_version, hook, **kwargs)
            tell_the_fallback(result, first_said, "with every version down to a full one fetched",
                              reseed=isinstance(first, (LocalStateError, CorruptArtifactError)))
    except WeightSyncError as e:
        name_the_source(e, root, str(url))
        raise
    finally:
        HAND_OVER.reset(hand_over)
    result.hook_ran = result.hook_ran and user_hook is not None
    return result


__all__ = ["pull_from_http"]
