"""Pull: bring a host-local checkpoint to a target version.

    pull(local_checkpoint_dir, seed_dir, source_dir, target_version, pre_read_hook)

One pull per host at a time (a flock on host-local disk); a caller that finds the work done
returns at once. The pre-read hook runs once per host, inside the lock, only when there is work.
Faults are told apart (see ``errors``): a source that is not ready leaves the local state
untouched; a torn or corrupt local state is reseeded once and the chain replayed (verifying each
version); a bad artifact fails loud, naming tensors and digests. The applied-version marker
never points at bytes that were not verified and flushed to disk.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Literal

import msgspec
import numpy as np

from .. import knobs
from ..errors import (
    AnchorUnusableError,
    LayoutMismatchError,
    LocalDirNotOursError,
    LocalDirUnusableError,
    SeedDirUnusableError,
    SourceDirUnusableError,
    VersionMissingError,
    VersionPrunedError,
    ChainBrokenError,
    ChecksumMismatchError,
    CorruptArtifactError,
    InvalidRequestError,
    LocalStateError,
    LocalTensorMismatchError,
    SourceNotReadyError,
    WeightSyncError,
    host_resource_error,
)
from ..format.checksum import tensor_hasher
from ..format.layout import (
    ANCHOR_DIR_RE,
    RUN_NAME,
    VERSION_DIR_RE,
    anchor_dir_name,
    format_version,
    index_path,
    list_versions,
    run_path,
    state_path,
    sync_dir,
    verified_path,
    version_dir,
)
from ..format.manifest import (
    check_anchor,
    checkpoint_weight_files,
    is_committed,
    parse_version_number,
    read_applied_state,
    read_run_id,
    read_version_index,
)
from ..format.safetensors_io import local_tensor_table
from ..fsio import is_pid_alive, write_bytes
from ..hooks import load_callable
from ..storage.url import is_bucket_url
from ..storage.http import is_http_url

if TYPE_CHECKING:
    from ..storage.swarm import SwarmConfig
from .apply import (
    VerifyFailed,
    _close_map,
    _hash_in_chunks,
    apply_chain,
    check_against_local,
    fsync_files,
    load_delta,
    local_table,
)
from .identity import NO_SEED, Origin, explain_seed_dir, seed_fingerprint, seed_fingerprint_started
from .lock import HeldLock, acquire_host_lock
from .plan import PullPlan, SeedSource, check_target_version, files_nbytes, plan_pull, read_applied_version
from .seed import invalidate_marker, seed_local_checkpoint, write_marker

log = logging.getLogger(__name__)

Hook = Callable[[str, int], None]
Durability = Literal["sync", "deferred"]


class PullResult(msgspec.Struct):
    applied_version: int
    action: str
    reason: str
    deltas_applied: int = 0
    seconds: float = 0.0
    hook_ran: bool = False
    nbytes_read: int = 0  # delta payload bytes loaded
    seed_nbytes: int = 0  # bytes the seed copied (from the seed dir or the source dir)
    source_nbytes: int = 0  # bytes read from the source dir: delta shards plus a full version's or anchor's files
    reseeded: bool = False
    lock_wait_s: float = 0.0
    seed_s: float = 0.0
    apply_s: float = 0.0
    durable: bool = True  # False: pages still being flushed; the marker follows (deferred)
    flush_s: float = 0.0


class _PendingFlush(msgspec.Struct):
    paths: list[str]
    version: int
    origin: Origin


_flushers: dict[str, threading.Thread] = {}
_flushers_lock = threading.Lock()


def wait_until_durable(local_checkpoint_dir: str, timeout_s: float | None = None) -> bool:
    """Wait for a deferred flush of this local dir (in this process); True when none is pending."""
    with _flushers_lock:
        t = _flushers.get(os.path.realpath(local_checkpoint_dir))
    if t is None:
        return True
    t.join(timeout_s)
    return not t.is_alive()


def verified_by_peer(local_checkpoint_dir: str, target_version: int, source_real: str, origin: Origin | None = None) -> int | None:
    """The pid of a live pull on this host that holds ``target_version`` verified in the page
    cache and is flushing it (deferred durability), or None. With ``origin``, the note's run
    and seed (when it names them) must match too."""
    try:
        with open(verified_path(local_checkpoint_dir), "rb") as f:
            obj = json.loads(f.read(1 << 12))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    pid = obj.get("pid")
    if obj.get("version") != format_version(target_version) or obj.get("source_dir") != source_real:
        return None
    if origin is not None and (obj.get("run", origin.run), obj.get("seed", origin.seed)) != (origin.run, origin.seed):
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or not is_pid_alive(pid):
        return None
    return pid


def _clear_verified(local: str) -> None:
    try:
        os.unlink(verified_path(local))
    except FileNotFoundError:
        pass


def _finish_in_background(local: str, pending: _PendingFlush, held: HeldLock) -> None:
    # Co-located callers waiting for the lock read this note and return at once: the bytes they
    # would wait for are verified already. The note is removed before the lock is released,
    # whether the marker could be written or not.
    o = pending.origin
    note = {"version": format_version(pending.version), "source_dir": o.source_dir, "pid": os.getpid()}
    note.update({k: v for k, v in (("run", o.run), ("seed", o.seed)) if v is not None})
    write_bytes(verified_path(local), json.dumps(note).encode())

    def run() -> None:
        try:
            t = time.perf_counter()
            fsync_files(pending.paths)
            write_marker(local, pending.version, pending.origin)
            log.info("v%d durable: %d file(s) flushed in %.3fs, marker written", pending.version, len(pending.paths), time.perf_counter() - t)
        except Exception:
            # No marker: the next pull reseeds and replays rather than trusting these bytes.
            log.exception("deferred flush of %s failed; the next pull will reseed", local)
        finally:
            try:
                _clear_verified(local)
            finally:
                held.release()

    key = os.path.realpath(local)
    thread = threading.Thread(target=run, name="weightsync-flush", daemon=False)
    with _flushers_lock:
        _flushers[key] = thread
    thread.start()


def load_hook(hook: "str | Hook | None") -> Hook | None:
    return load_callable(hook, what="pre-read hook", error=InvalidRequestError)


def _check_dirs(local_checkpoint_dir: str, seed_dir: str, source_dir: str) -> None:
    for label, value in (("local_checkpoint_dir", local_checkpoint_dir), ("seed_dir", seed_dir), ("source_dir", source_dir)):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{label} must be a non-empty path, got {value!r}")
    local_real, seed_real = os.path.realpath(local_checkpoint_dir), os.path.realpath(seed_dir)
    if local_real == seed_real:
        raise InvalidRequestError(
            f"seed dir {seed_dir} is the local checkpoint dir itself; the seed dir must be the engine's "
            "original model path (captured at start-up), never the dir being patched"
        )
    if os.path.realpath(source_dir) == local_real:
        raise InvalidRequestError("source_dir and local_checkpoint_dir must be different directories")


def _typed_resource_errors(fn: Callable[..., PullResult]) -> Callable[..., PullResult]:
    """An OS resource failure anywhere in a pull surfaces as ``HostResourceError``, never a
    bare OSError (the marker is already honest: cleared before the first write)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> PullResult:
        try:
            return fn(*args, **kwargs)
        except (OSError, MemoryError) as e:
            typed: WeightSyncError | None = host_resource_error(e)
            if typed is None and isinstance(e, OSError) and len(args) >= 3:
                typed = _type_path_error(e, *args[:3])
            if typed is None:
                raise
            raise typed from e

    return wrapper


def _type_path_error(e: OSError, local: object, seed_dir: object, source_dir: object) -> WeightSyncError | None:
    """The typed error of an OS error on a path of the pull's dirs, by whose path it is: the
    source's (a file where the index names a shard is a directory: the version is malformed;
    a file this host may not read: the request cannot be served), the seed dir's, or the local
    dir's. None: not one of them, or a FileNotFoundError (decided where it is raised)."""
    if isinstance(e, (WeightSyncError, FileNotFoundError)) or not all(isinstance(d, str) for d in (local, seed_dir, source_dir)):
        return None
    what = f"{type(e).__name__}: {e.strerror or e} ({os.fsdecode(e.filename) if e.filename is not None else '?'})"
    if _inside(e, str(source_dir)):
        if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.ELOOP):
            return CorruptArtifactError(f"the source dir holds something other than a file where a version names one: {what}. "
                                        "Republish the version.")
        return SourceDirUnusableError(str(source_dir), f"cannot be read on this host ({what})")
    if _inside(e, str(seed_dir)):
        return SeedDirUnusableError(str(seed_dir), what)
    if _inside(e, str(local)):
        return LocalDirUnusableError(str(local), what)
    return None


@_typed_resource_errors
def pull(
    local_checkpoint_dir: str,
    seed_dir: str,
    source_dir: str,
    target_version: int,
    pre_read_hook: "str | Hook | None" = None,
    *,
    lock_timeout_s: float | None = None,
    workers: int | None = None,
    durability: Durability = "sync",
    progress: "Callable[[int, int], None] | None" = None,
    force: bool = False,
    swarm: "SwarmConfig | bool | None" = None,
) -> PullResult:
    """Bring ``local_checkpoint_dir`` to ``target_version``.

    Args:
        local_checkpoint_dir: host-local checkpoint to patch (created on first pull).
        seed_dir: the engine's own model, i.e. version 0; never the local dir itself.
        source_dir: the shared dir holding ``weight_vNNNNNN/``.
        target_version: version to reach; 0 resets to the seed dir.
        pre_read_hook: ``fn(source_dir, target_version)`` or its import path, run inside the
            lock before reading the source when there is work to do.
        lock_timeout_s: how long to wait for another pull on this host (0: fail at once).
        workers: apply threads (default: one per core).
        durability: ``"sync"`` returns once the bytes are on disk and the marker written;
            ``"deferred"`` returns once every tensor is applied and verified (in the page cache,
            so an engine may reload at once) and flushes in a background thread that writes the
            marker and releases the host lock afterwards. A crash before that leaves no marker:
            the next pull reseeds. Later pulls on the host wait for the flush, except those
            for the same version, which return at once ("noop", ``durable=False``): while
            the flush runs, ``.weight_sync/verified.json`` names the version and the live pid.
        progress: ``fn(tensors_done, tensors_total)``, called as tensors are applied.
        force: pull into a non-empty dir that weightsync did not write (no ``.weight_sync/``),
            replacing its files; refused otherwise (``LocalDirNotOursError``).
        swarm: an HTTP(S) source only: fetch the version's payload files from the fleet's
            BitTorrent v2 swarm first (``storage.swarm``, docs/FLEET.md), the source as web seed and
            fallback. None: as ``WEIGHTSYNC_SWARM_PEERS`` says (off when unset); False: off.

    Returns:
        PullResult with the plan's action and reason, and timings.

    Raises:
        InvalidRequestError, BackwardPullError: the request cannot be served (a source dir that
            does not exist or holds no run, a pruned version, a seed dir that is not a complete
            checkpoint, a local dir holding someone else's files).
        SourceNotReadyError: the version (or one it needs) is not published yet; nothing changed.
        CorruptArtifactError: the published artifact is bad (after one reseed and replay).
        LocalStateError: the local checkpoint is broken in a way a reseed did not fix.
        LockTimeoutError: another pull held the host lock too long.
    """
    if is_bucket_url(source_dir):
        # A bucket: its objects are fetched into a host-local mirror, then this same pull runs on it.
        from .bucket import pull_from_bucket

        return pull_from_bucket(pull, _check_local_dir, local_checkpoint_dir, seed_dir, source_dir, target_version,
                                pre_read_hook, lock_timeout_s=lock_timeout_s, workers=workers, durability=durability,
                                progress=progress, force=force)
    if is_http_url(source_dir):
        # An HTTP(S) source (a static server, or a caching tier in front of one): the same mirror.
        swarm_cfg = _swarm_config(swarm)
        if swarm_cfg is not None:  # the fleet's swarm first, the source as web seed and fallback
            return _pull_with_swarm(swarm_cfg, local_checkpoint_dir, seed_dir, source_dir, target_version, pre_read_hook,
                                    lock_timeout_s=lock_timeout_s, workers=workers, durability=durability,
                                    progress=progress, force=force)
        from .http import pull_from_http

        return pull_from_http(pull, _check_local_dir, local_checkpoint_dir, seed_dir, source_dir, target_version,
                              pre_read_hook, lock_timeout_s=lock_timeout_s, workers=workers, durability=durability,
                              progress=progress, force=force)
    t0 = time.perf_counter()
    _check_dirs(local_checkpoint_dir, seed_dir, source_dir)
    check_target_version(target_version)
    hook = load_hook(pre_read_hook)
    n_workers = knobs.workers(knobs.APPLY_WORKERS, workers)
    chunk = int(knobs.CHUNK_NBYTES.get())
    if durability not in ("sync", "deferred"):
        raise InvalidRequestError(f"durability must be 'sync' or 'deferred', got {durability!r}")
    _check_local_dir(local_checkpoint_dir, force)
    if target_version > 0 and hook is None:
        check_source_dir(source_dir)
        if not os.path.isdir(local_checkpoint_dir):
            # A first pull of a version that is not there yet must leave no trace (no dir, no lock).
            _read_target_index(source_dir, target_version)
    # With a pre-read hook (a pull through a mirror: its fetch runs in the hook) a seed fingerprint
    # that hashes every byte is computed while the hook runs; it is waited for only where it is
    # read: a co-located pull's note, a marker that names the target, and after the hook.
    if hook is not None and target_version > 0:
        seed_of = seed_fingerprint_started(seed_dir)
    else:
        fingerprint = seed_fingerprint(seed_dir)
        seed_of = None if fingerprint == NO_SEED else (lambda: fingerprint)

    def unusable_seed() -> SeedDirUnusableError:
        return SeedDirUnusableError(seed_dir, explain_seed_dir(seed_dir) or "it is not a readable checkpoint")

    if seed_of is None:
        raise unusable_seed()
    source_real = os.path.realpath(source_dir)

    def origin_now(run: "str | None") -> Origin:
        seed = seed_of()
        if seed == NO_SEED:
            raise unusable_seed()
        return Origin(source_real, run, seed)

    run_id = read_run_id(run_path(source_dir))
    with _local_faults(local_checkpoint_dir):
        os.makedirs(local_checkpoint_dir, exist_ok=True)
    peer: list[int] = []

    def done_by_peer() -> bool:
        pid = verified_by_peer(local_checkpoint_dir, target_version, source_real, origin_now(run_id)) if target_version > 0 else None
        if pid is not None:
            peer.append(pid)
        return pid is not None

    with _local_faults(local_checkpoint_dir):
        held = acquire_host_lock(local_checkpoint_dir, lock_timeout_s, give_up=done_by_peer)
    if held is None:
        result = PullResult(
            target_version, "noop",
            f"no-op: v{target_version} is applied and verified by a co-located pull (pid {peer[0]}), "
            "which is flushing it to disk",
            durable=False,
        )
        result.seconds = time.perf_counter() - t0
        log.info("pull v%d: %s", target_version, result.reason)
        return result
    handed_off = False
    try:
        _clear_verified(local_checkpoint_dir)  # a note left by a pull that died before its flush
        applied = None
        if _marker_may_name(local_checkpoint_dir, target_version):
            applied, _ = read_applied_version(local_checkpoint_dir, origin_now(run_id))
        if applied == target_version:
            result = PullResult(target_version, "noop", f"no-op: already at v{target_version}", lock_wait_s=held.waited_s)
            result.seconds = time.perf_counter() - t0
            log.info("pull v%d: %s", target_version, result.reason)
            return result
        hook_ran = False
        if hook is not None and target_version > 0:
            # Object-store-backed shared filesystems show the publisher's files only after an
            # explicit refresh; the deployment supplies it as this hook.
            hook(source_dir, target_version)
            hook_ran = True
            check_source_dir(source_dir)  # after the refresh: what it shows is what counts
            # The refresh may have shown the run file; the seed dir is the engine's own, not what
            # the hook refreshes, so its fingerprint (all of a tmpfs seed's bytes hashed) stands.
            run_id = read_run_id(run_path(source_dir))
        origin = origin_now(run_id)
        try:
            with _local_faults(local_checkpoint_dir):
                result, pending = _pull_locked(
                    local_checkpoint_dir, seed_dir, source_dir, target_version, n_workers, chunk, durability == "deferred",
                    progress, origin,
                )
        except VersionMissingError as e:
            if e.version != target_version:
                raise
            raise _explain_missing_target(source_dir, target_version, e) from None
        except FileNotFoundError as e:
            vanished = _vanished_from_source(e, source_dir)
            if vanished is None:
                raise
            raise vanished from e
        result.hook_ran = hook_ran
        result.lock_wait_s = held.waited_s
        if pending is not None:
            result.durable = False
            _finish_in_background(local_checkpoint_dir, pending, held)
            handed_off = True
    finally:
        if not handed_off:
            held.release()
    result.seconds = time.perf_counter() - t0
    log.info(
        "pull v%d done in %.3fs%s: %s%s", target_version, result.seconds,
        "" if result.durable else " (verified; flushing in the background)", result.reason,
        " (after a reseed)" if result.reseeded else "",
    )
    return result


def _marker_may_name(local_checkpoint_dir: str, target_version: int) -> bool:
    """Whether the marker could make this pull a no-op (it names the target, or cannot be read
    here: the full check then says why); when not, the no-op check needs no seed fingerprint."""
    try:
        state = read_applied_state(state_path(local_checkpoint_dir))
        return state is not None and parse_version_number(state.version, "version", state_path(local_checkpoint_dir)) == target_version
    except (WeightSyncError, OSError, ValueError):
        return True


def _swarm_config(swarm: "SwarmConfig | bool | None") -> "SwarmConfig | None":
    if swarm is False:
        return None
    from ..storage.swarm import SwarmConfig

    if swarm is None or swarm is True:
        cfg = SwarmConfig.from_env()
        if cfg is None and swarm is True:
            raise InvalidRequestError("swarm=True needs WEIGHTSYNC_SWARM_PEERS or WEIGHTSYNC_SWARM_TRACKER (whom to ask)")
        return cfg
    if not isinstance(swarm, SwarmConfig):
        raise InvalidRequestError(f"swarm must be a SwarmConfig, True, False or None, got {swarm!r}")
    return swarm


def _pull_with_swarm(cfg: "SwarmConfig", local: str, seed_dir: str, source_url: str, target: int, hook, **kw) -> PullResult:
    """The HTTP pull with the swarm as the mirror's first step: what it delivers (checked against
    the index's file digests) is not fetched from the source; the per-tensor verification decides."""
    from ..storage.http import parse_http_url
    from ..storage.mirror import PREFETCH
    from ..storage.swarm import check_swarm_available, mirror_prefetcher
    from .http import pull_from_http

    if not isinstance(local, str) or not local:
        raise InvalidRequestError(f"local_checkpoint_dir must be a non-empty path, got {local!r}")
    url = parse_http_url(source_url)
    check_swarm_available()  # refused before anything is written
    token = PREFETCH.set(mirror_prefetcher(cfg, local, str(url)))
    try:
        return pull_from_http(pull, _check_local_dir, local, seed_dir, source_url, target, hook, **kw)
    finally:
        PREFETCH.reset(token)


def _check_local_dir(local: str, force: bool) -> None:
    """Refuse, before anything is written, a local dir that cannot be one (a regular file, a dir
    this process cannot write) and a non-empty dir weightsync did not write (no ``.weight_sync/``):
    its files are the user's, and a seed would replace them. An engine's own local dir holds
    ``.weight_sync/`` from its first pull on (the lock lives there), so it always passes."""
    if os.path.lexists(local) and not os.path.isdir(local):
        raise LocalDirUnusableError(local, "it exists and is not a directory (a regular file?)")
    if not os.path.isdir(local):
        parent = os.path.dirname(os.path.abspath(local))
        while parent and not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise LocalDirUnusableError(local, f"it cannot be created: {parent} is not a directory")
        return
    if not os.access(local, os.W_OK | os.X_OK):
        raise LocalDirUnusableError(local, "this process cannot write into it (read-only)")
    if force or os.path.isdir(sync_dir(local)):
        return
    entries = sorted(n for n in os.listdir(local) if n != "lost+found")
    if entries:
        raise LocalDirNotOursError(local, entries)


@contextlib.contextmanager
def _local_faults(local: str):
    """An OS error on a path of the local checkpoint dir (read-only, not creatable, a file where
    a dir must be) is a local fault, typed; a resource failure stays ``HostResourceError``."""
    try:
        yield
    except OSError as e:
        if isinstance(e, WeightSyncError) or host_resource_error(e) is not None or not _inside(e, local):
            raise
        if isinstance(e, FileNotFoundError) and os.path.isdir(local):
            raise  # a file that vanished below an existing dir: the source's side decides
        raise LocalDirUnusableError(local, f"{type(e).__name__}: {e.strerror or e} ({os.fsdecode(e.filename)})") from e


def _inside(e: OSError, directory: str) -> bool:
    if e.filename is None:
        return False
    path = os.path.abspath(os.fsdecode(e.filename))
    roots = {os.path.abspath(directory), os.path.realpath(directory)}
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def check_source_dir(source_dir: str) -> None:
    """A source dir that does not exist, or holds no weightsync run, is a wrong path: a bad
    request, never "not ready" (a script with a typo would retry it forever). Holding a run
    means any of ``weightsync-run.json``, a ``weight_vNNNNNN/`` or an ``anchor_vNNNNNN/`` (an
    upstream writer's dir has version dirs only). An empty dir is "not ready": a publisher
    creates the dir just before its run file (FORMAT.md, "Pulling")."""
    if os.path.exists(os.path.join(source_dir, RUN_NAME)):
        return  # one stat: no listing of a long-lived source dir on every pull
    if not os.path.isdir(source_dir):
        raise SourceDirUnusableError(source_dir, "does not exist" if not os.path.lexists(source_dir) else "is not a directory")
    try:
        names = os.listdir(source_dir)
    except PermissionError as e:
        raise SourceDirUnusableError(source_dir, f"cannot be listed ({e.strerror})") from None
    if not names or RUN_NAME in names:
        return
    if any(VERSION_DIR_RE.match(n) or ANCHOR_DIR_RE.match(n) for n in names):
        return
    raise SourceDirUnusableError(
        source_dir, f"holds no weightsync run (no {RUN_NAME}, no weight_vNNNNNN/ or anchor_vNNNNNN/; it holds {sorted(names)[:5]})"
    )


def _read_target_index(source_dir: str, target: int):
    try:
        return read_version_index(source_dir, target)
    except VersionMissingError as e:
        raise _explain_missing_target(source_dir, target, e) from None


def _explain_missing_target(source_dir: str, target: int, e: VersionMissingError) -> WeightSyncError:
    """The target's dir is not there: pruned when a newer version is committed (versions
    commit in order, so it was published once), else not published yet."""
    newer = [v for v in list_versions(source_dir) if v > target and is_committed(version_dir(source_dir, v))]
    if not newer:
        return e
    kept = [v for v in list_versions(source_dir) if is_committed(version_dir(source_dir, v))]
    return VersionPrunedError(target, source_dir, kept[0] if kept else None)


def describe_local_state(local_checkpoint_dir: str) -> str:
    """One line on what the local dir holds now, for a pull that was interrupted: a verified
    version (its marker), or bytes no pull trusts (no marker: the next pull reseeds or
    re-verifies them)."""
    if not os.path.isdir(local_checkpoint_dir):
        return f"{local_checkpoint_dir} was not created; nothing changed"
    v = applied_version(local_checkpoint_dir)
    if v is not None:
        return f"{local_checkpoint_dir} holds verified v{v} (its marker names it); pull again to go on"
    return (f"{local_checkpoint_dir} has no applied-version marker: its bytes are partial and no pull trusts them; "
            "the next pull reseeds (or re-verifies) it")


def _vanished_from_source(e: FileNotFoundError, source_dir: str) -> SourceNotReadyError | None:
    """A file of the source dir that vanished mid-pull (pruned between plan and read): "not
    ready, retry", since the retry plans from what is published then. None for anything else
    (a typed error already, or a path outside the source dir)."""
    if isinstance(e, WeightSyncError) or not e.filename:
        return None
    path = os.path.abspath(os.fsdecode(e.filename))
    roots = {os.path.abspath(source_dir), os.path.realpath(source_dir)}
    if not any(path == r or path.startswith(r + os.sep) for r in roots):
        return None
    return SourceNotReadyError(
        f"{path} vanished from the source dir while the pull was reading it (pruned meanwhile?); "
        "the local marker names verified bytes or nothing. Retry the pull: it plans from what is published now."
    )


class _AnchorFailed(Exception):
    """A side anchor's seed failed its check: plan again without anchors (never a pull's failure)."""

    def __init__(self, version: int, detail: str):
        super().__init__(detail)
        self.version = version
        self.detail = detail


class _Tries(msgspec.Struct):
    """What one pull learnt across its attempts: a side anchor that failed is not planned again."""

    failed_anchors: set[int] = set()
    anchor_note: str = ""  # added to the reason once an anchor was dropped
    last_seed: str = ""


def _pull_locked(
    local: str, seed_dir: str, source_dir: str, target: int, workers: int, chunk: int, deferred: bool, progress,
    origin: Origin,
) -> tuple[PullResult, _PendingFlush | None]:
    tries = _Tries()
    try:
        return _plan_and_execute(
            local, seed_dir, source_dir, target, workers, chunk, deferred, progress, origin, tries,
            force_reseed=False, each_version=False,
        )
    except (LocalStateError, VerifyFailed) as first:
        detail = (
            f"{len(first.mismatches)} tensor(s) failed verification" if isinstance(first, VerifyFailed) else str(first)
        )
        log.warning("pull v%d: %s; reseeding once and replaying", target, detail)
    # The replay verifies each tensor once, against its newest digest: that digest covers the
    # final bytes, which is all a success promises (FORMAT.md, Notes). Only when it still fails
    # does a second replay verify version by version, to name the version that is bad.
    try:
        result, pending = _replay(local, seed_dir, source_dir, target, workers, chunk, deferred, progress, origin, tries, each_version=False)
    except VerifyFailed as second:
        log.warning(
            "pull v%d: %d tensor(s) still fail after a fresh seed; replaying once more, verifying every version, "
            "to name the bad one", target, len(second.mismatches),
        )
        try:
            result, pending = _replay(local, seed_dir, source_dir, target, workers, chunk, deferred, progress, origin,
                                      tries, each_version=True)
        except CorruptArtifactError as e:
            if tries.last_seed == seed_dir:  # the failing replay grew from the seed dir (not an anchor)
                _raise_if_wrong_seed_dir(seed_dir, source_dir, e)  # issue 25.3's pull-side message: one call site
            raise
    result.reseeded = True
    return result, pending


def _refuse_a_wrong_seed_dir(seed_dir: str, origin: Origin) -> None:
    """Before a seed from the seed dir writes anything: the run's smallest recorded seed tensors
    against the seed dir's (a few norm vectors, so every fresh seed can afford it). A run without
    a seed record passes on; a seed dir that passes is still verified in full by the chain, and a
    replay that fails after a fresh seed checks every recorded tensor (below)."""
    from ..errors import SeedDirMismatchError
    from ..format.seed_record import seed_dir_sample_differences

    differ = seed_dir_sample_differences(origin.source_dir, seed_dir)
    if differ:
        raise SeedDirMismatchError(seed_dir, origin.source_dir, differ)


def _raise_if_wrong_seed_dir(seed_dir: str, source_dir: str, cause: Exception) -> None:
    """A replay that still fails after a fresh seed: when the run records its seed's digests
    and the seed dir holds other bytes, the seed dir is wrong, not the published delta."""
    from ..errors import SeedDirMismatchError
    from ..format.seed_record import seed_dir_differences

    differ = seed_dir_differences(source_dir, seed_dir)
    if differ:
        raise SeedDirMismatchError(seed_dir, source_dir, differ) from cause


def _replay(
    local: str, seed_dir: str, source_dir: str, target: int, workers: int, chunk: int, deferred: bool, progress,
    origin: Origin, tries: _Tries, *, each_version: bool,
) -> tuple[PullResult, _PendingFlush | None]:
    try:
        return _plan_and_execute(
            local, seed_dir, source_dir, target, workers, chunk, deferred, progress, origin, tries,
            force_reseed=True, each_version=each_version,
        )
    except LocalTensorMismatchError as e:
        seed = tries.last_seed or seed_dir
        raise CorruptArtifactError(
            f"after a fresh seed from {seed}, the deltas up to v{target} still do not fit the checkpoint: {e}. "
            "The published chain does not belong to this model; republish from a full version."
        ) from e


def _plan_and_execute(
    local: str, seed_dir: str, source_dir: str, target: int, workers: int, chunk: int, deferred: bool, progress,
    origin: Origin, tries: _Tries, *, force_reseed: bool, each_version: bool,
) -> tuple[PullResult, _PendingFlush | None]:
    """Plan and execute; a side anchor that fails its check is dropped and the pull planned
    again without it (an older anchor, a full version or the seed dir, and the chain), so an
    anchor's damage never fails a pull, nor blames a version, while another way is published.
    Each failure drops one more anchor, so this ends."""
    what = "" if not force_reseed else (" (replay, verifying every version)" if each_version else " (replay)")
    last: _AnchorFailed | None = None
    while True:
        try:
            plan, indexes = plan_pull(local, seed_dir, source_dir, target, force_reseed=force_reseed, origin=origin,
                                      skip_anchors=tries.failed_anchors)
        except ChainBrokenError as e:
            if last is None:
                raise
            raise AnchorUnusableError(last.version, last.detail, target, e.needed_version) from None
        log.info("pull plan for v%d%s: %s", target, what, plan.reason)
        tries.last_seed = plan.seed.path if plan.seed else ""
        try:
            result, pending = _execute(plan, indexes, local, seed_dir, origin, workers, chunk,
                                       each_version=each_version, deferred=deferred, progress=progress)
            break
        except _AnchorFailed as bad:
            last, force_reseed = bad, True  # the seed cleared the marker: nothing local counts now
            tries.failed_anchors.add(bad.version)
            failed = ", ".join(anchor_dir_name(a) for a in sorted(tries.failed_anchors))
            tries.anchor_note = f"side anchor {failed} failed its check ({bad.detail}): planned again without it"
            log.warning("pull v%d: %s", target, tries.anchor_note)
    if tries.anchor_note:
        result.reason = f"{result.reason}; {tries.anchor_note}"
    return result, pending


def _seed(plan: PullPlan, local: str, seed_dir: str, origin: Origin, workers: int, chunk: int) -> tuple[int, int]:
    """Seed as planned; a side anchor's copy is checked against the anchor's digests before
    its marker, and any failure of it raises ``_AnchorFailed`` (or "not ready" when the anchor
    was pruned meanwhile)."""
    seed = plan.seed
    assert seed is not None
    if seed.kind == "seed_dir":
        _refuse_a_wrong_seed_dir(seed_dir, origin)
        return seed_local_checkpoint(local, seed, seed_dir, origin)
    reference = None if seed.layout_change else read_seed_layout(seed_dir)
    if seed.kind == "full":
        # Before any write: the source's headers.
        check_layout(seed.path, seed.shard_files, reference, f"full version v{seed.version}", seed_dir, seed.layout)

        def check_full(d: str) -> None:
            check_layout(d, seed.shard_files, reference, f"the copy of full version v{seed.version}", seed_dir,
                         seed.layout)
            if seed.digests is not None:
                _check_full_copy(d, seed, workers, chunk)

        return seed_local_checkpoint(local, seed, seed_dir, origin, verify=check_full)
    source_dir = os.path.dirname(seed.path.rstrip(os.sep))

    def check_anchor_copy(d: str) -> None:
        check_layout(d, seed.shard_files, reference, f"the copy of side anchor {anchor_dir_name(seed.version)}", seed_dir,
                     seed.layout)
        _check_anchor_copy(d, seed, workers, chunk)

    try:
        check_layout(seed.path, seed.shard_files, reference, f"side anchor {anchor_dir_name(seed.version)}", seed_dir,
                     seed.layout)
        return seed_local_checkpoint(local, seed, seed_dir, origin, verify=check_anchor_copy)
    except FileNotFoundError as e:  # SourceNotReadyError included: a shard not there
        check = check_anchor(source_dir, seed.version)
        if check.state != "bound":
            raise SourceNotReadyError(
                f"side anchor {anchor_dir_name(seed.version)} was removed while the pull was seeding from it ({e}); "
                "the local marker is cleared. Retry the pull: it plans from what is published now."
            ) from None
        raise _AnchorFailed(seed.version, f"a file is missing: {e}") from None
    except (CorruptArtifactError, LocalStateError) as e:
        raise _AnchorFailed(seed.version, str(e)) from None


Layout = dict[str, tuple[str, tuple[int, ...]]]


def read_seed_layout(seed_dir: str) -> Layout:
    """name -> (dtype, shape) of every tensor of the seed dir: the layout a full version or a
    side anchor must have (a version with fewer tensors would leave the engine serving the old
    weights of the missing ones beside the new ones: weights of no published version)."""
    try:
        table = local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir))
    except (OSError, CorruptArtifactError) as e:
        raise SeedDirUnusableError(seed_dir, f"its headers cannot be read: {e}") from None
    return {n: (e.dtype, e.shape) for n, (_, e) in table.items()}


def diff_layouts(actual: Layout, reference: Layout) -> list[str]:
    """Each way ``actual`` differs from ``reference``: missing and extra tensors, then each
    tensor whose dtype or shape differs, by name."""
    out = []
    missing, extra = sorted(set(reference) - set(actual)), sorted(set(actual) - set(reference))
    if missing:
        out.append(f"lacks tensors {missing[:10]}" + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
    if extra:
        out.append(f"holds tensors the model lacks {extra[:10]}" + (f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""))
    for n in sorted(set(actual) & set(reference)):
        (ad, ash), (rd, rsh) = actual[n], reference[n]
        if (ad, tuple(ash)) != (rd, tuple(rsh)):
            out.append(f"tensor {n} is {ad}{list(ash)}, the model's is {rd}{list(rsh)}")
    return out


def check_layout(
    directory: str, shard_files, reference: "Layout | None", what: str, seed_dir: str, recorded: "Layout | None" = None,
) -> None:
    """The headers of ``shard_files`` in ``directory`` have exactly the ``reference`` layout (the
    seed dir's: names, dtypes, shapes) and the one its index ``recorded`` (ours), else
    ``LayoutMismatchError`` naming the tensors. ``reference`` None: exempt (a version published
    with --allow-layout-change); the recorded layout still binds its headers."""
    for n in shard_files:
        if not os.path.exists(os.path.join(directory, n)):
            raise SourceNotReadyError(f"{what} names shard {n}, which is not in {directory} yet")
    table = local_tensor_table(directory, list(shard_files))
    actual = {n: (e.dtype, e.shape) for n, (_, e) in table.items()}
    if recorded is not None:
        bad = diff_layouts(actual, recorded)
        if bad:
            raise LayoutMismatchError(what, "its index's record", bad)
    if reference is not None:
        bad = diff_layouts(actual, reference)
        if bad:
            raise LayoutMismatchError(what, f"the seed dir {seed_dir}", bad)


def _check_full_copy(local: str, seed: SeedSource, workers: int, chunk: int) -> None:
    """A full version's copy against its index's digests: a mismatch is the version's damage
    (no chain crosses a full version, so nothing else could serve it)."""
    bad = _seed_mismatches(local, seed, workers, chunk)
    if bad:
        raise ChecksumMismatchError(seed.version, bad, seed.checksum_format or "")


def _check_anchor_copy(local: str, seed: SeedSource, workers: int, chunk: int) -> None:
    bad = _seed_mismatches(local, seed, workers, chunk)
    if bad:
        shown = "; ".join(f"{n}: expected {e}, got {a}" for n, e, a in bad[:3])
        raise CorruptArtifactError(f"{len(bad)} tensor(s) do not hash to its {seed.checksum_format} digests: {shown}")


def _seed_mismatches(local: str, seed: SeedSource, workers: int, chunk: int) -> list[tuple[str, str, str]]:
    """(name, expected, actual) of each tensor of the seeded copy that does not hash to the
    seed's digest. The copy must hold exactly the digests' tensors, each in the file its index
    names (else CorruptArtifactError). Reads the local copy (page cache)."""
    digests, fmt = seed.digests or {}, seed.checksum_format or ""
    table = local_tensor_table(local, list(seed.shard_files))
    if set(table) != set(digests):
        missing, extra = sorted(set(digests) - set(table)), sorted(set(table) - set(digests))
        raise CorruptArtifactError(f"its shards lack tensors {missing[:5]} or hold others {extra[:5]}")
    with open(index_path(local), "rb") as f:
        raw = f.read()
    try:
        wmap = json.loads(raw)["weight_map"]
        placed_in = {n: wmap.get(n) for n in table}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CorruptArtifactError("its copied index is not the one planned from (no weight_map object)") from None
    placed = [n for n, (path, _) in table.items() if placed_in[n] != os.path.basename(path)]
    if placed:
        raise CorruptArtifactError(f"tensors {sorted(placed)[:5]} are not in the shard its index names")

    # One read-only map per shard, shared by the workers (not an open and a map per tensor).
    maps: dict[str, mmap.mmap] = {}
    lock = threading.Lock()

    def shard_map(path: str) -> mmap.mmap:
        with lock:
            if path not in maps:
                with open(path, "rb") as fh:
                    maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            return maps[path]

    def mismatch(name: str) -> tuple[str, str, str] | None:
        path, entry = table[name]
        hasher = tensor_hasher(fmt)
        if entry.nbytes:
            region = np.ndarray((entry.nbytes,), dtype=np.uint8, buffer=shard_map(path), offset=entry.offset)
            try:
                _hash_in_chunks(hasher, region, chunk)
            finally:
                del region
        actual = hasher.hexdigest()
        return None if actual == digests[name] else (name, digests[name], actual)

    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="weightsync-seed-check") as pool:
            return [r for r in pool.map(mismatch, sorted(table, key=lambda n: -table[n][1].nbytes)) if r is not None]
    finally:
        for mm in maps.values():
            _close_map(mm)


def _execute(
    plan: PullPlan, indexes, local: str, seed_dir: str, origin: Origin, workers: int, chunk: int, *, each_version: bool,
    deferred: bool, progress=None,
) -> tuple[PullResult, _PendingFlush | None]:
    if plan.action == "noop":
        return PullResult(plan.target_version, "noop", plan.reason), None
    # Everything about the artifacts is checked before the first byte changes locally; no
    # shard stays open afterwards (the apply reopens a few payloads at a time).
    loaded = [load_delta(indexes[v]) for v in plan.deltas]
    nbytes_read = sum(d.nbytes for d in loaded)
    source_nbytes = sum(files_nbytes(indexes[v].path, set(indexes[v].weight_map.values())) for v in plan.deltas)
    seed_nbytes, seed_s = 0, 0.0
    if plan.seed is not None:
        t = time.perf_counter()
        seed_nbytes, seed_from_source = _seed(plan, local, seed_dir, origin, workers, chunk)
        source_nbytes += seed_from_source
        seed_s = time.perf_counter() - t
    apply_s, flush_s, pending = 0.0, 0.0, None
    if loaded:
        t = time.perf_counter()
        table = local_table(local)
        check_against_local(loaded, table, seed_dir)
        invalidate_marker(local)
        paths = apply_chain(
            local, loaded, table, workers=workers, chunk_nbytes=chunk, verify_each_version=each_version, flush=False,
            progress=progress,
        )
        apply_s = time.perf_counter() - t
        if deferred:
            pending = _PendingFlush(paths, plan.target_version, origin)
        else:
            t = time.perf_counter()
            fsync_files(paths)
            write_marker(local, plan.target_version, origin)
            flush_s = time.perf_counter() - t
    result = PullResult(
        plan.target_version, plan.action, plan.reason, deltas_applied=len(loaded), nbytes_read=nbytes_read,
        seed_nbytes=seed_nbytes, source_nbytes=source_nbytes, seed_s=seed_s, apply_s=apply_s, flush_s=flush_s,
    )
    return result, pending


def applied_version(local_checkpoint_dir: str) -> int | None:
    """The version the local checkpoint holds (verified), or None when unknown."""
    v, _ = read_applied_version(local_checkpoint_dir)
    return v


__all__ = ["pull", "PullResult", "applied_version", "describe_local_state", "check_source_dir", "wait_until_durable", "verified_by_peer"]
