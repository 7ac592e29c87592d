"""Describe published versions and verify a local checkpoint against them (for the CLI).

A source dir may be a bucket URL: each function then runs on a read-only local view of the
bucket (``storage.view.BucketView``) holding what it reads: the indexes, the shard headers its
digests and tables come from, and the whole shards whose payloads it reads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, cast

import msgspec
import numpy as np

from .codecs import DensityCodec, get_codec
from .errors import (
    ChainBrokenError,
    CorruptArtifactError,
    InvalidRequestError,
    LocalFileDamagedError,
    MalformedHeaderError,
    SourceNotReadyError,
    VersionMissingError,
    WeightSyncError,
)
from .format.checksum import digest
from .format.layout import list_anchors, list_versions, version_dir_name
from .format.manifest import VersionIndex, check_anchor, checkpoint_weight_files, read_version_index
from .format.safetensors_io import DTYPE_NBYTES, TensorEntry, local_tensor_table, read_header, read_range
from .storage.url import is_bucket_url


@contextmanager
def _bucket_view(url: str, headers_upto: "int | None" = None):
    """A loaded view of the bucket ``url``, removed on exit; typed errors name the URL."""
    from .storage.view import BucketView

    view = BucketView(url)
    try:
        view.load(headers_upto)
        with view.errors_named():
            yield view
    finally:
        view.close()


class TensorSummary(msgspec.Struct):
    name: str
    shard: str
    payload_nbytes: int
    tensor_nbytes: int | None = None
    changed_elements: int | None = None
    changed_bytes: int | None = None
    tensor_elements: int | None = None


class VersionSummary(msgspec.Struct):
    version: int
    kind: str
    status: str  # "published" or why not
    base_version: int | None = None
    delta_encoding: str | None = None
    checksum_format: str | None = None
    tensors: int = 0
    wire_nbytes: int = 0
    tensor_nbytes: int | None = None
    changed_bytes: int | None = None
    changed_elements: int | None = None
    tensor_elements: int | None = None
    tensor_details: list[TensorSummary] = []
    note: str = ""

    @property
    def density(self) -> float | None:
        """Changed elements per element where known, else changed bytes per byte."""
        if self.changed_elements is not None and self.tensor_elements:
            return self.changed_elements / self.tensor_elements
        if self.changed_bytes is None or not self.tensor_nbytes:
            return None
        return self.changed_bytes / self.tensor_nbytes


def _shard_sizes(index: VersionIndex) -> int:
    total = 0
    for fname in set(index.weight_map.values()):
        try:
            total += os.path.getsize(os.path.join(index.path, fname))
        except OSError:
            pass
    return total


def reference_entries(source_dir: str, version: int, seed_dir: str | None) -> dict[str, TensorEntry]:
    """Dtype and length of each tensor, from the newest full version at or below ``version``,
    else the seed dir (dtype and shape never change between versions); empty when neither."""
    v = version
    while v > 0:
        try:
            idx = read_version_index(source_dir, v)
        except WeightSyncError:
            break
        if idx.kind == "full":
            return {n: e for n, (_, e) in local_tensor_table(idx.path, sorted(set(idx.weight_map.values()))).items()}
        v -= 1
    if seed_dir:
        return {n: e for n, (_, e) in local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir)).items()}
    return {}


def _sum(values: list[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def describe_version(
    source_dir: str, version: int, *, details: bool = False, density: bool = False, seed_dir: str | None = None
) -> VersionSummary:
    """One version's summary; with ``density``, each codec counts the changes of its payloads
    (``codecs.DensityCodec``), helped by a reference checkpoint for element widths."""
    if is_bucket_url(source_dir):
        with _bucket_view(source_dir, version if (details or density) else None) as view:
            if density:  # the payloads are read: the version's shards whole
                view.fetch_dir(os.path.join(view.root, version_dir_name(version)))
            return describe_version(view.root, version, details=details, density=density, seed_dir=seed_dir)
    try:
        index = read_version_index(source_dir, version)
    except WeightSyncError as e:
        return VersionSummary(version, "?", f"{type(e).__name__}: {e}")
    s = VersionSummary(
        version, index.kind, "published", index.base_version, index.delta_encoding, index.checksum_format,
        len(index.weight_map), _shard_sizes(index),
    )
    if not (details or density) or index.kind != "delta":
        if index.kind == "full":
            s.tensor_nbytes = s.wire_nbytes
        return s
    codec = cast(DensityCodec, get_codec(index.delta_encoding or ""))
    reference = reference_entries(source_dir, version - 1, seed_dir) if density else {}
    for fname in sorted(set(index.weight_map.values())):
        path = os.path.join(index.path, fname)
        hdr = read_header(path)
        with open(path, "rb") as f:  # read with pread, not mapped: a shard cut short is a typed error
            for name, entry in sorted(hdr.tensors.items()):
                t = TensorSummary(name, fname, entry.nbytes)
                if density:
                    ref = reference.get(name)
                    payload = read_range(f.fileno(), entry.offset, entry.nbytes, path)
                    d = codec.density(payload, ref.nbytes if ref else None, DTYPE_NBYTES[ref.dtype] if ref else None, name)
                    t.tensor_nbytes, t.tensor_elements, t.changed_elements, t.changed_bytes = d
                s.tensor_details.append(t)
    if density:
        s.tensor_nbytes = _sum([t.tensor_nbytes for t in s.tensor_details])
        s.tensor_elements = _sum([t.tensor_elements for t in s.tensor_details])
        s.changed_elements = _sum([t.changed_elements for t in s.tensor_details])
        s.changed_bytes = _sum([t.changed_bytes for t in s.tensor_details])
        if s.changed_elements is None and s.tensors:
            s.note = (
                "element counts need each tensor's dtype: pass --seed-dir (or publish a full version) "
                f"so {index.delta_encoding} payloads can be read per element"
            )
    if not details:
        s.tensor_details = []
    return s


def describe_source(source_dir: str) -> list[VersionSummary]:
    from .puller.pull import check_source_dir

    if is_bucket_url(source_dir):
        with _bucket_view(source_dir) as view:
            return describe_source(view.root)
    check_source_dir(source_dir)  # a wrong path is an error, never an empty table
    return [describe_version(source_dir, v) for v in list_versions(source_dir)]


def check_version_there(source_dir: str, version: int) -> None:
    """Raise the typed error of a version that is not there (a wrong source dir, a pruned
    version, one not published yet), as a pull would; a version that is there returns."""
    from .puller.pull import _read_target_index, check_source_dir

    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidRequestError(f"version must be an integer >= 1 (version 0 is the seed dir, never published), got {version!r}")
    if is_bucket_url(source_dir):
        with _bucket_view(source_dir) as view:
            return check_version_there(view.root, version)
    check_source_dir(source_dir)
    try:
        _read_target_index(source_dir, version)
    except CorruptArtifactError:
        return  # there, but bad: the summary's status says why


class VerifyReport(msgspec.Struct):
    version: int
    checked: int
    mismatched: list[tuple[str, str, str]]  # name, expected, actual
    unchecked: list[str]  # tensors whose expected bytes are unknown (no anchor and no seed dir)
    missing: list[str] = []  # tensors the version has that the local checkpoint lacks
    # How the local headers differ from the model's layout (a dtype or shape changed in a
    # header: same bytes, other weights), by tensor; empty when they agree or were not checked.
    layout_mismatched: list[str] = []
    layout_checked: bool = False  # False: no reference layout (pass --seed-dir)

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.missing and not self.layout_mismatched


def expected_digests(source_dir: str, version: int, seed_dir: str | None, checksum_format: str = "xxh3-128") -> tuple[dict[str, tuple[str, str]], str | None]:
    """(name -> (checksum format, digest), base dir): what each tensor at ``version`` must hash
    to, walking down the chain (newest digest first) to the newest side anchor bound to its
    version (its index holds every tensor's digest: no base dir), else to the newest full
    version (its digests when ours wrote it, else its bytes, hashed) or the seed dir (version 0). Pruning keeps exactly that
    walk: nothing below the newest anchor point a pull needs is deleted, so ``verify`` works
    on a pruned source dir. A version missing above any such start: ``ChainBrokenError``."""
    out: dict[str, tuple[str, str]] = {}
    anchors = set(list_anchors(source_dir))
    v = version
    base_dir = seed_dir
    while v > 0:
        try:
            idx = read_version_index(source_dir, v)
        except VersionMissingError as e:
            raise ChainBrokenError(v, version, e.path) from None
        if idx.kind == "full":
            if idx.digests is not None:  # ours: the digests of its published bytes
                for n, d in idx.digests.items():
                    out.setdefault(n, (idx.checksum_format or checksum_format, d))
                return out, None
            base_dir = idx.path  # an upstream full version: its bytes are the reference
            break
        for fname, names in idx.shards().items():
            try:
                hdr = read_header(os.path.join(idx.path, fname))
            except FileNotFoundError:
                raise SourceNotReadyError(f"v{v}'s shard {fname} vanished while verify read it (pruned meanwhile?); run verify again") from None
            for n in names:
                out.setdefault(n, (idx.checksum_format or checksum_format, hdr.metadata.get(n, "")))
        if v in anchors:
            check = check_anchor(source_dir, v, idx)
            if check.state == "bound" and check.index is not None and check.index.digests is not None:
                fmt = check.index.checksum_format or checksum_format
                for n, d in check.index.digests.items():
                    out.setdefault(n, (fmt, d))
                return out, None
        v -= 1
    return out, base_dir


def verify_local(
    local_checkpoint_dir: str,
    source_dir: str,
    version: int,
    seed_dir: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Hash every local tensor and compare with what ``version`` says it must be. A tensor the
    version has (changed by its chain, or in its full version or seed dir) that the local
    checkpoint lacks fails the check by name. The local headers are checked against the
    model's layout (the seed dir's, else an upstream full version's), since a digest covers a
    tensor's bytes, never its dtype or shape. A local file that cannot be read (a header cut
    short or damaged) is a local fault (``LocalFileDamagedError``), not the artifact's. A
    version that is not there is told as a pull tells it (a wrong dir, pruned, not yet)."""
    if is_bucket_url(source_dir):
        if version > 0:
            check_version_there(source_dir, version)
        with _bucket_view(source_dir, version) as view:  # the chain's digests live in headers
            _, base_dir = expected_digests(view.root, version, seed_dir)
            if base_dir is not None and base_dir != seed_dir:  # an upstream full version: its bytes are hashed
                view.fetch_dir(base_dir)
            return verify_local(local_checkpoint_dir, view.root, version, seed_dir, progress)
    if version > 0:
        check_version_there(source_dir, version)
    local = _local_table(local_checkpoint_dir)
    want, base_dir = expected_digests(source_dir, version, seed_dir)
    base = local_tensor_table(base_dir, checkpoint_weight_files(base_dir)) if base_dir else {}
    layout_ref = base if base_dir else {}
    if seed_dir and not _layout_changed(source_dir, version):
        layout_ref = local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir)) if base_dir != seed_dir else base
    missing = sorted((want.keys() | base.keys()) - local.keys())
    mismatched, unchecked = [], []
    checked = 0
    names = sorted(local)
    for i, name in enumerate(names):
        path, e = local[name]
        if name in want:
            fmt, expected = want[name]
        elif name in base:
            fmt = "xxh3-128"
            bpath, be = base[name]
            expected = digest(fmt, np.fromfile(bpath, np.uint8, count=be.nbytes, offset=be.offset))
        else:
            unchecked.append(name)
            continue
        actual = digest(fmt, np.fromfile(path, np.uint8, count=e.nbytes, offset=e.offset))
        checked += 1
        if actual != expected:
            mismatched.append((name, expected, actual))
        if progress:
            progress(i + 1, len(names))
    reference = {n: (e.dtype, e.shape) for n, (_, e) in layout_ref.items()}
    if not reference and not _layout_changed(source_dir, version):
        reference = _recorded_seed_layout(source_dir)
    from .puller.pull import diff_layouts

    local_layout = {n: (e.dtype, e.shape) for n, (_, e) in local.items()}
    recorded = _recorded_layout_at(source_dir, version)
    layout_bad: list[str] = []
    # The layout the version's own full index or anchor records binds every header (ours);
    # the model's (seed dir, or the run's record) holds unless the layout changed since.
    for ref in (recorded, reference):
        for d in diff_layouts(local_layout, ref) if ref else []:
            if not d.startswith("lacks tensors") and d not in layout_bad:  # missing ones: reported as missing
                layout_bad.append(d)
    checked_layout = bool(reference) or recorded is not None
    return VerifyReport(version, checked, mismatched, unchecked, missing, layout_bad, checked_layout)


def _recorded_layout_at(source_dir: str, version: int) -> "dict[str, tuple[str, tuple[int, ...]]] | None":
    """The layout recorded by the newest full version or bound side anchor at or below
    ``version`` (deltas never change a layout), or None when that index records none."""
    anchors = set(list_anchors(source_dir))
    v = version
    while v > 0:
        try:
            idx = read_version_index(source_dir, v)
        except WeightSyncError:
            return None
        if idx.kind == "full":
            return idx.layout
        if v in anchors:
            check = check_anchor(source_dir, v, idx)
            if check.state == "bound" and check.index is not None:
                return check.index.layout
        v -= 1
    return None


def _recorded_seed_layout(source_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The seed's layout as the run file records it (our publisher writes it with v1), or {}."""
    from .publisher.records import read_seed_record

    try:
        record = read_seed_record(source_dir)
    except (OSError, ValueError, RecursionError, WeightSyncError):
        return {}
    if record is None or not record.layout:
        return {}
    return {n: (d, tuple(s)) for n, (d, s) in record.layout.items()}


def _local_table(local_checkpoint_dir: str) -> dict[str, tuple[str, TensorEntry]]:
    """The local checkpoint's tensors; a file of it that cannot be read is a local fault."""
    if not os.path.isdir(local_checkpoint_dir):
        raise InvalidRequestError(f"the local checkpoint dir {local_checkpoint_dir} is not a directory")
    try:
        return local_tensor_table(local_checkpoint_dir, checkpoint_weight_files(local_checkpoint_dir))
    except MalformedHeaderError as e:
        raise LocalFileDamagedError(e.path, e.detail) from None
    except CorruptArtifactError as e:
        raise LocalFileDamagedError(local_checkpoint_dir, str(e)) from None
    except FileNotFoundError as e:
        raise LocalFileDamagedError(local_checkpoint_dir, f"a file is missing: {e}") from None


def _layout_changed(source_dir: str, version: int) -> bool:
    """Whether a full version at or below ``version`` (down to the newest one) was published
    with --allow-layout-change: the seed dir's layout is then not the reference."""
    from .puller.plan import allows_layout_change

    v = version
    while v > 0:
        try:
            idx = read_version_index(source_dir, v)
        except WeightSyncError:
            return False
        if allows_layout_change(idx):
            return True
        if idx.kind == "full":
            return False
        v -= 1
    return False
