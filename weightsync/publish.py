"""Publish: write one version from named tensors (raw bytes in, files out).

A delta version diffs each tensor against the previous version's bytes (the snapshot the
publisher keeps), encodes, compresses and checksums it, and writes shards; the index goes last
and is the commit point. Several ranks may each write the shards of the tensors they own
(shard names carry the rank, so numbering never depends on a directory listing); the caller
coordinates them and one rank commits. Single-process callers use ``Publisher.publish``.

Invariant: the snapshot advances only after this rank's shards are durable, so a failed write
can be retried with the same inputs.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Literal, Mapping, cast

import msgspec
import numpy as np

from . import knobs
from .checksum import DEFAULT_CHECKSUM, new_hasher, supported_checksums
from .codecs import SegmentedCodec, get_codec
from .errors import PublishError, UnsupportedFormatError
from .fsio import fsync_dir, write_bytes, write_file
from .hooks import load_callable
from .layout import (
    INDEX_NAME,
    delta_shard_name,
    full_shard_name,
    index_path,
    is_model_side_file,
    version_dir,
)
from .manifest import build_delta_index, build_full_index, checkpoint_weight_files
from .safetensors_io import DTYPE_NBYTES, as_byte_view, iter_file_chunks, local_tensor_table, read_header

log = logging.getLogger(__name__)

SPLIT_MIN_NBYTES = 64 << 20  # smallest tensor a sparse-v1 publish may encode on several workers
DEFAULT_ENCODING = "sparse-v1"  # ours; "xor" and "overwrite" stay available for upstream readers
Kind = Literal["delta", "full"]

_NP_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
}


class RawTensor(msgspec.Struct, frozen=True):
    """A tensor as bytes: safetensors dtype name, shape, and a C-contiguous buffer."""

    dtype: str
    shape: tuple[int, ...]
    data: object

    def bytes_view(self) -> np.ndarray:
        arr = np.frombuffer(as_byte_view(self.data), dtype=np.uint8)
        return arr


def as_raw(value: "RawTensor | np.ndarray") -> RawTensor:
    if isinstance(value, RawTensor):
        return value
    if isinstance(value, np.ndarray):
        st = _NP_TO_ST.get(value.dtype.name)
        if st is None:
            raise PublishError(f"numpy dtype {value.dtype} has no safetensors name; pass a RawTensor")
        return RawTensor(st, tuple(value.shape), np.ascontiguousarray(value))
    raise PublishError(f"expected a RawTensor or numpy array, got {type(value).__name__}")


class PreparedTensor(msgspec.Struct):
    name: str
    dtype: str
    shape: tuple[int, ...]
    new: np.ndarray  # uint8 view of the new bytes
    payload: bytes | None  # compressed delta; None when the tensor did not change
    digest: str
    changed_bytes: int
    changed_elements: int
    nbytes: int
    nelements: int


class PreparedVersion(msgspec.Struct):
    version: int
    rank: int
    tensors: list[PreparedTensor]
    delta_nbytes: int  # payload bytes of the changed tensors
    full_nbytes: int  # bytes of every tensor this rank owns
    changed_bytes: int
    changed_elements: int
    total_elements: int
    encode_s: float


class ShardManifest(msgspec.Struct, frozen=True):
    """What one rank wrote for one version; rank 0 merges these into the index."""

    version: int
    rank: int
    kind: str
    weight_map: dict[str, str]
    nbytes: int


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

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


class _SnapEntry(msgspec.Struct):
    dtype: str
    shape: tuple[int, ...]
    buf: np.ndarray  # uint8, owned


class Publisher:
    """Publishes versions into ``source_dir`` from the tensors one rank owns.

    Args:
        source_dir: the shared directory holding ``weight_vNNNNNN/`` dirs.
        encoding: delta encoding (``sparse-v1`` ours, ``xor``/``overwrite`` upstream).
        checksum: ``xxh3-128``, ``blake3`` or ``adler32``.
        rank, world_size: this rank among the ranks that write shards of one version.
        template_dir: an HF checkpoint whose non-weight files (config, tokenizer) each full
            version carries, so a full version is a complete checkpoint.
        full_every: publish a full version every N versions (0: never by schedule).
        fallback_fraction: publish a full version when the delta would exceed this fraction
            of the full size.
        full_above_changed_fraction: publish a full version when more than this fraction of
            the elements changed (a dense step: cheaper to copy than to apply).
        keep_versions: after each commit, prune versions no pull can need, keeping this many
            newest (None: never prune).
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
        keep_versions: int | None = None,
        post_write_hook: "str | Callable | None" = None,
        atomic_rename: bool = True,
        workers: int | None = None,
    ):
        get_codec(encoding)  # reject unknown encodings up front
        if checksum not in supported_checksums():
            raise UnsupportedFormatError("checksum_format", checksum, supported_checksums())
        new_hasher(checksum)  # blake3 without its package fails here, not mid-publish
        if not 0 <= rank < world_size:
            raise PublishError(f"rank {rank} is not in [0, {world_size})")
        self.source_dir = source_dir
        self.encoding = encoding
        self.checksum = checksum
        self.rank = rank
        self.world_size = world_size
        self.template_dir = template_dir
        self.full_every = int(full_every)
        self.fallback_fraction = float(knobs.FALLBACK_FRACTION.get() if fallback_fraction is None else fallback_fraction)
        self.full_above_changed_fraction = float(
            knobs.FULL_ABOVE_CHANGED_FRACTION.get() if full_above_changed_fraction is None else full_above_changed_fraction
        )
        self.keep_versions = keep_versions
        self.post_write_hook = load_callable(post_write_hook, what="post-write hook", error=PublishError)
        self.atomic_rename = atomic_rename
        self.workers = knobs.workers(knobs.PUBLISH_WORKERS, workers)
        self.level = int(knobs.ZSTD_LEVEL.get())
        self.version = 0  # the version the snapshot holds
        self._snapshot: dict[str, _SnapEntry] = {}
        self._pending_commit: tuple | None = None  # (version, kind, manifests, result) until the index lands
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="weightsync-publish")
        os.makedirs(source_dir, exist_ok=True)

    # --- the snapshot ----------------------------------------------------------------------

    def seed_snapshot(self, tensors: Mapping[str, "RawTensor | np.ndarray"], version: int = 0) -> None:
        """Set the bytes the next delta diffs against (version 0: the engine's own model)."""
        for name, value in tensors.items():
            raw = as_raw(value)
            src = raw.bytes_view()
            self._check_len(name, raw, src)
            entry = self._snapshot.get(name)
            if entry is None or entry.buf.nbytes != src.nbytes:
                entry = _SnapEntry(raw.dtype, raw.shape, np.empty(src.nbytes, np.uint8))
                self._snapshot[name] = entry
            entry.dtype, entry.shape = raw.dtype, raw.shape
            np.copyto(entry.buf, src)
        self.version = version

    def seed_snapshot_from_checkpoint(self, checkpoint_dir: str, names: "set[str] | None" = None, version: int = 0) -> None:
        """Seed from an HF checkpoint's safetensors files (optionally only ``names``)."""
        tensors = read_checkpoint_tensors(checkpoint_dir, names)
        missing = (names or set()) - set(tensors)
        if missing:
            raise PublishError(f"{checkpoint_dir} lacks tensors {sorted(missing)[:5]}")
        self.seed_snapshot(tensors, version)

    def snapshot_nbytes(self) -> int:
        return sum(e.buf.nbytes for e in self._snapshot.values())

    def snapshot_names(self) -> list[str]:
        return list(self._snapshot)

    # --- publish ---------------------------------------------------------------------------

    def publish(
        self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"], *, full: bool | None = None
    ) -> PublishResult:
        """Publish one version from this (only) rank: prepare, choose, write, commit."""
        if self.world_size != 1:
            raise PublishError("publish() is for one rank; with several ranks use prepare/write/commit")
        pending = self._pending_commit
        if pending is not None and pending[0] == version == self.version:
            # The shards are written and the snapshot advanced; only the index failed. Retrying
            # with the same inputs commits again (the caller's tensors are the same bytes).
            _, kind, manifests, result = pending
            self.commit(version, kind, manifests)
            self._pending_commit = None
            return result
        prepared = self.prepare(version, tensors)
        if full is None:
            kind, reason = self.choose_kind(
                version, prepared.delta_nbytes, prepared.full_nbytes, prepared.changed_elements, prepared.total_elements
            )
        else:
            kind, reason = ("full", "requested by the caller") if full else ("delta", "requested by the caller")
        t0 = time.perf_counter()
        manifest = self.write(prepared, kind)
        result = PublishResult(
            version, kind, reason, manifest.nbytes, prepared.full_nbytes, prepared.changed_bytes,
            prepared.changed_elements, prepared.total_elements, prepared.encode_s, 0.0,
        )
        self._pending_commit = (version, kind, [manifest], result)
        self.commit(version, kind, [manifest])
        self._pending_commit = None
        result.write_s = time.perf_counter() - t0
        log.info(
            "published v%d as %s (%s): %d wire bytes of %d full, %.3f%% elements changed, encode %.3fs write %.3fs",
            version, kind, reason, result.wire_nbytes, result.full_nbytes, 100 * result.changed_fraction,
            result.encode_s, result.write_s,
        )
        return result

    def prepare(self, version: int, tensors: Mapping[str, "RawTensor | np.ndarray"]) -> PreparedVersion:
        """Diff, encode, compress and checksum in memory (parallel over tensors)."""
        if version != self.version + 1:
            raise PublishError(
                f"version {version} does not follow the snapshot's version {self.version}; "
                f"publish {self.version + 1} next (deltas chain one version at a time)"
            )
        if os.path.exists(index_path(version_dir(self.source_dir, version))):
            raise PublishError(
                f"version {version} is already published in {self.source_dir}; versions are immutable, "
                "publish the next one or remove the source dir for a new run"
            )
        unknown = [n for n in tensors if n not in self._snapshot]
        if unknown:
            raise PublishError(
                f"tensors {unknown[:5]} are not in the snapshot; seed the snapshot with every tensor this rank owns"
            )
        jobs = []
        for name, value in tensors.items():
            raw = as_raw(value)
            new = raw.bytes_view()
            snap = self._snapshot[name]
            self._check_len(name, raw, new)
            if (raw.dtype, tuple(raw.shape)) != (snap.dtype, tuple(snap.shape)):
                raise PublishError(
                    f"tensor {name}: got {raw.dtype} {list(raw.shape)}, the snapshot holds "
                    f"{snap.dtype} {list(snap.shape)}; dtype and shape must not change between versions"
                )
            jobs.append((name, raw, new, snap))
        # Tensors not passed this time are unchanged: carry their snapshot bytes.
        for name, snap in self._snapshot.items():
            if name not in tensors:
                jobs.append((name, RawTensor(snap.dtype, snap.shape, snap.buf), snap.buf, snap))
        codec = get_codec(self.encoding)
        t0 = time.perf_counter()
        plan = self._split_plan(codec, jobs)
        # _split_plan plans parts only for a codec that has them: used only when plan is non-empty
        parted = cast(SegmentedCodec, codec)

        def encode_one(job) -> PreparedTensor:
            name, raw, new, snap = job
            itemsize = DTYPE_NBYTES[raw.dtype]
            if name in plan:  # its parts are encoded by other units; this one only hashes
                enc = None
            else:
                enc = None if new is snap.buf else codec.encode(snap.buf, new, itemsize, self.level, name)
            if enc is None:
                payload, cb, ce = None, 0, 0
            else:
                payload, cb, ce = enc
            h = new_hasher(self.checksum)
            h.update(new)
            return PreparedTensor(
                name, raw.dtype, tuple(raw.shape), new, payload, h.hexdigest(), cb, ce, new.nbytes,
                new.nbytes // itemsize,
            )

        def run_unit(unit):
            job, seg_range = unit
            if seg_range is None:
                return encode_one(job)
            name, raw, new, snap = job
            return parted.encode_part(snap.buf, new, DTYPE_NBYTES[raw.dtype], self.level, name, seg_range)

        # largest first, so no big tensor starts last; large sparse-v1 tensors in several parts
        order = sorted(jobs, key=lambda j: -j[2].nbytes)
        units = [(j, r) for j in order if j[0] in plan for r in plan[j[0]]] + [(j, None) for j in order]
        results = list(self._pool.map(run_unit, units))
        parts: dict[str, list] = {}
        by_name: dict[str, PreparedTensor] = {}
        for (job, seg_range), r in zip(units, results):
            if seg_range is None:
                by_name[job[0]] = r
            else:
                parts.setdefault(job[0], []).append(r)
        for name, ps in parts.items():
            t = by_name[name]
            enc = parted.join(ps, t.nbytes, DTYPE_NBYTES[t.dtype])
            if enc is not None:
                t.payload, t.changed_bytes, t.changed_elements = enc
        prepared = [by_name[j[0]] for j in jobs]
        encode_s = time.perf_counter() - t0
        return PreparedVersion(
            version=version,
            rank=self.rank,
            tensors=prepared,
            delta_nbytes=sum(len(t.payload) for t in prepared if t.payload is not None),
            full_nbytes=sum(t.nbytes for t in prepared),
            changed_bytes=sum(t.changed_bytes for t in prepared),
            changed_elements=sum(t.changed_elements for t in prepared),
            total_elements=sum(t.nelements for t in prepared),
            encode_s=encode_s,
        )

    def _split_plan(self, codec, jobs) -> dict[str, list[tuple[int, int]]]:
        """name -> segment ranges for the changed tensors worth encoding on several workers:
        larger than SPLIT_MIN_NBYTES and than half a worker's fair share (one embedding would
        otherwise keep one worker busy while the others idle). Needs a codec with parts."""
        if self.workers <= 1 or not hasattr(codec, "encode_part"):
            return {}
        total = sum(j[2].nbytes for j in jobs)
        limit = max(SPLIT_MIN_NBYTES, total // (2 * self.workers))
        plan = {}
        for name, raw, new, snap in jobs:
            if new is snap.buf or new.nbytes <= limit:
                continue
            nseg = codec.segment_count(new.nbytes, DTYPE_NBYTES[raw.dtype])
            nparts = min(nseg, self.workers, -(-new.nbytes // (limit // 2)))
            if nparts >= 2:
                bounds = [nseg * i // nparts for i in range(nparts + 1)]
                plan[name] = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        return plan

    def choose_kind(
        self,
        version: int,
        delta_nbytes: int,
        full_nbytes: int,
        changed_elements: int | None = None,
        total_elements: int | None = None,
    ) -> tuple[Kind, str]:
        """Delta or full, with the reason; pass totals over all ranks so every rank agrees.

        A full version wins on schedule (``full_every``), when the delta's bytes exceed
        ``fallback_fraction`` of the full size, or when more than ``full_above_changed_fraction``
        of the elements changed: past that, applying the delta costs a puller more than copying
        a full version, and the chain behind it no longer saves anything.
        """
        if self.full_every > 0 and version % self.full_every == 0:
            return "full", f"every {self.full_every} versions"
        if full_nbytes and delta_nbytes > self.fallback_fraction * full_nbytes:
            return "full", (
                f"delta would be {delta_nbytes / full_nbytes:.0%} of the full size "
                f"(threshold {self.fallback_fraction:.0%})"
            )
        if changed_elements is not None and total_elements:
            changed = changed_elements / total_elements
            if changed > self.full_above_changed_fraction:
                return "full", (
                    f"{changed:.0%} of the elements changed "
                    f"(threshold {self.full_above_changed_fraction:.0%}); a full version is cheaper to pull"
                )
        return "delta", f"delta is {delta_nbytes / max(full_nbytes, 1):.2%} of the full size"

    def write(self, prepared: PreparedVersion, kind: Kind) -> ShardManifest:
        """Write this rank's shards of the version, then advance the snapshot."""
        vdir = version_dir(self.source_dir, prepared.version)
        os.makedirs(vdir, exist_ok=True)
        weight_map: dict[str, str] = {}
        written = 0
        if kind == "delta":
            groups = _group_by_size(
                [t for t in prepared.tensors if t.payload is not None],
                lambda t: len(t.payload),
                int(knobs.DELTA_SHARD_NBYTES.get()),
            )
            for part, group in enumerate(groups, start=1):
                fname = delta_shard_name(self.rank, part)
                entries = [(t.name, "U8", (len(t.payload),), t.payload) for t in group]
                meta = {t.name: t.digest for t in group}
                written += write_file(os.path.join(vdir, fname), iter_file_chunks(entries, meta), atomic=self.atomic_rename)
                weight_map.update({t.name: fname for t in group})
        elif kind == "full":
            groups = _group_by_size(prepared.tensors, lambda t: t.nbytes, int(knobs.FULL_SHARD_NBYTES.get()))
            for part, group in enumerate(groups, start=1):
                fname = full_shard_name(self.rank, part)
                entries = [(t.name, t.dtype, t.shape, t.new) for t in group]
                written += write_file(
                    os.path.join(vdir, fname), iter_file_chunks(entries, {"format": "pt"}), atomic=self.atomic_rename
                )
                weight_map.update({t.name: fname for t in group})
        else:
            raise PublishError(f"kind must be 'delta' or 'full', got {kind!r}")
        for t in prepared.tensors:
            snap = self._snapshot[t.name]
            if t.new is not snap.buf and (kind == "full" or t.payload is not None):
                np.copyto(snap.buf, t.new)
        self.version = prepared.version
        return ShardManifest(prepared.version, self.rank, kind, weight_map, written)

    def commit(self, version: int, kind: Kind, manifests: list[ShardManifest]) -> str:
        """Write the index (last: the commit point), run the post-write hook, prune. One rank."""
        vdir = version_dir(self.source_dir, version)
        weight_map: dict[str, str] = {}
        for m in manifests:
            if m.version != version or m.kind != kind:
                raise PublishError(f"manifest of rank {m.rank} is for v{m.version} ({m.kind}), not v{version} ({kind})")
            clash = weight_map.keys() & m.weight_map.keys()
            if clash:
                raise PublishError(f"tensors {sorted(clash)[:5]} were written by two ranks; each tensor needs one owner")
            weight_map.update(m.weight_map)
        if kind == "full":
            self._copy_template_files(vdir)
            total = sum(m.nbytes for m in manifests)
            index = build_full_index(version, weight_map, total)
        else:
            index = build_delta_index(version, self.encoding, self.checksum, weight_map)
        fsync_dir(vdir)
        write_bytes(os.path.join(vdir, INDEX_NAME), index, atomic=self.atomic_rename)
        fsync_dir(vdir)
        if self.post_write_hook is not None:
            self.post_write_hook(vdir)
        if self.keep_versions is not None:
            from .prune import prune_versions

            prune_versions(self.source_dir, keep=self.keep_versions)
        return vdir

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # --- helpers ---------------------------------------------------------------------------

    def _copy_template_files(self, vdir: str) -> None:
        if not self.template_dir:
            return
        for entry in os.scandir(self.template_dir):
            if entry.is_file() and is_model_side_file(entry.name):
                shutil.copyfile(entry.path, os.path.join(vdir, entry.name))

    @staticmethod
    def _check_len(name: str, raw: RawTensor, data: np.ndarray) -> None:
        if raw.dtype not in DTYPE_NBYTES:
            raise PublishError(f"tensor {name}: unknown dtype {raw.dtype!r}; expected one of {sorted(DTYPE_NBYTES)}")
        expected = int(np.prod(raw.shape, dtype=np.int64)) * DTYPE_NBYTES[raw.dtype]
        if data.nbytes != expected:
            raise PublishError(
                f"tensor {name}: {data.nbytes} bytes given, {raw.dtype} x {list(raw.shape)} needs {expected}"
            )


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


def read_checkpoint_tensors(checkpoint_dir: str, names: "set[str] | None" = None) -> dict[str, RawTensor]:
    """The tensors of an HF checkpoint (all, or those in ``names``) as RawTensor (reads the bytes)."""
    table = local_tensor_table(checkpoint_dir, checkpoint_weight_files(checkpoint_dir))
    return {
        name: RawTensor(e.dtype, e.shape, np.fromfile(p, dtype=np.uint8, count=e.nbytes, offset=e.offset))
        for name, (p, e) in table.items()
        if names is None or name in names
    }


__all__ = [
    "Publisher", "RawTensor", "PublishResult", "PreparedVersion", "ShardManifest", "read_checkpoint_tensors",
    "DEFAULT_ENCODING",
]

