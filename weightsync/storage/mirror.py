"""The host-local mirror a pull from a bucket reads (``puller.bucket`` drives it): the objects the
plan names are fetched into host-local files, and today's pull (plan, seed, apply, verification)
runs unchanged on them.

The host-local *mirror* (``<local>/.weight_sync/sources/<hash of the URL>/``) has the bucket's
layout: the run file, each committed version's (and anchor's) index and small side files, and
for every shard either its bytes (fetched) or a *placeholder*: a sparse file of the shard's
size that starts with ``PLACEHOLDER_MAGIC``, so the planner prices it exactly as it would the
real file without a byte being fetched. Inside the host lock (the pull's pre-read hook, which
runs only when there is work), the mirror is refreshed from one LIST, the pull is planned on
it, exactly the shards the plan names are fetched (parallel ranged GETs, each checked for its
ETag and length), and the shards of earlier pulls are turned back into placeholders (the
spool: bounded by what one pull reads). The pull then plans again, on the same files and local
state under the same lock, so it reads what was fetched.

A version prefix without an index is mirrored as it is, so the directory pull's own rules judge
it: a lone ``model.safetensors`` (FORMAT.md's index-less full version) is fetched whole and kept
outside the spool (its header decides whether it is complete, at every pull); any other shape
("still publishing") gets placeholders. An index whose listed size is over the index limit is not
downloaded: a placeholder of that size meets the directory pull's own size check.

A placeholder is never taken for data: its first 8 bytes, read as a safetensors header length,
exceed any header limit. Should a pull's own fallbacks (a reseed and replay after a failed
verification, a side anchor that fails its check) reach a placeholder, the pull fails typed;
then every shard up to the target is fetched and the pull runs once more, on a complete mirror:
the slower sound path, whose verdict is today's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Callable

from ..errors import SourceNotReadyError
from ..format.layout import INDEX_NAME, RUN_NAME, SINGLE_FILE_NAME, is_weight_file, sync_dir
from ..fsio import write_bytes
from ..knobs import MAX_INDEX_NBYTES
from .client import OBJECTS_IN_FLIGHT, Deadline
from .source import BucketSource, ObjectInfo
from .url import BucketURL

log = logging.getLogger(__name__)

PLACEHOLDER_MAGIC = b"WSYNC-NOT-FETCHED\n"  # as a little-endian u64 header length: ~7e18, never valid
# Beside the mirror (not in it: the mirror holds only what a source dir holds): key -> ETag of
# the shards whose bytes are in the mirror, and of every file the mirror has.
_FETCHED_NAME = ".fetched.json"
_WHOLE_NAME = ".whole.json"  # key -> ETag of the files _refresh keeps whole (index-less versions)
_DIR_RE = re.compile(r"^(weight_v|anchor_v)(\d{6,})$")


# An optional step before the fetch (the fleet swarm, ``storage.swarm``): ``fn(mirror, objs,
# deadline_left_s)`` puts what it can of ``objs`` into the mirror, each checked against the index's
# file digests, and returns their keys; the rest is fetched from the source as before.
PREFETCH: "ContextVar[Callable | None]" = ContextVar("weightsync_mirror_prefetch", default=None)


def _run_id_of(data: bytes) -> "str | None":
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    run = obj.get("run_id") if isinstance(obj, dict) else None
    return run if isinstance(run, str) else None


def mirror_dir(local_checkpoint_dir: str, url: BucketURL) -> str:
    digest = hashlib.sha256(str(url).encode()).hexdigest()[:16]
    return os.path.join(sync_dir(local_checkpoint_dir), "sources", digest)


def is_placeholder(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(PLACEHOLDER_MAGIC)) == PLACEHOLDER_MAGIC
    except OSError:
        return False


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _write_placeholder(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, PLACEHOLDER_MAGIC[:size])
        os.ftruncate(fd, size)  # sparse: no disk for the rest
    finally:
        os.close(fd)


class Mirror:
    """The host-local mirror of one bucket URL under one local checkpoint dir."""

    def __init__(self, source: BucketSource, root: str, fetch_progress=None):
        self.source = source
        self.root = root
        self.fetch_progress = fetch_progress
        self.materialize_all = False
        self.fetched_nbytes = 0
        self.prefetched_nbytes = 0
        self.fetch_s = 0.0
        self.whole: set[str] = set()  # keys _refresh fetched whole (index-less versions): never spooled

    # --- the run file (outside the lock: one GET, so a changed run is seen before the no-op check)

    def sync_run_file(self) -> None:
        path = os.path.join(self.root, RUN_NAME)
        try:
            data = self.source.read(RUN_NAME)
        except FileNotFoundError:
            data = None
        old = None
        if os.path.exists(path):
            with open(path, "rb") as f:
                old = f.read()
        if data == old:
            return
        if old is not None and (data is None or _run_id_of(data) is None or _run_id_of(data) != _run_id_of(old)):
            # Another run now publishes under this URL: nothing mirrored from the old one counts.
            # (The same run's file changes once, when the publisher adds the seed record at v1.)
            log.info("%s: the run file changed; clearing the mirror %s", self.source.name, self.root)
            self._clear_versions()
        if data is None:
            os.unlink(path)
        else:
            write_bytes(path, data)

    def _clear_versions(self) -> None:
        for name in os.listdir(self.root):
            if _DIR_RE.match(name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self._save_fetched({})

    # --- inside the host lock -------------------------------------------------------------

    def prepare(self, target: int, plan_keys: "Callable[[], tuple[set[str], str]]") -> None:
        """Refresh the mirror from one LIST, plan (``plan_keys``: the keys the pull will read, and
        why, planned on the refreshed mirror), fetch those, evict the rest."""
        listing = self.source.list()
        committed = self._refresh(listing, target)
        fetched = self._load_fetched()
        # A key whose file is a placeholder again (its dir was dropped and rebuilt by _refresh:
        # an HTTP source's walk lists only the versions above the local one) is not fetched.
        fetched = {k: t for k, t in fetched.items() if k in listing and listing[k].tag == t and os.path.exists(self._path(k))
                   and not is_placeholder(self._path(k)) and k not in self.whole}
        if self.materialize_all:
            needed = {k for k, o in listing.items() if self._is_shard_of(k, committed)}
            why = f"every shard up to v{target} (the fallback after a pull reached an unfetched one)"
        else:
            needed, why = plan_keys()
        missing = [listing[k] for k in sorted(needed) if k in listing and k not in fetched and k not in self.whole]
        gone = sorted(k for k in needed if k not in listing)
        for k in gone:
            # The plan was made on this LIST's mirror, which holds only listed files (and
            # ``plan_keys`` says in the directory's words when a plan names one it lacks): a key
            # gets here only through a changed plan. Said as the directory says it while the index
            # is there; "pruned meanwhile" when the index is gone too.
            d, _, name = k.partition("/")
            m = _DIR_RE.match(d)
            if f"{d}/{INDEX_NAME}" in listing:
                raise SourceNotReadyError(
                    f"{f'v{int(m.group(2))}' if m else d}: the index names shard {name}, "
                    f"which is not in {self.source.name}/{d}. The source may not show it yet (a publish in flight, "
                    "or a pruner); retry later."
                )
        if gone:
            raise SourceNotReadyError(
                f"{self.source.name}: {gone[:3]} named by the plan are not in the bucket, nor is their version's "
                "index (pruned meanwhile?); nothing local changed. Retry the pull."
            )
        # Evict first: the disk holds at most what this pull reads.
        for k in sorted(set(fetched) - needed):
            _write_placeholder(self._path(k), listing[k].size)
            del fetched[k]
        self._save_fetched(fetched)
        prefetch = PREFETCH.get()
        if prefetch is not None and missing:
            got = prefetch(self, missing, Deadline.from_knob().left())
            for o in missing:
                if o.key in got:
                    fetched[o.key] = o.tag
            self._save_fetched(fetched)
            self.prefetched_nbytes += sum(o.size for o in missing if o.key in got)
            missing = [o for o in missing if o.key not in got]
        total = sum(o.size for o in missing)
        log.info("%s: fetching %d object(s), %d bytes, for: %s", self.source.name, len(missing), total, why)
        t = time.perf_counter()
        self._fetch(missing, fetched, total)
        self.fetch_s += time.perf_counter() - t
        self.fetched_nbytes += total

    def evict_fetched(self) -> int:
        """Every fetched shard back to a placeholder (the spool emptied); bytes freed. Call with
        the host lock held: a pull in progress reads these files."""
        fetched = self._load_fetched()
        freed = 0
        for k in sorted(fetched):
            path = self._path(k)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                continue
            if not is_placeholder(path):
                _write_placeholder(path, size)
                freed += size
        self._save_fetched({})
        return freed

    def hand_over(self, src: str, dst: str) -> "int | None":
        """A fetched shard moved to ``dst`` (a seed's final file in the local checkpoint: its bytes
        are written once, by the fetch, not fetched and then copied), fsynced; its entry here is a
        placeholder again. None when ``src`` is not a fetched shard of this mirror, or cannot be
        moved there (another filesystem): the seed then copies it. Call with the host lock held."""
        root = os.path.realpath(self.root)
        real = os.path.realpath(src)
        if not real.startswith(root + os.sep):
            return None
        key = os.path.relpath(real, root).replace(os.sep, "/")
        fetched = self._load_fetched()
        if key not in fetched or is_placeholder(real):
            return None
        size = os.path.getsize(real)
        with open(real, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.replace(real, dst)  # a new inode at dst, as the seed's copy gives
        except OSError:
            return None
        del fetched[key]
        self._save_fetched(fetched)
        _write_placeholder(real, size)
        return size

    def has_placeholders(self) -> bool:
        for name in os.listdir(self.root):
            d = os.path.join(self.root, name)
            if _DIR_RE.match(name) and os.path.isdir(d):
                if any(is_placeholder(os.path.join(d, f)) for f in os.listdir(d)):
                    return True
        return False

    def _refresh(self, listing: dict[str, ObjectInfo], target: int) -> set[str]:
        """Indexes, side files and placeholders of every committed version and anchor up to the
        target; dirs of versions no longer committed are removed, and so are files the LIST no
        longer shows (the mirror holds what the source holds: a shard an index names but the
        bucket lacks is then missing here too, and the pull says so in the directory's words).
        Returns the mirrored dirs.

        A version prefix without an index (FORMAT.md allows an index-less full version: one
        complete ``model.safetensors``) is mirrored too, so the directory pull's own rules judge
        it (a full version, or "still publishing" naming what it found): a lone
        ``model.safetensors`` is fetched whole, as those rules read its header and a seed reads
        its bytes (a placeholder's header would read "not complete"); any other shape is judged
        by its names alone, so placeholders do."""
        committed = {k.split("/")[0] for k in listing if k.count("/") == 1 and k.endswith("/" + INDEX_NAME) and _DIR_RE.match(k.split("/")[0])}
        indexless = {k.split("/")[0] for k in listing if k.count("/") == 1 and k.startswith("weight_v")
                     and _DIR_RE.match(k.split("/")[0])} - committed
        present = committed | indexless
        for name in os.listdir(self.root):
            if _DIR_RE.match(name) and name not in present:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        wanted = {d for d in present if int(_DIR_RE.match(d).group(2)) <= target}  # type: ignore[union-attr]
        whole: set[str] = set()
        for d in wanted & indexless:
            weights = sorted(k for k in listing if k.startswith(d + "/") and k.count("/") == 1 and k.endswith(".safetensors"))
            if weights == [f"{d}/{SINGLE_FILE_NAME}"]:
                whole.add(weights[0])
        self.whole = whole
        tags = self._load_tags()
        # A version that was index-less and is committed now (or a lone file joined by another):
        # its file kept whole goes back to a placeholder, so the spool bounds it from now on.
        for k in sorted(set(self._load_json(_WHOLE_NAME)) - whole):
            if k in listing and listing[k].tag == tags.get(k) and os.path.exists(self._path(k)) and k.partition("/")[0] in wanted:
                _write_placeholder(self._path(k), listing[k].size)
        write_bytes(self.root + _WHOLE_NAME, json.dumps({k: listing[k].tag for k in sorted(whole)}).encode())
        limit = int(MAX_INDEX_NBYTES.get())
        for d in wanted:
            dpath = os.path.join(self.root, d)
            if os.path.isdir(dpath):
                for name in os.listdir(dpath):
                    if f"{d}/{name}" not in listing:
                        _remove(os.path.join(dpath, name))
        for k, o in sorted(listing.items()):
            d, _, name = k.partition("/")
            if d not in wanted or "/" in name or not name or name.startswith("."):
                continue
            path = self._path(k)
            if os.path.exists(path) and tags.get(k) == o.tag and not (k in whole and is_placeholder(path)):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if name == INDEX_NAME and o.size > limit:
                # Not downloaded: a placeholder of its listed size, which the directory pull's
                # own size check refuses (MalformedHeaderError, "over the ...-byte limit") when
                # the plan reads it. No tag kept: a raised limit lets the next pull fetch it.
                _write_placeholder(path, o.size)
                tags.pop(k, None)
                continue
            if k in whole:
                self._fetch_whole(o)
            elif name == INDEX_NAME or not is_weight_file(name):
                try:
                    write_bytes(path, self.source.read(k))  # small: an index, a config, a tokenizer
                except FileNotFoundError:
                    continue  # pruned since the LIST: the planner then finds the version missing
            else:
                _write_placeholder(path, o.size)
            tags[k] = o.tag
        self._save_tags({k: t for k, t in tags.items() if k in listing})
        return wanted

    def _fetch_whole(self, o: ObjectInfo) -> None:
        """An index-less version's ``model.safetensors`` in full (checked for its ETag and
        length), kept outside the spool: the next pull's planner reads its header again."""
        path = self._path(o.key)
        tmp = path + ".fetching"
        log.info("%s: fetching %s whole (%d bytes): an index-less version", self.source.name, o.key, o.size)
        t = time.perf_counter()
        try:
            self.source.fetch(o, tmp, None, Deadline.from_knob())
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        self.fetch_s += time.perf_counter() - t
        self.fetched_nbytes += o.size

    @staticmethod
    def _is_shard_of(key: str, dirs: set[str]) -> bool:
        d, _, name = key.partition("/")
        return d in dirs and "/" not in name and name != INDEX_NAME and name.endswith(".safetensors")

    def _fetch(self, objs: list[ObjectInfo], fetched: dict[str, str], total: int) -> None:
        deadline = Deadline.from_knob()
        lock = threading.Lock()
        done = [0, time.monotonic()]

        def one(o: ObjectInfo) -> None:
            path = self._path(o.key)
            tmp = path + ".fetching"
            last = [0]

            def progress(n: int, _size: int) -> None:
                with lock:
                    done[0] += n - last[0]
                    last[0] = n
                    if self.fetch_progress is not None:
                        self.fetch_progress(done[0], total)
                    if time.monotonic() - done[1] > 5:
                        done[1] = time.monotonic()
                        log.info("%s: fetched %d of %d bytes", self.source.name, done[0], total)

            try:
                self.source.fetch(o, tmp, progress, deadline)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            with lock:
                fetched[o.key] = o.tag
                self._save_fetched(fetched)

        workers = max(1, min(int(OBJECTS_IN_FLIGHT.get()), len(objs)))
        if workers <= 1:
            for o in objs:
                one(o)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-fetch-obj") as pool:
            futures = [pool.submit(one, o) for o in objs]
            errors = []
            for f in futures:
                try:
                    f.result()
                except BaseException as e:  # wait for all, then raise the first
                    errors.append(e)
            if errors:
                raise errors[0]

    # --- bookkeeping ----------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _load_json(self, name: str) -> dict[str, str]:
        try:
            with open(self.root + name, "rb") as f:
                obj = json.loads(f.read())
            return {str(k): str(v) for k, v in obj.items()} if isinstance(obj, dict) else {}
        except (OSError, ValueError):
            return {}

    def _load_fetched(self) -> dict[str, str]:
        return self._load_json(_FETCHED_NAME)

    def _save_fetched(self, fetched: dict[str, str]) -> None:
        write_bytes(self.root + _FETCHED_NAME, json.dumps(fetched, sort_keys=True).encode())

    def _load_tags(self) -> dict[str, str]:
        return self._load_json(".tags.json")

    def _save_tags(self, tags: dict[str, str]) -> None:
        write_bytes(self.root + ".tags.json", json.dumps(tags, sort_keys=True).encode())


__all__ = ["Mirror", "mirror_dir", "is_placeholder", "PLACEHOLDER_MAGIC"]
