"""Publish: write one version from named tensors (raw bytes in, files out).

A delta version diffs each tensor against the previous version's bytes (the snapshot),
encodes, compresses and checksums it, and writes shards; the index goes last and is the commit
point. Several ranks may each write the shards of the tensors they own (shard names carry the
rank, so numbering never depends on a directory listing); the caller coordinates them and one
rank commits. Single-process callers use ``Publisher.publish``.

The ``Publisher`` is a facade over one unit per responsibility: ``Snapshot`` (the bytes the
next delta diffs against), ``Encoder`` (encode scheduling), ``ShardWriter`` (this rank's files),
``Committer`` (the indexes, the commit point), ``AnchorBudget`` (when a side anchor is due) and
``Retention`` (what to prune). The multi-rank protocol, and what to call after a failure, is in
the ``Publisher`` docstring and docs/FORMAT.md "Publishing".

Invariants: the snapshot takes a version's bytes only after this rank's shards are durable, and
the publisher counts a version as committed only once its index landed (rank 0) or the caller
confirmed it (the other ranks). Until then the version can be retried, on every rank, with the
same version number, giving the same bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import msgspec
import numpy as np

from .. import knobs, progress
from ..codecs import get_codec
from ..errors import (
    HostResourceError,
    PendingVersionError,
    PublishError,
    RankReportMismatchError,
    UnsupportedFormatError,
    VersionAlreadyPublishedError,
    VersionConflictError,
    WeightSyncError,
    host_resource_error,
    name_the_source,
)
from ..format.checksum import DEFAULT_CHECKSUM, new_hasher, supported_checksums
from ..format.file_digests import FILE_DIGEST_ALGORITHM, FILE_DIGESTS_KEY, digest_file, read_file_digests, with_file_digests
from ..storage.rank_reports import RankReports, rank_reports_wanted
from ..storage.swarm import check_publish_torrent, torrent_wanted, write_version_torrent
from ..format.layout import (
    INDEX_NAME,
    anchor_dir,
    anchor_dir_name,
    delta_shard_name,
    full_shard_name,
    is_model_side_file,
    run_path,
    version_dir,
    version_dir_name,
)
from ..format.manifest import (
    ANCHOR_COMMIT_KEY,
    build_anchor_index,
    build_delta_index,
    build_full_index,
    is_committed,
    layout_of_shards,
    anchor_commit_of,
    read_run_id,
)
from ..format.safetensors_io import iter_file_chunks
from ..fsio import fsync_dir, write_bytes, write_file
from ..hooks import load_callable
from ..storage.destination import open_destination
from ..storage.url import is_bucket_url
from .encode import PreparedTensor, PreparedVersion, Encoder
from .encoding_choice import AUTO, Cost, EncodingChoice, EncodingChooser, EncodingSample, check_candidates, merge_samples
from .guard import LAYOUT_CHANGE_KEY, PublishGuard
from .kind_rule import Kind, KindRule
from .pending import PendingVersion, Staged, remove_version_files
from .prune import Retention
from .records import SeedRecord, encode_run_file_with_seed
from .snapshot import RawTensor, Snapshot, as_raw, read_checkpoint_tensors

log = logging.getLogger(__name__)

DEFAULT_ENCODING = "sparse-v1"  # ours; "xor" and "overwrite" stay available for upstream readers


def _host_errors_typed(method):
    """Out of disk (ENOSPC, EDQUOT), memory or descriptors while publishing: HostResourceError
    (the README's exit code 7) instead of a bare OSError; the version stays retryable. A typed
    error names the destination readers know (a bucket URL), not its host-local staging copy."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            try:
                return method(self, *args, **kwargs)
            except (OSError, MemoryError) as e:
                typed = host_resource_error(e)
                if typed is None:
                    raise
                raise HostResourceError(typed.resource, typed.errno_name, typed.detail, (
                    f"Free {typed.resource} on the publishing host (the source dir's filesystem for disk), then retry "
                    "the same publish: a version whose index did not land is finished with the same bytes "
                    "(Publisher.finish_pending()), and nothing published was touched.")) from e
        except WeightSyncError as e:
            if self.destination.name != self.destination.dir:
                name_the_source(e, self.destination.dir, self.destination.name)
            raise

    return wrapper


class ShardManifest(msgspec.Struct, frozen=True):
    """What one rank wrote for one version; rank 0 merges these into the index."""

    version: int
    rank: int
    kind: str
    weight_map: dict[str, str]
    nbytes: int
    tensor_nbytes: int = 0  # bytes of the tensors this rank owns (a full index's total_size)
    anchor_weight_map: dict[str, str] | None = None  # this rank's shards of the side anchor, if one is due
    anchor_nbytes: int = 0
    encoding: str = ""  # the delta encoding of this rank's payloads ("" for a full version)
    anchor_digests: dict[str, str] | None = None  # this rank's anchor tensors -> digest (the anchor's binding)
    digests: dict[str, str] | None = None  # a full version: this rank's tensors -> digest (checked by a seed)
    seed_digests: dict[str, str] | None = None  # v1's delta: this rank's seed tensors -> digest (the run records them)
    seed_layout: dict[str, tuple[str, tuple[int, ...]]] | None = None  # v1's delta: their dtype and shape
    # Rank reports (ranks with staging copies of their own, storage.rank_reports): what rank 0's
    # commit would read from this rank's files, which are not in rank 0's staging copy.
    files: dict[str, tuple[int, str]] | None = None  # shard -> (bytes, xxh3-128 of its bytes)
    anchor_files: dict[str, tuple[int, str]] | None = None
    layout: dict[str, tuple[str, tuple[int, ...]]] | None = None  # a full version's tensors: dtype, shape (headers)
    anchor_layout: dict[str, tuple[str, tuple[int, ...]]] | None = None
    report_key: str = ""  # the bucket key of this rank's report of this attempt


class PublishResult(msgspec.Struct):
    version: int
    kind: str
    reason: str
    wire_nbytes: int
    full_nbytes: int
    changed_bytes: int
    changed_elements: int
    total_elements: int
    encode_s: float
    write_s: float
    anchor_nbytes: int = 0  # bytes of the side anchor written beside this version (0: none)
    encoding: str = ""  # the version's delta encoding ("" for a full version)
    encoding_reason: str = ""  # why encoding "auto" chose it ("" when the caller named the encoding)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


class _Decision(msgspec.Struct, frozen=True):
    """choose_kind's answer for one version, from totals over all ranks (so every rank agrees)."""

    kind: str
    anchor: bool
    delta_nbytes: int


class _Foreign(msgspec.Struct, frozen=True):
    """Another rank's shards in one dir, known from its report (not in this staging copy)."""

    files: dict[str, tuple[int, str]]  # shard -> (bytes, xxh3-128 file digest)
    layout: dict[str, tuple[str, tuple[int, ...]]]  # tensor -> (dtype, shape), for full shards


_Staged = Staged  # the pending version's record (publisher.pending)


# --- units ------------------------------------------------------------------------------------


class AnchorBudget:
    """When to write a side anchor: once the delta bytes since the last anchor point (a side
    anchor or a full version) exceed ``fraction`` x the full size, or after ``max_deltas``
    deltas. A host joining then reads one anchor plus a tail of at most about one full size."""

    def __init__(self, fraction: float, max_deltas: int):
        self.fraction = fraction
        self.max_deltas = max_deltas
        self.since_nbytes = 0
        self.since_count = 0

    def wants_anchor(self, delta_nbytes: int, full_nbytes: int) -> str | None:
        if self.fraction <= 0 and self.max_deltas <= 0:
            return None
        if self.fraction > 0 and self.since_nbytes + delta_nbytes > self.fraction * full_nbytes:
            return (
                f"side anchor: deltas since the last anchor reach {(self.since_nbytes + delta_nbytes) / max(full_nbytes, 1):.0%} "
                f"of the full size (budget {self.fraction:.0%})"
            )
        if self.max_deltas > 0 and self.since_count + 1 >= self.max_deltas:
            return f"side anchor: {self.since_count + 1} deltas since the last anchor (at most {self.max_deltas})"
        return None

    def record(self, kind: str, anchor: bool, delta_nbytes: int) -> None:
        if kind == "full" or anchor:
            self.since_nbytes, self.since_count = 0, 0
        else:
            self.since_nbytes += delta_nbytes
            self.since_count += 1


class ShardWriter:
    """Writes this rank's shards: a delta's payloads, or full tensors (a full version or an anchor).

    Every shard's name ends in a hash of what it holds (the version, the rank and part, each
    tensor's name, dtype, shape and digest, and a delta's payload bytes): a writer of other
    bytes cannot produce the name, so a second publisher of the same run never replaces a shard
    of a committed version, and a retry with the same bytes writes the same file."""

    def __init__(self, rank: int, atomic: bool):
        self.rank = rank
        self.atomic = atomic

    def write_delta(self, vdir: str, tensors: list[PreparedTensor], version: int = 0) -> tuple[dict[str, str], int]:
        os.makedirs(vdir, exist_ok=True)
        weight_map: dict[str, str] = {}
        written = 0
        changed = [t for t in tensors if t.payload is not None]
        bar = progress.stage("publish: write", sum(_payload_len(t) for t in changed))
        for part, group in enumerate(_group_by_size(changed, _payload_len, int(knobs.DELTA_SHARD_NBYTES.get())), start=1):
            fname = delta_shard_name(self.rank, part, _content_id("delta", version, self.rank, part, group))
            entries = [(t.name, "U8", (_payload_len(t),), t.payload) for t in group]
            meta = {t.name: t.digest for t in group}
            written += write_file(os.path.join(vdir, fname), progress.counted_tensors(iter_file_chunks(entries, meta), bar),
                                  atomic=self.atomic)
            weight_map.update({t.name: fname for t in group})
        return weight_map, written

    def write_full(self, vdir: str, tensors: list[PreparedTensor], version: int = 0,
                   digests: Mapping[str, str] | None = None) -> tuple[dict[str, str], int]:
        os.makedirs(vdir, exist_ok=True)
        weight_map: dict[str, str] = {}
        written = 0
        bar = progress.stage("publish: write", sum(t.nbytes for t in tensors))
        for part, group in enumerate(_group_by_size(tensors, lambda t: t.nbytes, int(knobs.FULL_SHARD_NBYTES.get())), start=1):
            content = _content_id("full", version, self.rank, part, group, digests) if digests is not None else ""
            fname = full_shard_name(self.rank, part, content)
            entries = [(t.name, t.dtype, t.shape, t.new) for t in group]
            chunks = progress.counted_tensors(iter_file_chunks(entries, {"format": "pt"}), bar)
            written += write_file(os.path.join(vdir, fname), chunks, atomic=self.atomic)
            weight_map.update({t.name: fname for t in group})
        return weight_map, written


def _content_id(kind: str, version: int, rank: int, part: int, group: list[PreparedTensor],
                digests: Mapping[str, str] | None = None) -> str:
    """16 hex digits of the xxh3-128 of what one shard holds (its name's content part)."""
    import xxhash

    h = xxhash.xxh3_128()
    h.update(f"{kind}\0{version}\0{rank}\0{part}".encode())
    for t in group:
        digest = digests[t.name] if digests is not None else t.digest
        h.update(f"\0{t.name}\0{t.dtype}\0{list(t.shape)}\0{digest}\0".encode())
        if kind == "delta" and t.payload is not None:
            h.update(t.payload)  # the payload depends on the base too, not only on the new bytes
    return h.hexdigest()[:16]


class Committer:
    """Writes the indexes (the commit points) from every rank's manifests. One rank."""

    def __init__(self, source_dir: str, encoding: str, checksum: str, template_dir: str | None, atomic: bool):
        self.source_dir = source_dir
        self.encoding = encoding
        self.checksum = checksum
        self.template_dir = template_dir
        self.atomic = atomic
        self._foreign: dict[str, _Foreign] = {}  # the commit in progress: other ranks' shards, from their reports

    def commit(self, version: int, kind: Kind, manifests: list[ShardManifest], *,
               fence: Callable[[str], None] | None = None, layout_change: str | None = None,
               foreign: "dict[str, _Foreign] | None" = None) -> tuple[str, int]:
        """Write the anchor's index (when every rank wrote its part), then the version's. Returns
        (version dir, anchor bytes). The version's index is last: once it exists the version is
        published, and its anchor, if any, is complete and bound to it: both indexes name one
        commit id, derived from the version's digests, so an anchor left by an earlier attempt
        with other bytes never matches. Without an anchor, such a leftover is deleted first.

        ``fence(what)`` runs before every write into the source dir (the writer lease: a
        superseded publisher fails there); a complete index of ``version`` is never written over.
        ``layout_change``: recorded in a full version's metadata (the caller allowed it).
        ``foreign``: dir name -> the other ranks' shards there, known from their reports (their
        sizes, file digests and layouts are taken from there, never read from this dir)."""
        fence = fence or (lambda what: None)
        self._foreign = foreign or {}
        fence(f"committing v{version}")
        vdir = version_dir(self.source_dir, version)
        self._refuse_committed(vdir, version)
        weight_map = _merged(manifests, version, kind, lambda m: m.weight_map)
        if version == 1 and kind == "delta":
            self._record_seed(manifests)
        anchor_nbytes = 0
        adir = anchor_dir(self.source_dir, version)
        commit_id: str | None = None
        anchor_map: dict[str, str] | None = None
        digests: dict[str, str] = {}
        if kind == "delta" and manifests and all(m.anchor_weight_map is not None for m in manifests):
            anchor_map = _merged(manifests, version, kind, lambda m: m.anchor_weight_map or {})
            for m in manifests:
                digests.update(m.anchor_digests or {})
            if set(digests) != set(anchor_map):
                # Manifests from elsewhere than write(): an anchor that cannot be bound is not written.
                log.warning("v%d: no side anchor: the ranks' anchor digests name %d tensors, their shards %d",
                            version, len(digests), len(anchor_map))
                anchor_map = None
        if anchor_map is not None:
            commit_id = anchor_commit_of(version, self.checksum, digests)
            index = build_anchor_index(version, anchor_map, sum(m.tensor_nbytes for m in manifests), commit_id,
                                       self.checksum, digests, self._layout(adir, anchor_map))
            fence(f"writing the side anchor index of v{version}")
            self._write_index(adir, index)
            anchor_nbytes = sum(m.anchor_nbytes for m in manifests)
        elif os.path.lexists(adir):
            _remove_orphan_anchor(adir, version)
        os.makedirs(vdir, exist_ok=True)
        if kind == "full":
            fence(f"copying the template files into v{version}")
            self._refuse_committed(vdir, version)
            self._copy_template_files(vdir)
            full_digests: dict[str, str] = {}
            for m in manifests:
                full_digests.update(m.digests or {})
            complete = set(full_digests) == set(weight_map)  # manifests not from write() may lack them
            index = build_full_index(version, weight_map, sum(m.tensor_nbytes for m in manifests),
                                     self.checksum if complete else None, full_digests if complete else None,
                                     self._layout(vdir, weight_map))  # binds the headers (a digest cannot)
            if layout_change is not None:
                index = _with_metadata(index, {LAYOUT_CHANGE_KEY: layout_change})
        else:
            extra = {ANCHOR_COMMIT_KEY: commit_id} if commit_id is not None else None
            index = build_delta_index(version, self._delta_encoding(version, manifests), self.checksum, weight_map, extra)
        fence(f"writing the index of v{version}")
        self._refuse_committed(vdir, version)
        self._write_index(vdir, index)
        return vdir, anchor_nbytes

    def _refuse_committed(self, vdir: str, version: int) -> None:
        """A complete index is never written over, nor anything in its dir (another writer's)."""
        if is_committed(vdir):
            raise VersionConflictError(version, self.source_dir, (
                " by another writer while this publisher was committing it; this publisher wrote nothing "
                "over it (a second publisher of the same run?)"))

    def _record_seed(self, manifests: list[ShardManifest]) -> None:
        """v1's delta: the run file records the seed's per-tensor digests (and layout) once, before
        v1's index, so a later publish of v1 from another base, or a pull from another seed
        dir, is told so. Only when every rank sent them (manifests from elsewhere may not)."""
        if not manifests or any(m.seed_digests is None for m in manifests):
            return
        digests: dict[str, str] = {}
        layout: dict[str, tuple[str, tuple[int, ...]]] = {}
        for m in manifests:
            digests.update(m.seed_digests or {})
            layout.update(m.seed_layout or {})
        data = encode_run_file_with_seed(self.source_dir, SeedRecord(self.checksum, digests, layout))
        if data is not None:
            write_bytes(run_path(self.source_dir), data, atomic=self.atomic)
            fsync_dir(self.source_dir)

    def _delta_encoding(self, version: int, manifests: list[ShardManifest]) -> str:
        """The one encoding every rank's payloads of a delta use (the index names one)."""
        named = {m.encoding for m in manifests if m.encoding}
        if len(named) > 1:
            raise PublishError(
                f"the ranks encoded v{version} with different encodings {sorted(named)}; a version has one "
                "delta_encoding: choose it once from the summed samples (choose_encoding) and prepare every rank with it"
            )
        if named:
            return named.pop()
        return "sparse-v1" if self.encoding == AUTO else self.encoding

    def _layout(self, directory: str, weight_map: dict[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """tensor -> (dtype, shape) of the shards ``weight_map`` names: from the headers of this
        dir's files, and from the reports for the other ranks' (``foreign``)."""
        known = self._foreign.get(os.path.basename(directory))
        if known is None:
            return layout_of_shards(directory, weight_map)
        local = {t: f for t, f in weight_map.items() if f not in known.files}
        out = dict(layout_of_shards(directory, local)) if local else {}
        out.update({t: known.layout[t] for t, f in weight_map.items() if f in known.files and t in known.layout})
        return out

    def _write_index(self, directory: str, index: bytes) -> None:
        # The digest of each payload file (FORMAT.md "file_digests"): what a cache or a peer that
        # serves the files is checked against before a puller uses their bytes.
        known = self._foreign.get(os.path.basename(directory))
        index = with_file_digests(directory, index) if known is None else _with_reported_file_digests(directory, index, known)
        # Opt-in (WEIGHTSYNC_PUBLISH_TORRENT=1): a BitTorrent v2 torrent of the payload files for
        # the fleet's swarm (storage.swarm), written before the index commits the version.
        write_version_torrent(directory, sorted(read_file_digests(json.loads(index))))
        fsync_dir(directory)
        write_bytes(os.path.join(directory, INDEX_NAME), index, atomic=self.atomic)
        fsync_dir(directory)

    def _copy_template_files(self, vdir: str) -> None:
        if not self.template_dir:
            return
        for entry in os.scandir(self.template_dir):
            if entry.is_file() and is_model_side_file(entry.name):
                shutil.copyfile(entry.path, os.path.join(vdir, entry.name))


# --- the facade -------------------------------------------------------------------------------


class Publisher:
    """Publishes versions into ``source_dir`` from the tensors one rank owns.

    One rank: ``publish(v, tensors)``. After a failure, one rule: the version is finished with
    the bytes it was given, then newer weights follow as the next version. Call ``publish(v,
    tensors)`` again with the same bytes, or ``finish_pending()`` (the bytes staged for v; no
    tensors needed), then ``publish(v + 1, newer)``, a delta from v. A retry of a version whose
    index already landed (only the post-write hook or pruning failed) is recognised as
    published: it reruns those steps and returns the same result, never writes v again.
    ``discard_pending()`` gives an unfinished v up instead (its files go; the next version,
    numbered v again, is full). ``pending_version`` names the version written but not committed.

    Several ranks (each with its own Publisher, ``rank``/``world_size`` set), per version ``v``:

    1. every rank: ``prepared = prepare(v, tensors)``. With ``encoding="auto"``, first every
       rank ``sample = sample_encodings(v, tensors)``, then ``choice = choose_encoding(v,
       merge_samples(all ranks' samples))`` (the same sum gives the same choice everywhere), then
       ``prepare(v, tensors, encoding=choice.encoding)``;
    2. every rank: ``kind, reason = choose_kind(v, *totals)`` with the totals over all ranks
       of ``delta_nbytes, full_nbytes, changed_elements, total_elements`` (the same totals give
       the same kind, and the same side-anchor decision, everywhere);
    3. every rank: ``manifest = write(prepared, kind)``; then a barrier that gathers the
       manifests (every shard is durable once it passes);
    4. rank 0: ``commit(v, kind, manifests)`` (writes the index: the commit point);
    5. the other ranks, once told that rank 0's commit succeeded: ``confirm(v)``. (A rank
       that skips it confirms on its next ``prepare(v + 1)`` if it sees v's index.)

    After a failure at any step on any rank (an encode error, one rank's ENOSPC, a failed
    barrier, a failed index write), every rank starts again at step 1 with the same ``v`` and
    the same bytes. A rank that already wrote v reuses what it wrote, and one that did not
    encodes from the same snapshot, so the retry publishes the same bytes. A caller that kept
    its prepared objects and manifests may instead redo only what failed: ``write`` again with
    the same prepared object, or ``commit`` again (after the index landed, a repeated commit
    reruns the post-write hook and pruning, never the index). ``prepare(v + 1)``
    is refused while v is written but not committed. Keep the tensors passed to ``prepare``
    unchanged until ``write`` returns.

    Args:
        source_dir: the shared directory holding ``weight_vNNNNNN/`` dirs.
        encoding: delta encoding (``sparse-v1`` ours and the default; ``sparse-v2`` ours, fewer
            bytes for a slower pull, see the README; ``xor``/``overwrite`` upstream; ``auto``:
            sparse-v1 or sparse-v2 per version, whichever costs a puller less time, wire plus
            apply).
        link_bytes_per_s: for ``auto``, the bytes per second one puller gets from the source dir
            (its share of the link; default: the ``WEIGHTSYNC_LINK_BYTES_PER_S`` knob, which
            must then be set). The rule (``encoding_choice``): encode a sample of 2^20-element
            windows (``WEIGHTSYNC_AUTO_SAMPLE_FRACTION``, 1/64, at least 4) both ways; a step
            the sample shows dense gets sparse-v1 (a full version is likely); else sparse-v2
            when (sparse-v1 bytes - sparse-v2 bytes) / link_bytes_per_s exceeds its extra
            apply time, ``WEIGHTSYNC_SPARSE2_PASS_NS`` (1.9) per element and pass of its
            several-class segments plus ``WEIGHTSYNC_SPARSE2_CHANGE_NS`` (17) per change, on
            one core. The choice and its numbers are in ``PublishResult.encoding_reason``.
        checksum: ``xxh3-128``, ``blake3`` or ``adler32``.
        rank, world_size: this rank among the ranks that write shards of one version.
        template_dir: an HF checkpoint whose non-weight files (config, tokenizer) each full
            version carries, so a full version is a complete checkpoint.
        full_every: publish a full version every N versions (0: never by schedule).
        fallback_fraction: publish a full version when the delta would exceed this fraction
            of the full size.
        full_above_changed_fraction: publish a full version when more than this fraction of
            the elements changed (a dense step: cheaper to copy than to apply).
        anchor_fraction, anchor_max_deltas: write a side anchor (``anchor_vNNNNNN/``, a full
            checkpoint beside a delta that stays a delta) once the deltas since the last anchor
            exceed this fraction of the full size, or number this many (0 disables either).
        keep_versions: the newest versions pruning never removes (default: the
            ``WEIGHTSYNC_KEEP_VERSIONS`` knob).
        prune: after each commit, prune what no cheap pull needs (see ``prune``).
        post_write_hook: callable or import path, called ``hook(version_dir)`` after a commit.
        atomic_rename: write files under a temporary name and rename (False for filesystems
            without rename; files are then written once under their final name).
    """

    def __init__(
        self,
        source_dir: str,
        *,
        encoding: str = DEFAULT_ENCODING,
        checksum: str = DEFAULT_CHECKSUM,
        rank: int = 0,
        world_size: int = 1,
        template_dir: str | None = None,
        full_every: int = 0,
        fallback_fraction: float | None = None,
        full_above_changed_fraction: float | None = None,
        anchor_fraction: float | None = None,
        anchor_max_deltas: int | None = None,
        keep_versions: int | None = None,
        prune: bool = True,
        post_write_hook: "str | Callable | None" = None,
        atomic_rename: bool = True,
        workers: int | None = None,
        link_bytes_per_s: float | None = None,
    ):
        cost: Cost | None = None
        if encoding == AUTO:
            check_candidates()
            cost = Cost.from_knobs(link_bytes_per_s)  # a bad or missing link fails here, not mid-publish
        else:
            get_codec(encoding)  # reject unknown encodings up front
        if checksum not in supported_checksums():
            raise UnsupportedFormatError("checksum_format", checksum, supported_checksums())
        new_hasher(checksum)  # blake3 without its package fails here, not mid-publish
        check_publish_torrent()  # WEIGHTSYNC_PUBLISH_TORRENT=1 without libtorrent fails here, not mid-publish
        if not 0 <= rank < world_size:
            raise PublishError(f"rank {rank} is not in [0, {world_size})")
        # Where versions go (``storage.destination``): a directory, or a bucket (s3://, gs://,
        # az://) through a host-local staging copy whose commits are uploaded (shards, then the
        # index created only if absent). Everything below writes and commits in its ``dir``.
        self.destination = open_destination(source_dir, rank, world_size)
        self.bucket = self.destination if is_bucket_url(source_dir) else None  # its uploads, for tests and tools
        # Ranks on several nodes, each with its own staging copy (storage.rank_reports): the
        # other ranks upload their shards and report them; rank 0 commits from the reports.
        self.reports: RankReports | None = None
        if self.bucket is not None and world_size > 1 and rank_reports_wanted():
            if torrent_wanted():
                raise PublishError(
                    "WEIGHTSYNC_PUBLISH_TORRENT=1 with WEIGHTSYNC_BUCKET_RANK_REPORTS=1: the torrent hashes every "
                    "shard's bytes on rank 0, which does not hold the other ranks' shards; turn one of them off")
            self.reports = RankReports(self.destination)
        source_dir = self.destination.dir
        self.source_dir = source_dir
        self.encoding = encoding
        self.checksum = checksum
        self.rank = rank
        self.world_size = world_size
        self.template_dir = template_dir
        self.kinds = KindRule(full_every, fallback_fraction, full_above_changed_fraction)  # when a version is full
        self.keep_versions = int(knobs.KEEP_VERSIONS.get() if keep_versions is None else keep_versions)
        self.prune = prune
        self.post_write_hook = load_callable(post_write_hook, what="post-write hook", error=PublishError)
        self.atomic_rename = atomic_rename
        self.workers = knobs.workers(knobs.PUBLISH_WORKERS, workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="weightsync-publish")
        self.snapshot = Snapshot()
        level = int(knobs.ZSTD_LEVEL.get())
        self.encoder = Encoder(encoding, checksum, level, self.workers, self._pool)
        self.chooser = EncodingChooser(cost, level, self._pool) if cost is not None else None
        self.writer = ShardWriter(rank, atomic_rename)
        self.committer = Committer(source_dir, encoding, checksum, template_dir, atomic_rename)
        self.budget = AnchorBudget(
            float(knobs.ANCHOR_FRACTION.get() if anchor_fraction is None else anchor_fraction),
            int(knobs.ANCHOR_MAX_DELTAS.get() if anchor_max_deltas is None else anchor_max_deltas),
        )
        self.retention = Retention(source_dir, self.keep_versions)
        self._committed = 0  # the newest version this rank knows is committed
        self.pending = PendingVersion(self.snapshot)  # the version written but not confirmed yet
        self._decisions: dict[int, _Decision] = {}
        self._landed: PublishResult | None = None  # the last version publish() committed (what a retry returns)
        self._full_reason: str | None = None  # set: the next version must be full (after discard_pending)
        self._scanned = False
        # The refusals, each before anything is written; rank 0 takes the writer lease (and
        # writes the run identity into a fresh dir) at its first write, not here: a publish
        # that is refused leaves the source dir as it was.
        self.guard = PublishGuard(source_dir, checksum, world_size, self._pool, atomic_rename)

    @property
    def _staged(self) -> Staged | None:
        return self.pending.staged

    @_staged.setter
    def _staged(self, staged: Staged | None) -> None:
        self.pending.staged = staged

    # The kind rule's settings, as the publisher was given them.
    full_every = property(lambda self: self.kinds.full_every)
    fallback_fraction = property(lambda self: self.kinds.fallback_fraction)
    full_above_changed_fraction = property(lambda self: self.kinds.full_above_changed_fraction)

    @property
    def version(self) -> int:
        """The newest committed version (what the next ``prepare`` follows)."""
        return self._committed

    @property
    def run_id(self) -> str | None:
        return read_run_id(run_path(self.source_dir))

    # --- the snapshot ----------------------------------------------------------------------

    def seed_snapshot(self, tensors: Mapping[str, "RawTensor | np.ndarray"], version: int = 0) -> None:
        """Set the bytes the next delta diffs against (version 0: the engine's own model)."""
        self.snapshot.seed(tensors, version)
        self._committed, self._staged, self._landed, self._full_reason = version, None, None, None
        self.guard.base_checked = None  # the caller's bytes: the next delta checks them against the run

    def seed_snapshot_from_checkpoint(self, checkpoint_dir: str, names: "set[str] | None" = None, version: int = 0) -> None:
        """Seed from an HF checkpoint's safetensors files (optionally only ``names``)."""
        tensors = read_checkpoint_tensors(checkpoint_dir, names)
        missing = (names or set()) - set(tensors)
        if missing:
            raise PublishError(f"{checkpoint_dir} lacks tensors {sorted(missing)[:5]}")
        self.seed_snapshot(tensors, version)

    def snapshot_nbytes(self) -> int:
        return self.snapshot.nbytes()

    def snapshot_names(self) -> list[str]:
        return self.snapshot.names()

    # --- one rank --------------------------------------------------------------------------

    @_host_errors_typed
    def publish(
        self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"], *, full: bool | None = None,
        allow_layout_change: bool = False,
    ) -> PublishResult:
        """Publish one version from this (only) rank: prepare, choose, write, commit.

        Refused before anything is written (typed errors): a version number that does not follow
        the newest committed one, a delta whose base is not what the previous version records,
        a full version that changes the layout (unless ``allow_layout_change``; the index then
        records it). A version already committed with exactly these bytes is "already
        published, identical" (counted, never rewritten); with other bytes it is a conflict
        (``VersionConflictError``)."""
        if self.world_size != 1:
            raise PublishError("publish() is for one rank; with several ranks use prepare/write/commit")
        landed = self._landed
        vdir = version_dir(self.source_dir, version)
        if landed is not None and landed.version == version == self._committed and is_committed(vdir):
            # The index landed and a later step (the hook, pruning) failed: the version is
            # published; a retry with the same bytes only redoes what follows the commit.
            differ = self.snapshot.differing_bytes([(j.name, j.new) for j in self.snapshot.jobs(tensors)])
            if differ:
                raise VersionConflictError(version, self.source_dir, f" with other bytes for tensors {differ[:5]}")
            self._after_commit(vdir)
            return landed
        staged = self._staged
        if staged is not None and staged.version == version and is_committed(vdir):
            # Its index landed, but the write of it reported a failure: count it, never rewrite it.
            self.pending.check_same_bytes(tensors)
            return self._recognise_landed(staged)
        if (staged is None or staged.version != version) and version >= 1 and is_committed(vdir):
            return self._already_published(version, tensors)
        if staged is None:  # before the encode, a refused number costs nothing (a pending version is told first)
            self.guard.check_number(version, full=bool(full) or self._full_by_schedule(version) or self._full_reason is not None)
        prepared = self.prepare(version, tensors, kind="full" if full else None)
        kind, reason = self.choose_kind(
            version, prepared.delta_nbytes, prepared.full_nbytes, prepared.changed_elements, prepared.total_elements,
            requested=None if full is None else ("full" if full else "delta"),
        )
        t0 = time.perf_counter()
        manifest = self.write(prepared, kind, allow_layout_change=allow_layout_change)
        vdir, anchor_nbytes = self._commit_index(version, kind, [manifest], allow_layout_change=allow_layout_change)
        result = self._result(prepared, kind, reason, manifest.nbytes, time.perf_counter() - t0, anchor_nbytes)
        self._landed = result
        self._after_commit(vdir)
        log.info(
            "published v%d as %s%s (%s): %d wire bytes of %d full, %.3f%% elements changed, encode %.3fs write %.3fs%s",
            version, kind, f" {result.encoding}" if result.encoding else "", reason, result.wire_nbytes,
            result.full_nbytes, 100 * result.changed_fraction, result.encode_s, result.write_s,
            f"; {result.encoding_reason}" if result.encoding_reason else "",
        )
        return result

    @property
    def pending_version(self) -> int | None:
        """The version this rank wrote whose commit is not confirmed (None: nothing pending)."""
        return self.pending.version

    @_host_errors_typed
    def finish_pending(self) -> PublishResult | None:
        """One rank: publish the pending version with the bytes staged for it (None: none pending).

        The rule after a failed publish of vN: finish vN with its staged bytes, then publish the
        new weights as vN+1 (a delta from vN). When vN's index is already in the source dir
        (only something after it failed), it is counted as published, not written again.
        """
        staged = self._staged
        if staged is None:
            return None
        if is_committed(version_dir(self.source_dir, staged.version)):
            return self._recognise_landed(staged)
        result = self.publish(staged.version, {}, full=staged.kind == "full")
        result.reason = f"finishing v{staged.version} with the bytes staged by a failed publish ({result.reason})"
        return result

    def discard_pending(self) -> int | None:
        """Give up the pending version: remove its files and publish the next version as full.

        Its index never landed, so no reader has used it, and the number is published afresh by
        the next ``prepare``. The snapshot already holds the discarded bytes, not those of the
        committed version a delta would be applied to, hence the full version. Returns the
        discarded version (None: nothing pending). Raises ``VersionAlreadyPublishedError`` when
        its index has landed meanwhile (it is published: it stays). Several ranks: every rank
        discards, and none writes the version again before all have.
        """
        staged = self._staged
        if staged is None:
            return None
        version = staged.version
        vdir = version_dir(self.source_dir, version)
        if is_committed(vdir):
            raise VersionAlreadyPublishedError(version, self.source_dir, " (its index landed: it cannot be discarded)")
        if self.reports is not None and self.rank != 0:
            if self.reports.committed_index(version) is not None:
                raise VersionAlreadyPublishedError(version, self.reports.url, " (rank 0 committed it: it cannot be discarded)")
            if staged.manifest is not None:
                self.reports.delete_report(staged.manifest.report_key)  # never committed by a later attempt
        if self.rank == 0 and self.guard.lease is not None:
            # A superseded publisher must not delete the files a newer one is writing under the same number.
            self._hold_lease(f"discarding v{version}")
            if self.reports is not None:
                self.reports.delete_reports(version, self.destination.lease_token)  # type: ignore[attr-defined]
        remove_version_files(self.source_dir, version)
        self._staged = None
        self._decisions.pop(version, None)
        self._full_reason = (
            f"full: v{version}'s staged bytes were discarded, and the snapshot no longer holds v{self._committed}'s"
        )
        log.warning("discarded v%d (written on rank %d, never committed); v%d will be full",
                    version, self.rank, self._committed + 1)
        return version

    # --- the multi-rank protocol -------------------------------------------------------------

    @_host_errors_typed
    def prepare(
        self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"], *, kind: Kind | None = None,
        encoding: str | None = None,
    ) -> PreparedVersion:
        """Diff, encode, compress and checksum in memory (parallel over tensors).

        ``kind="full"`` (or a version that ``full_every`` makes full) skips the encoding: a full
        version stores the bytes. Preparing a version this rank already wrote (a retry) checks
        that the bytes are the same and returns what was written. ``encoding``: this version's
        (what ``choose_encoding`` answered; default: the publisher's, and with ``auto`` on one
        rank the choice is made here).
        """
        self._settle(version)
        staged = self._staged
        if staged is not None and staged.version == version:
            self.pending.check_same_bytes(tensors)
            return staged.prepared
        encode = kind != "full" and not self._full_by_schedule(version) and self._full_reason is None
        if version <= self._committed and is_committed(version_dir(self.source_dir, version)):
            raise VersionAlreadyPublishedError(version, self.source_dir)
        if version != self._committed + 1:
            raise PublishError(
                f"version {version} does not follow the snapshot's version {self._committed}; "
                f"publish {self._committed + 1} next (deltas chain one version at a time)"
            )
        if is_committed(version_dir(self.source_dir, version)):
            raise VersionAlreadyPublishedError(version, self.source_dir)
        jobs = self.snapshot.jobs(tensors)
        if encode:
            self.guard.check_base(version, self.snapshot)
        if not encode:
            return self.encoder.prepare(version, self.rank, jobs, encode=False)
        choice = self._encoding_for(version, jobs, encoding)
        return self.encoder.prepare(version, self.rank, jobs, encoding=choice.encoding, encoding_reason=choice.reason)

    def sample_encodings(self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"]) -> EncodingSample:
        """Encoding ``auto``, several ranks: this rank's sample of ``version`` (see
        ``encoding_choice``); sum every rank's with ``merge_samples`` for ``choose_encoding``."""
        chooser = self._auto_chooser()
        return chooser.sample(version, self.snapshot.jobs(tensors))

    def choose_encoding(self, version: int, sample: EncodingSample) -> EncodingChoice:
        """Encoding ``auto``: sparse-v1 or sparse-v2 for ``version`` from the samples of every
        rank, summed (the same sum gives the same answer on every rank), with the reason."""
        choice = self._auto_chooser().choose(sample, self.full_above_changed_fraction)
        log.info("v%d: %s (%s)", version, choice.encoding, choice.reason)
        return choice

    def choose_kind(
        self,
        version: int,
        delta_nbytes: int,
        full_nbytes: int,
        changed_elements: int | None = None,
        total_elements: int | None = None,
        *,
        requested: Kind | None = None,
    ) -> tuple[Kind, str]:
        """Delta or full, with the reason; pass totals over all ranks so every rank agrees.

        A full version wins on schedule (``full_every``), when the delta's bytes exceed
        ``fallback_fraction`` of the full size, or when more than ``full_above_changed_fraction``
        of the elements changed: past that, applying the delta costs a puller more than copying
        a full version, and the chain behind it no longer saves anything. A delta may also get a
        side anchor (see ``AnchorBudget``); the reason says so.
        """
        self._scan_once()
        kind: Kind
        if self._full_reason is not None and requested != "full":
            kind, reason = "full", self._full_reason
        elif requested is not None:
            kind, reason = requested, "requested by the caller"
        else:
            kind, reason = self._kind_by_rule(version, delta_nbytes, full_nbytes, changed_elements, total_elements)
        anchor_why = self.budget.wants_anchor(delta_nbytes, full_nbytes) if kind == "delta" else None
        if anchor_why:
            reason += f"; {anchor_why}"
        self._decisions[version] = _Decision(kind, anchor_why is not None, delta_nbytes)
        return kind, reason

    @_host_errors_typed
    def write(self, prepared: PreparedVersion, kind: Kind, *, allow_layout_change: bool = False) -> ShardManifest:
        """Write this rank's shards of the version (and of its side anchor, when one is due).

        Refused before writing: a version another writer committed meanwhile (this publisher
        never writes into a committed version's dir), a superseded publisher (rank 0: the
        writer lease), a full version that changes the layout (unless ``allow_layout_change``)."""
        if kind not in ("delta", "full"):
            raise PublishError(f"kind must be 'delta' or 'full', got {kind!r}")
        if kind == "delta" and not prepared.encoded:
            raise PublishError(f"v{prepared.version} was prepared for a full version (not encoded); write it as 'full'")
        staged = self._staged
        retry = staged is not None and staged.version == prepared.version
        if retry and staged is not None and prepared is not staged.prepared:
            prepared = self.pending.same_prepared(prepared)
        if not retry and prepared.version != self._committed + 1:
            raise PublishError(f"v{prepared.version} does not follow the committed v{self._committed}; prepare it again")
        vdir = version_dir(self.source_dir, prepared.version)
        if is_committed(vdir):
            if retry and staged is not None and staged.manifest is not None and staged.manifest.kind == kind:
                return staged.manifest  # its index landed (a failure was reported after): commit() recognises it
            raise VersionConflictError(prepared.version, self.source_dir, (
                " by another writer while this publisher prepared it; this publisher wrote nothing into it"))
        if not retry:
            self.guard.check_number(prepared.version, full=kind == "full")
        if kind == "full":
            self.guard.check_layout(prepared.version, [(t.name, t.dtype, tuple(t.shape)) for t in prepared.tensors],
                                    complete=self.world_size == 1, allowed=allow_layout_change)
        if self.rank == 0:
            self._hold_lease(f"writing v{prepared.version}")
            self.destination.write_run_identity(self.atomic_rename)
        decision = self._decisions.get(prepared.version)
        anchor = kind == "delta" and decision is not None and decision.kind == "delta" and decision.anchor
        full_digests = self._tensor_digests(prepared) if kind == "full" or anchor else None
        if kind == "delta":
            weight_map, nbytes = self.writer.write_delta(vdir, prepared.tensors, prepared.version)
        else:
            weight_map, nbytes = self.writer.write_full(vdir, prepared.tensors, prepared.version, full_digests)
        anchor_map, anchor_nbytes, anchor_digests = None, 0, None
        if anchor:
            anchor_map, anchor_nbytes = self.writer.write_full(anchor_dir(self.source_dir, prepared.version),
                                                               prepared.tensors, prepared.version, full_digests)
            anchor_digests = full_digests
        seed = self.guard.seed if prepared.version == 1 and kind == "delta" else None
        manifest = ShardManifest(
            prepared.version, self.rank, kind, weight_map, nbytes, prepared.full_nbytes, anchor_map, anchor_nbytes,
            prepared.encoding if kind == "delta" else "", anchor_digests, full_digests if kind == "full" else None,
            seed.digests if seed is not None else None, seed.layout if seed is not None else None,
        )
        if staged is not None and retry:
            staged.kind, staged.manifest = kind, manifest
        else:
            self._stage(prepared, kind)
            if self._staged is not None:
                self._staged.manifest = manifest
        if self.reports is not None and self.rank != 0:
            # After staging: a failed upload or report is redone by write() again with the same
            # prepared object (the same files), like a failed shard write.
            manifest = self._report(manifest)
            if self._staged is not None:
                self._staged.manifest = manifest
        return manifest

    @_host_errors_typed
    def commit(self, version: int, kind: Kind, manifests: list[ShardManifest], *,
               allow_layout_change: bool = False) -> str:
        """Write the index (last: the commit point), confirm, run the post-write hook, prune. One rank."""
        vdir, _ = self._commit_index(version, kind, manifests, allow_layout_change=allow_layout_change)
        self._after_commit(vdir)
        return vdir

    def confirm(self, version: int) -> None:
        """Count ``version`` as committed on this rank (after rank 0's commit succeeded).

        Idempotent. Raises PublishError when this rank has not written ``version``.
        """
        if version == self._committed:
            return
        staged = self._staged
        if staged is None or staged.version != version:
            raise PublishError(
                f"confirm(v{version}): this rank has not written v{version} (committed: v{self._committed}); "
                "write it first, or retry the version from prepare()"
            )
        own_copy = self.reports is not None and self.rank != 0
        if own_copy and not is_committed(version_dir(self.source_dir, version)):
            assert self.reports is not None
            if not self.reports.adopt_committed(version):
                raise PublishError(
                    f"confirm(v{version}): {self.reports.url} has no index of v{version}, so rank 0's commit has not "
                    f"landed; confirm after it succeeded, or retry v{version} on every rank")
        decision = self._decisions.pop(version, None)
        delta_nbytes = decision.delta_nbytes if decision is not None else staged.prepared.delta_nbytes
        self._scan_once()
        self.budget.record(staged.kind, decision is not None and decision.anchor and staged.kind == "delta", delta_nbytes)
        self._committed, self._staged = version, None
        if staged.kind == "full":
            self._full_reason = None
        if own_copy:
            # This rank's own staging copy: nobody else prunes it (rank 0 prunes its own, and the bucket).
            self.retention.record(version, staged.kind, is_committed(anchor_dir(self.source_dir, version)))
            if self.prune:
                self.retention.prune()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # --- helpers ---------------------------------------------------------------------------

    def _commit_index(self, version: int, kind: Kind, manifests: list[ShardManifest], *,
                      allow_layout_change: bool = False) -> tuple[str, int]:
        """Write the version's index and count it committed; (version dir, anchor bytes)."""
        self._hold_lease(f"committing v{version}")  # a superseded publisher stops here, loud
        self._scan_once()
        staged = self._staged
        vdir = version_dir(self.source_dir, version)
        if is_committed(vdir) and (
            version == self._committed and (staged is None or staged.version != version)
            or staged is not None and staged.version == version
        ):
            # Committed already (a retry after the hook or a later step failed, or an index
            # write that reported a failure after it landed): never rewrite an index. Counted
            # as this publisher's only when it names exactly the shards this publisher wrote.
            if staged is not None and staged.version == version:
                written = [m.weight_map for m in manifests] or ([staged.manifest.weight_map] if staged.manifest else [])
                if not written:
                    raise VersionConflictError(version, self.source_dir, (
                        ": its index landed, and this publisher has no record of the shards it wrote to tell "
                        "whether it is its own"))
                self.guard.check_landed_is_ours(version, written)
                self.confirm(version)
                self.retention.record(version, staged.kind, is_committed(anchor_dir(self.source_dir, version)))
            return vdir, 0
        foreign: dict[str, _Foreign] | None = None
        if self.reports is not None and self.rank == 0:
            manifests, foreign = self._gather_reports(version, kind, manifests)
        layout_change = None
        if kind == "full":
            if allow_layout_change:
                layout_change = "allowed by the publisher's caller"
            else:
                self._check_tensor_set(version, set(_merged(manifests, version, kind, lambda m: m.weight_map)))
        vdir, anchor_nbytes = self.committer.commit(version, kind, manifests, fence=self._hold_lease,
                                                    layout_change=layout_change, foreign=foreign)
        if staged is not None and staged.version == version:
            self.confirm(version)
        self.retention.record(version, kind, anchor_nbytes > 0)
        return vdir, anchor_nbytes

    def _report(self, manifest: ShardManifest) -> ShardManifest:
        """A rank other than 0 with its own staging copy: upload this rank's shards of the
        version and report them (``storage.rank_reports``); the manifest names the report."""
        assert self.reports is not None
        version = manifest.version
        committed = self.reports.committed_index(version)
        if committed is not None:
            # Rank 0 committed it already (a retry whose earlier reply was lost): counted only
            # when its index names exactly this rank's shards; nothing is written into it.
            wmap = committed.get("weight_map") or {}
            differ = sorted(n for n, f in manifest.weight_map.items() if wmap.get(n) != f)
            if differ:
                raise VersionConflictError(version, self.reports.url, (
                    f" by another writer: its index maps tensors {differ[:5]} to other shards than the ones rank "
                    f"{self.rank} wrote; nothing was uploaded into it"))
            return manifest
        vname, aname = version_dir_name(version), anchor_dir_name(version)

        def files_of(dname: str, wmap: "dict[str, str] | None") -> dict[str, tuple[int, str]]:
            out = {}
            for f in sorted(set((wmap or {}).values())):
                d = digest_file(os.path.join(self.source_dir, dname, f))
                out[f] = (d.nbytes, d.digest)
            return out

        files, anchor_files = files_of(vname, manifest.weight_map), files_of(aname, manifest.anchor_weight_map)
        layout = (layout_of_shards(os.path.join(self.source_dir, vname), manifest.weight_map)
                  if manifest.kind == "full" else None)
        anchor_layout = (layout_of_shards(os.path.join(self.source_dir, aname), manifest.anchor_weight_map)
                         if manifest.anchor_weight_map else None)
        manifest = msgspec.structs.replace(manifest, files=files, anchor_files=anchor_files or None, layout=layout,
                                           anchor_layout=anchor_layout, report_key="")
        key = self.reports.upload_and_report(version, self.rank, {vname: sorted(files), aname: sorted(anchor_files)},
                                             msgspec.to_builtins(manifest))
        return msgspec.structs.replace(manifest, report_key=key)

    def _gather_reports(self, version: int, kind: Kind, manifests: list[ShardManifest]
                        ) -> tuple[list[ShardManifest], dict[str, _Foreign]]:
        """Rank 0 with rank reports: its own manifest and every other rank's, from their reports
        in the bucket (a rank whose manifest the caller passed: exactly the report it names),
        and what the commit takes from the reports instead of the other ranks' files."""
        assert self.reports is not None
        staged = self._staged
        own = [m for m in manifests if m.rank == 0]
        if not own and staged is not None and staged.version == version and staged.manifest is not None:
            own = [staged.manifest]
        if not own:
            raise PublishError(f"commit(v{version}): rank 0 has not written v{version}; write it first (every rank)")
        given = {m.rank: m for m in manifests if m.rank != 0}
        want = {r: (given[r].report_key or None) if r in given else None for r in range(1, self.world_size)}
        reports = self.reports.collect(version, want, self.destination.lease_token)  # type: ignore[attr-defined]
        merged = list(own)
        vname, aname = version_dir_name(version), anchor_dir_name(version)
        out: dict[str, _Foreign] = {}
        for r, report in sorted(reports.items()):
            try:
                m = msgspec.convert(report.manifest, ShardManifest)
            except msgspec.ValidationError as e:
                raise RankReportMismatchError(version, self.reports.url, r, f"holds no readable manifest ({e})") from None
            g = given.get(r)
            if g is not None and (m.kind, m.weight_map, m.anchor_weight_map) != (g.kind, g.weight_map, g.anchor_weight_map):
                raise RankReportMismatchError(version, self.reports.url, r, (
                    "names other shards than the manifest its write() returned in this attempt"))
            if m.kind != kind or m.files is None or (m.anchor_weight_map is not None and m.anchor_files is None):
                raise RankReportMismatchError(version, self.reports.url, r, (
                    f"is for a {m.kind} version (this commit: {kind})" if m.kind != kind else "lacks its shards' digests"))
            merged.append(m)
            for dname, files, layout in ((vname, m.files, m.layout), (aname, m.anchor_files, m.anchor_layout)):
                if files:
                    prev = out.get(dname, _Foreign({}, {}))
                    out[dname] = _Foreign({**prev.files, **files}, {**prev.layout, **(layout or {})})
        return merged, out

    def _hold_lease(self, what: str) -> None:
        """The writer lease: taken in the dir on first use, then checked (``guard``); and held
        where the destination's readers look (a bucket's lease object), so a publisher started
        on another host fences this one too."""
        self.guard.hold_lease(what)
        assert self.guard.lease is not None
        self.destination.hold_lease(msgspec.json.encode(self.guard.lease), what)

    def _check_tensor_set(self, version: int, names: set[str]) -> None:
        """Several ranks: each checked its tensors' dtypes and shapes at write(); the whole
        tensor set is known only here, from every rank's manifest."""
        from .records import recorded_layout

        layout, _ = recorded_layout(self.source_dir, version - 1)
        if layout is None or set(layout) == names:
            return
        from ..errors import LayoutChangeError

        raise LayoutChangeError(version, version - 1, [f"drops tensor {n}" for n in sorted(set(layout) - names)]
                                + [f"adds tensor {n}" for n in sorted(names - set(layout))])

    def _already_published(self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"]) -> PublishResult:
        """``version`` is committed (by an earlier run of the caller, or another writer): an identical
        retry is counted (the snapshot takes its bytes, nothing is written); other bytes raise
        VersionConflictError."""
        jobs = self.snapshot.jobs(tensors)
        kind = self.guard.identical_kind(version, jobs)
        self.snapshot.advance(version, [(j.name, j.new, None) for j in jobs if not j.untouched])
        self._committed, self._staged, self._full_reason = version, None, None
        self.guard.base_checked, self._scanned = version, False
        total = sum(j.new.nbytes for j in jobs)
        elements = sum(int(np.prod(j.shape, dtype=np.int64)) for j in jobs)
        result = PublishResult(version, kind, "already published, identical: nothing written", 0, total, 0, 0,
                               elements, 0.0, 0.0)
        self._landed = result
        log.info("v%d is already published with exactly these bytes: counted, nothing written", version)
        return result

    def _after_commit(self, vdir: str) -> None:
        """What follows a commit (repeated by a retry once the index landed): the hook, pruning."""
        self.destination.publish_committed()  # a retry after a failed upload lands here again
        if self.post_write_hook is not None:
            self.post_write_hook(vdir)
        if self.prune:
            self.retention.prune()
            self.destination.mirror_pruned()

    def _recognise_landed(self, staged: Staged) -> PublishResult:
        """The staged version's index is in the source dir: count it published (one rank)."""
        vdir = version_dir(self.source_dir, staged.version)
        self._commit_index(staged.version, staged.kind, [])  # type: ignore[arg-type]
        p = staged.prepared
        result = self._result(p, staged.kind, "already committed on disk (its index landed before a later step failed)",
                              0, 0.0, 0)
        self._landed = result
        self._after_commit(vdir)
        return result

    @staticmethod
    def _result(prepared: PreparedVersion, kind: str, reason: str, wire_nbytes: int, write_s: float,
                anchor_nbytes: int) -> PublishResult:
        return PublishResult(
            prepared.version, kind, reason, wire_nbytes, prepared.full_nbytes, prepared.changed_bytes,
            prepared.changed_elements, prepared.total_elements, prepared.encode_s, write_s,
            anchor_nbytes, prepared.encoding if kind == "delta" else "", prepared.encoding_reason,
        )

    def _tensor_digests(self, prepared: PreparedVersion) -> dict[str, str]:
        """The digest of every tensor's bytes (a side anchor's binding, a full version's check).
        Encoded, a changed tensor's was computed by the encode and an unchanged one's is the
        snapshot's; not encoded, a tensor's digest is the snapshot's old one, so all are hashed."""

        def digest_of(t: PreparedTensor) -> tuple[str, str]:
            if t.digest and prepared.encoded:
                return t.name, t.digest
            h = new_hasher(self.checksum)
            h.update(t.new)
            return t.name, h.hexdigest()

        return dict(self._pool.map(digest_of, sorted(prepared.tensors, key=lambda t: -t.nbytes)))

    def _stage(self, prepared: PreparedVersion, kind: str) -> None:
        """Take the written bytes into the snapshot and keep what a retry reuses."""
        self.pending.stage(prepared, kind)
        self.guard.base_checked = prepared.version  # its own bytes from here: nothing to check again


    def _settle(self, version: int) -> None:
        """Before preparing ``version``: confirm a written predecessor whose index has landed."""
        staged = self._staged
        if staged is None or staged.version != version - 1:
            return
        landed = is_committed(version_dir(self.source_dir, staged.version))
        if not landed and self.reports is not None and self.rank != 0:
            landed = self.reports.adopt_committed(staged.version)  # rank 0 committed it in the bucket
        if landed:
            self.confirm(staged.version)
            return
        raise PendingVersionError(staged.version, f"cannot prepare v{version}")

    def _encoding_for(self, version: int, jobs, requested: str | None) -> EncodingChoice:
        if requested is not None and requested != AUTO:
            get_codec(requested)
            return EncodingChoice(requested, "")
        if self.encoding != AUTO:
            return EncodingChoice(self.encoding, "")
        if self.world_size != 1:
            raise PublishError(
                f"v{version}: encoding 'auto' with {self.world_size} ranks needs one choice for all of them: call "
                "sample_encodings on every rank, choose_encoding on the sum (merge_samples), then "
                "prepare(..., encoding=choice.encoding)"
            )
        chooser = self._auto_chooser()
        return chooser.choose(chooser.sample(version, jobs), self.full_above_changed_fraction)

    def _auto_chooser(self) -> EncodingChooser:
        if self.chooser is None:
            raise PublishError(f"this publisher encodes with {self.encoding!r}, not 'auto': it has no encoding to choose")
        return self.chooser

    def _full_by_schedule(self, version: int) -> bool:
        return self.kinds.full_by_schedule(version)

    def _kind_by_rule(
        self, version: int, delta_nbytes: int, full_nbytes: int, changed_elements: int | None, total_elements: int | None
    ) -> tuple[Kind, str]:
        return self.kinds.decide(version, delta_nbytes, full_nbytes, changed_elements, total_elements)

    def _scan_once(self) -> None:
        """A restarted publisher reads the source dir once: what retention must know, and the
        delta bytes since the newest anchor point (so the anchor budget goes on where it was)."""
        if self._scanned:
            return
        self._scanned = True
        self.retention.load(upto=self._committed)
        self.budget.since_nbytes, self.budget.since_count = self.retention.since_anchor(self._committed)


def _remove_orphan_anchor(adir: str, version: int) -> None:
    """An anchor dir beside a version committed without one: an earlier attempt's, never bound
    to what is committed now. Its index goes first, so no reader sees half of it."""
    log.warning("removing %s: left by an earlier attempt at v%d, which is now committed without an anchor", adir, version)
    try:
        os.unlink(os.path.join(adir, INDEX_NAME))
    except FileNotFoundError:
        pass
    shutil.rmtree(adir, ignore_errors=True)
    fsync_dir(os.path.dirname(adir) or ".")


def _with_reported_file_digests(directory: str, index: bytes, known: _Foreign) -> bytes:
    """``with_file_digests``, the other ranks' files' entries taken from their reports (the
    same entry, byte for byte, as hashing the file: nbytes and the xxh3-128 of its bytes)."""
    obj = json.loads(index)
    entries = {}
    for name in sorted(set((obj.get("weight_map") or {}).values())):
        if name in known.files:
            nbytes, digest = known.files[name]
        else:
            d = digest_file(os.path.join(directory, name))
            nbytes, digest = d.nbytes, d.digest
        entries[name] = {"nbytes": nbytes, FILE_DIGEST_ALGORITHM: digest}
    obj[FILE_DIGESTS_KEY] = entries
    return json.dumps(obj, indent=1).encode()


def _with_metadata(index: bytes, extra: dict[str, str]) -> bytes:
    import json

    obj = json.loads(index)
    obj["metadata"].update(extra)
    return json.dumps(obj, indent=1).encode()


def _payload_len(t: PreparedTensor) -> int:
    return len(t.payload) if t.payload is not None else 0


def _merged(manifests: list[ShardManifest], version: int, kind: str, part) -> dict[str, str]:
    weight_map: dict[str, str] = {}
    for m in manifests:
        if m.version != version or m.kind != kind:
            raise PublishError(f"manifest of rank {m.rank} is for v{m.version} ({m.kind}), not v{version} ({kind})")
        wmap = part(m)
        clash = weight_map.keys() & wmap.keys()
        if clash:
            raise PublishError(f"tensors {sorted(clash)[:5]} were written by two ranks; each tensor needs one owner")
        weight_map.update(wmap)
    return weight_map


def _group_by_size(items, size_of, limit: int) -> list[list]:
    """Consecutive groups whose sizes stay under limit (one oversized item gets its own)."""
    groups: list[list] = []
    current: list = []
    total = 0
    for item in sorted(items, key=lambda t: t.name):
        n = size_of(item)
        if current and total + n > limit:
            groups.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        groups.append(current)
    return groups


__all__ = [
    "Publisher", "RawTensor", "PublishResult", "PreparedVersion", "ShardManifest", "read_checkpoint_tensors",
    "DEFAULT_ENCODING", "as_raw", "AUTO", "EncodingSample", "EncodingChoice", "merge_samples",
]
