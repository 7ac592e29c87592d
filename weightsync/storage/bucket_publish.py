"""Publish to a bucket: a ``Publisher`` writes into a host-local staging copy of the run, and
each version it commits there is uploaded, shards first, then its index created only if absent.

Why a staging copy (docs/BUCKETS.md): the publisher's whole protocol (encode, retry with the
same bytes, pending versions, side anchors, retention) keeps running unchanged on local files,
and the bucket gets only committed versions, in order; the upload is a separate, idempotent
step that a retry repeats. The cost is one local copy of the retained versions on the trainer.

Per version (anchor first when there is one, as on disk):

1. each shard is uploaded under its name plus 16 hex digits of the xxh3 of its bytes
   (multipart above the part size), unless a key of that name and size is there already: the
   same bytes give the same key, so a retry rewrites nothing, and a second writer's other
   bytes get other keys: nobody can replace the shards of a committed version;
2. the index, its ``weight_map`` naming those keys, is created with ``If-None-Match: *`` (the
   commit point). Refused: the index there is read back; byte-equal to ours means our earlier
   attempt landed and its reply was lost (committed); anything else is another writer's
   version: ``BucketConflictError``, loud, and nothing of theirs is touched.
3. keys under the version the index does not name (an earlier failed attempt's) are deleted.

The run identity is created the same way; a second publisher of the run keeps the first's id.
A store that accepts a second create-only PUT of one key is refused at start. Pruning mirrors
the staging copy's: a version pruned there loses its index in the bucket first (it stops being
published), then its other keys in bulk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import BucketConflictError, ConditionalWritesUnsupportedError, PublishError, SupersededPublisherError
from ..format.layout import INDEX_NAME, RUN_NAME, is_weight_file
from ..format.manifest import is_committed, read_run_id
from ..fsio import write_bytes
from .client import OBJECTS_IN_FLIGHT
from .source import BucketSource
from .url import BucketURL, parse_bucket_url

log = logging.getLogger(__name__)

STAGING_ENV = "WEIGHTSYNC_BUCKET_STAGING_DIR"
_DIR_RE = re.compile(r"^(weight_v|anchor_v)(\d{6,})$")


def default_staging_dir(url: BucketURL) -> str:
    """``$WEIGHTSYNC_BUCKET_STAGING_DIR/<hash of the URL>``, else under ``~/.cache/weightsync``."""
    base = os.environ.get(STAGING_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "weightsync", "staging")
    return os.path.join(base, hashlib.sha256(str(url).encode()).hexdigest()[:16])


_CONTENT_NAMED = re.compile(r"-[0-9a-f]{16}\.safetensors$")


def content_key(name: str, path: str) -> str:
    """The bucket key of a shard: its name when the publisher already named it by its content
    (``format.layout``'s shard names end in a hash of what the shard holds), else ``name`` with
    16 hex digits of the xxh3-128 of the file's bytes before its extension."""
    if _CONTENT_NAMED.search(name):
        return name
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                break
            h.update(chunk)
    stem, dot, ext = name.rpartition(".")
    return f"{stem}-{h.hexdigest()[:16]}{dot}{ext}" if dot else f"{name}-{h.hexdigest()[:16]}"


class BucketTarget:
    """Uploads the committed versions of a staging dir into a bucket prefix."""

    def __init__(self, url: "str | BucketURL", staging_dir: str | None = None):
        self.url = url if isinstance(url, BucketURL) else parse_bucket_url(url)
        self.source = BucketSource(self.url)
        self.staging_dir = staging_dir or default_staging_dir(self.url)
        self.uploaded: set[str] = set()  # dir names this process saw committed in the bucket
        self.lease_token: str | None = None  # the writer lease this publisher put in the bucket
        self.lease_epoch = 0

    # --- at start -----------------------------------------------------------------------

    def check_conditional_create(self) -> None:
        """Create one probe key twice, create-only: the second must be refused, else the store
        does not honour ``If-None-Match: *`` and cannot carry the commit protocol."""
        key = f".weightsync-probe/{uuid.uuid4().hex}"
        first = self.source.create(key, b"1")  # refused (credentials, a store that refuses): that error, as it is
        try:
            second = self.source.create(key, b"2")
        finally:
            if first:
                self.source.delete([key])
        if not first or second:
            raise ConditionalWritesUnsupportedError(str(self.url))

    def sync_run_identity(self) -> None:
        """The bucket's run file, created if absent (conditionally); the staging copy keeps
        the same id. A staging copy of another run (its own run file, other versions) is refused."""
        local = os.path.join(self.staging_dir, RUN_NAME)
        os.makedirs(self.staging_dir, exist_ok=True)
        try:
            theirs: bytes | None = self.source.read(RUN_NAME)
        except FileNotFoundError:
            theirs = None
        if theirs is None:
            if not os.path.exists(local):
                from ..format.manifest import encode_run_identity
                import time

                write_bytes(local, encode_run_identity(uuid.uuid4().hex, time.time()))
            with open(local, "rb") as f:
                ours = f.read()
            if self.source.create(RUN_NAME, ours):
                return
            theirs = self.source.read(RUN_NAME)  # another publisher created it first: keep theirs
        if os.path.exists(local) and read_run_id(local) != _run_id_of(theirs):
            staged = [n for n in os.listdir(self.staging_dir) if _DIR_RE.match(n)]
            if staged:
                raise PublishError(
                    f"the staging dir {self.staging_dir} holds versions {sorted(staged)[:3]} of run {read_run_id(local)}, "
                    f"but {self.url} belongs to run {_run_id_of(theirs)}; use another staging dir "
                    f"({STAGING_ENV}) or another prefix"
                )
        write_bytes(local, theirs)

    def fill_a_new_staging_copy(self, only_rank: int | None = None) -> None:
        """A staging copy with no version of its own (a trainer started on another host, or with
        a fresh staging dir) gets the bucket's committed versions and anchors first, byte for
        byte (the bucket's index names its content keys, which are valid shard names), so the
        publisher continues the run: its version numbers, base checks and retention read the
        staging copy. A staging copy that holds versions is left as it is.

        ``only_rank`` (rank reports: a rank with a staging copy of its own): of the shards, only
        that rank's (their names carry the rank); the indexes all. A rank's checks read only
        its own tensors' records, so the other ranks' bytes are not fetched."""
        os.makedirs(self.staging_dir, exist_ok=True)
        if any(_DIR_RE.match(n) for n in os.listdir(self.staging_dir)):
            return
        listing = self.source.list()
        committed = sorted({k.split("/")[0] for k in listing if k.count("/") == 1 and k.endswith("/" + INDEX_NAME)
                            and _DIR_RE.match(k.split("/")[0])})  # fmt: skip
        for name in committed:
            part = os.path.join(self.staging_dir, f".{name}.filling")
            os.makedirs(part, exist_ok=True)
            for k, o in sorted(listing.items()):
                d, _, fname = k.partition("/")
                if d != name or "/" in fname or fname == INDEX_NAME or fname.startswith("."):
                    continue
                if only_rank is not None and is_weight_file(fname) and f"-r{only_rank:05d}-" not in fname:
                    continue
                self.source.fetch(o, os.path.join(part, fname))
            # The index last, read after its files: a version pruned meanwhile is not taken.
            try:
                write_bytes(os.path.join(part, INDEX_NAME), self.source.read(f"{name}/{INDEX_NAME}"))
            except FileNotFoundError:
                shutil.rmtree(part, ignore_errors=True)
                continue
            os.replace(part, os.path.join(self.staging_dir, name))
            self.uploaded.add(name)
        if committed:
            log.info("%s: a new staging copy %s filled with %d committed dir(s) from the bucket", self.url,
                     self.staging_dir, len(committed))

    def adopt_run_identity(self, world_size: int, timeout_s: float = 120.0) -> None:
        """Another rank than 0: take the run file rank 0 creates (waiting for it a while)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                theirs = self.source.read(RUN_NAME)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise PublishError(f"{self.url}: rank 0 of {world_size} has not created the run file within {timeout_s:.0f}s") from None
                time.sleep(0.2)
        os.makedirs(self.staging_dir, exist_ok=True)
        write_bytes(os.path.join(self.staging_dir, RUN_NAME), theirs)

    # --- as a destination (``storage.destination``) ------------------------------------------

    @property
    def dir(self) -> str:
        """What the publisher writes and commits in: the host-local staging copy."""
        return self.staging_dir

    @property
    def name(self) -> str:
        """What readers call it, and errors name: the bucket URL."""
        return str(self.url)

    def write_run_identity(self, atomic: bool) -> None:
        # Settled when the target was opened (the bucket's, created only if absent); a staging
        # copy that lost its run file meanwhile gets the bucket's again, never a new id.
        if not os.path.exists(os.path.join(self.staging_dir, RUN_NAME)):
            self.sync_run_identity()

    def publish_committed(self) -> None:
        self.upload_committed()

    # --- the writer lease, where every host sees it ----------------------------------------

    def hold_lease(self, record: bytes, what: str) -> None:
        """The publisher's writer lease (``publisher.lease``: a JSON record with an epoch and a
        token) in the bucket too, beside the run file, so a publisher on another host (its own
        staging copy) fences this one: put on first use (created if absent, else replaced only
        if unchanged since read: ``If-Match``), then checked to be still this one's. Checked
        again before every index this target creates."""
        mine = json.loads(record)
        if self.lease_token != mine["token"]:
            try:
                data, tag = self.source.read_tagged(WRITER_NAME)
                current = _lease_of(data)
            except FileNotFoundError:
                tag, current = "", None
            epoch = max(int(mine["epoch"]), int(current["epoch"]) + 1 if current else 0)
            ours = json.dumps({**mine, "epoch": epoch}).encode()
            # A lost race (another publisher put its lease between the read and this write) is
            # caught by the check below: the loser is the one fenced.
            if tag:
                self.source.replace(WRITER_NAME, ours, tag)
            else:
                self.source.create(WRITER_NAME, ours)
            self.lease_token, self.lease_epoch = str(mine["token"]), epoch
        self.check_lease(what)

    def current_lease_token(self) -> str | None:
        """The token of the writer lease in the bucket now (None: none yet): the scope under
        which a rank other than 0 reports its shards (``storage.rank_reports``)."""
        try:
            lease = _lease_of(self.source.read(WRITER_NAME))
        except FileNotFoundError:
            return None
        return str(lease["token"]) if lease else None

    def check_lease(self, what: str) -> None:
        """SupersededPublisherError unless the bucket's lease is still this publisher's (a
        target that never took one, a publisher that writes nothing, is not checked)."""
        if self.lease_token is None:
            return
        try:
            current = _lease_of(self.source.read(WRITER_NAME))
        except FileNotFoundError:
            current = None
        if current is not None and current.get("token") == self.lease_token:
            return
        holder = f"pid {current.get('pid')} on {current.get('host') or '?'}" if current else "the lease object is gone or unreadable"
        raise SupersededPublisherError(str(self.url), self.lease_epoch, int(current["epoch"]) if current else None, holder, what)

    # --- the run file's seed record ---------------------------------------------------------

    def sync_seed_record(self) -> None:
        """The staging copy's run file gained the seed record (written at v1, before v1's
        index): the bucket's run file gets it too, before v1's index is created there, replaced
        only if unchanged since read. Another run's file, or another seed record, is a conflict."""
        local = os.path.join(self.staging_dir, RUN_NAME)
        try:
            with open(local, "rb") as f:
                ours = f.read()
        except FileNotFoundError:
            return
        for _ in range(3):
            theirs, tag = self.source.read_tagged(RUN_NAME)
            if theirs == ours:
                return
            a, b = _json_of(ours), _json_of(theirs)
            if a.get("run_id") != b.get("run_id") or "seed" in a and "seed" in b and a["seed"] != b["seed"]:
                raise PublishError(
                    f"{self.url}/{RUN_NAME} is not this staging copy's run file (run {b.get('run_id')} in the bucket, "
                    f"{a.get('run_id')} here, or another seed record): another publisher of this prefix? Use another "
                    f"prefix, or another staging dir ({STAGING_ENV})"
                )
            if "seed" not in a or "seed" in b:
                return  # nothing to add (the bucket's records it already, or there is none yet)
            if self.source.replace(RUN_NAME, ours, tag):
                log.info("%s/%s: the seed record uploaded", self.url, RUN_NAME)
                return
        raise PublishError(f"{self.url}/{RUN_NAME} kept changing while its seed record was uploaded; retry the publish")

    # --- after each commit ----------------------------------------------------------------

    def upload_committed(self) -> None:
        """Every version (and anchor) committed in the staging dir and not yet in the bucket,
        oldest first, each anchor before its version."""
        names = [n for n in os.listdir(self.staging_dir) if _DIR_RE.match(n) and n not in self.uploaded]
        if names:
            self.sync_seed_record()

        def order(n: str) -> tuple[int, int]:
            m = _DIR_RE.match(n)
            assert m is not None
            return int(m.group(2)), 0 if m.group(1) == "anchor_v" else 1

        for name in sorted(names, key=order):
            if is_committed(os.path.join(self.staging_dir, name)):
                self.upload_dir(name)

    def upload_dir(self, name: str) -> None:
        local = os.path.join(self.staging_dir, name)
        with open(os.path.join(local, INDEX_NAME), "rb") as f:
            index_bytes = f.read()
        index = json.loads(index_bytes)
        there = self.source.list(prefix=f"{name}/")
        index_key = f"{name}/{INDEX_NAME}"
        if index_key in there:
            # Committed already: ours (nothing to upload), or another writer's (a conflict).
            self._check_ours(name, index_key, None)
            self.uploaded.add(name)
            return
        keys: dict[str, str] = {}
        uploads: list[tuple[str, str]] = []
        for fname in sorted(set(index.get("weight_map", {}).values())):
            path = os.path.join(local, fname)
            if not os.path.exists(path) and _CONTENT_NAMED.search(fname):
                # Another rank's shard (rank reports: each rank uploads its own, and rank 0's
                # commit checked its key and size in the bucket); never in this staging copy.
                if f"{name}/{fname}" not in there:
                    raise PublishError(
                        f"{self.url}/{name}: {fname} is neither in the staging copy {local} nor in the bucket; "
                        "the rank that wrote it must upload it (retry the version on every rank)")
                keys[fname] = fname
                continue
            key = f"{name}/{content_key(fname, path)}"
            keys[fname] = key.split("/", 1)[1]
            if key in there and there[key].size == os.path.getsize(path):
                continue  # the same bytes, uploaded by an earlier attempt
            uploads.append((key, path))
        self.put_all(uploads)
        for entry in sorted(os.listdir(local)):
            path = os.path.join(local, entry)
            if entry == INDEX_NAME or is_weight_file(entry) or entry.startswith(".") or not os.path.isfile(path):
                continue
            key = f"{name}/{entry}"
            if key not in there or there[key].size != os.path.getsize(path):
                self.source.put_file(key, path)  # config, tokenizer: small, the same in every version
        index["weight_map"] = {t: keys[f] for t, f in index["weight_map"].items()}
        _rename_file_digests(index, keys)
        ours = json.dumps(index, indent=1).encode()
        self.check_lease(f"creating {index_key}")  # a publisher superseded on another host stops here
        if not self.source.create(index_key, ours):
            self._check_ours(name, index_key, ours)
        named = {f"{name}/{k}" for k in keys.values()} | {index_key}
        named |= {f"{name}/{e}" for e in os.listdir(local) if not is_weight_file(e)}
        leftovers = sorted(k for k in there if k not in named)
        if leftovers:
            log.info("%s/%s: removing %d key(s) an earlier attempt left", self.url, name, len(leftovers))
            self.source.delete(leftovers)
        self.uploaded.add(name)
        log.info("%s/%s committed (%d shard(s))", self.url, name, len(keys))

    def put_all(self, uploads: list[tuple[str, str]]) -> None:
        """Upload (key, path) pairs, WEIGHTSYNC_BUCKET_OBJECTS_IN_FLIGHT at once (each itself a
        multipart upload of a few parts in flight); all finish before the first error is raised."""
        workers = max(1, min(int(OBJECTS_IN_FLIGHT.get()), len(uploads)))
        if workers <= 1:
            for key, path in uploads:
                self.source.put_file(key, path)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-upload") as pool:
            futures = [pool.submit(self.source.put_file, key, path) for key, path in uploads]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _check_ours(self, name: str, index_key: str, ours: bytes | None) -> None:
        """The bucket's index of ``name`` is ours (byte-equal to what we would write), else a conflict."""
        theirs = self.source.read(index_key)
        if ours is None:
            ours = self._bucket_index_of(name)
        if theirs == ours:
            log.info("%s/%s: the index there is ours (an earlier reply was lost)", self.url, name)
            return
        m = _DIR_RE.match(name)
        assert m is not None
        if m.group(1) == "anchor_v":
            # An earlier attempt's anchor: FORMAT.md removes an unbound anchor, index first.
            vkey = f"weight_v{m.group(2)}/{INDEX_NAME}"
            try:
                self.source.read(vkey)
            except FileNotFoundError:
                log.warning("%s/%s: an earlier attempt's anchor is there; replacing it", self.url, name)
                self.source.delete([index_key])
                self.upload_dir(name)
                return
        raise BucketConflictError(int(m.group(2)), str(self.url))

    def _bucket_index_of(self, name: str) -> bytes:
        local = os.path.join(self.staging_dir, name)
        with open(os.path.join(local, INDEX_NAME), "rb") as f:
            index = json.loads(f.read())
        # One key per file (a file not named by its content is hashed to name it: once, not per tensor).
        files = set(index.get("weight_map", {}).values()) | set(index.get("file_digests", {}))
        keys = {f: content_key(f, os.path.join(local, f)) for f in files}
        index["weight_map"] = {t: keys[f] for t, f in index.get("weight_map", {}).items()}
        _rename_file_digests(index, keys)
        return json.dumps(index, indent=1).encode()

    # --- after pruning --------------------------------------------------------------------

    def mirror_pruned(self) -> None:
        """Versions pruned from the staging dir go from the bucket: index first, then the rest."""
        for name in sorted(self.uploaded):
            if os.path.isdir(os.path.join(self.staging_dir, name)):
                continue
            index_key = f"{name}/{INDEX_NAME}"
            self.source.delete([index_key])
            rest = sorted(k for k in self.source.list(prefix=f"{name}/") if k != index_key)
            self.source.delete(rest)
            self.uploaded.discard(name)
            log.info("%s/%s pruned (%d key(s))", self.url, name, len(rest) + 1)


def _rename_file_digests(index: dict, keys: dict[str, str]) -> None:
    """The index's ``file_digests`` (FORMAT.md) under the bucket's names of the files, as its
    ``weight_map`` names them: what a reader behind a cache checks each file against."""
    files = index.get("file_digests")
    if isinstance(files, dict):
        index["file_digests"] = {keys.get(f, f): d for f, d in files.items()}


WRITER_NAME = "weightsync-writer.json"  # the writer lease's name (publisher.lease), beside the run file


def _json_of(data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _lease_of(data: bytes) -> "dict | None":
    obj = _json_of(data)
    return obj if "token" in obj and isinstance(obj.get("epoch"), int) else None


def _run_id_of(data: bytes) -> str | None:
    try:
        obj = json.loads(data)
        return str(obj["run_id"]) if isinstance(obj, dict) and "run_id" in obj else None
    except ValueError:
        return None


def open_bucket_target(url: str, rank: int, world_size: int) -> BucketTarget:
    """What ``Publisher(url)`` does first for a bucket URL: refuse a store without conditional
    create, then settle the run identity (rank 0; the other ranks wait until it is there).
    Several ranks share one staging dir (give each the same ``WEIGHTSYNC_BUCKET_STAGING_DIR``: a
    node-local dir when they share a node, else a shared one): rank 0 commits and uploads from it.
    Ranks on several nodes without a shared dir: ``WEIGHTSYNC_BUCKET_RANK_REPORTS=1`` on every
    rank (``storage.rank_reports``); each other rank's staging copy then holds its own shards."""
    target = BucketTarget(url)
    target.check_conditional_create()
    if rank == 0:
        target.sync_run_identity()
        target.fill_a_new_staging_copy()
    else:
        target.adopt_run_identity(world_size)
        from .rank_reports import rank_reports_wanted

        if world_size > 1 and rank_reports_wanted():
            target.fill_a_new_staging_copy(only_rank=rank)  # its own staging copy (storage.rank_reports)
    return target
