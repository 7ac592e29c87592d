"""Describe published versions and verify a local checkpoint against them (for the CLI)."""

from __future__ import annotations

import os
from typing import Callable

import msgspec
import numpy as np

from .checksum import digest

from .errors import WeightSyncError
from .layout import list_versions
from .manifest import VersionIndex, checkpoint_weight_files, read_version_index
from .safetensors_io import local_tensor_table, read_header
from .zstd_frames import decompress_exact, frame_nbytes


class TensorSummary(msgspec.Struct):
    name: str
    shard: str
    payload_nbytes: int
    tensor_nbytes: int | None = None
    changed_bytes: int | None = None


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
    tensor_details: list[TensorSummary] = []

    @property
    def density(self) -> float | None:
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


def _changed_bytes(encoding: str, payload, nbytes: int, tensor: str) -> int | None:
    if encoding == "xor":
        d = np.frombuffer(decompress_exact(payload, nbytes, tensor), np.uint8)
        return int(np.count_nonzero(d))
    if encoding == "overwrite":
        _, content = frame_nbytes(payload, tensor)
        return (content - 4) // 5
    return None


def describe_version(source_dir: str, version: int, *, details: bool = False, density: bool = False) -> VersionSummary:
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
    tensor_total, changed_total = 0, 0
    for fname in sorted(set(index.weight_map.values())):
        path = os.path.join(index.path, fname)
        hdr = read_header(path)
        with open(path, "rb") as f:
            blob = f.read()
        for name, entry in sorted(hdr.tensors.items()):
            payload = memoryview(blob)[entry.offset : entry.offset + entry.nbytes]
            _, content = frame_nbytes(payload, name) if index.delta_encoding in ("xor", "overwrite") else (0, None)
            tnb = content if index.delta_encoding == "xor" else None
            changed = _changed_bytes(index.delta_encoding or "", payload, content or 0, name) if density else None
            s.tensor_details.append(TensorSummary(name, fname, entry.nbytes, tnb, changed))
            if tnb is not None:
                tensor_total += tnb
            if changed is not None:
                changed_total += changed
    if index.delta_encoding == "xor":
        s.tensor_nbytes = tensor_total
        s.changed_bytes = changed_total if density else None
    if not details:
        s.tensor_details = []
    return s


def describe_source(source_dir: str) -> list[VersionSummary]:
    return [describe_version(source_dir, v) for v in list_versions(source_dir)]


class VerifyReport(msgspec.Struct):
    version: int
    checked: int
    mismatched: list[tuple[str, str, str]]  # name, expected, actual
    unchecked: list[str]  # tensors whose expected bytes are unknown (no anchor and no seed dir)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def expected_digests(source_dir: str, version: int, seed_dir: str | None, checksum_format: str = "xxh3-128") -> tuple[dict[str, tuple[str, str]], str | None]:
    """name -> (checksum format, digest) of every tensor at ``version``, walking down the chain
    to the newest full version (whose bytes are hashed) or to the seed dir (version 0)."""
    out: dict[str, tuple[str, str]] = {}
    v = version
    base_dir = seed_dir
    while v > 0:
        idx = read_version_index(source_dir, v)
        if idx.kind == "full":
            base_dir = idx.path
            break
        for fname, names in idx.shards().items():
            hdr = read_header(os.path.join(idx.path, fname))
            for n in names:
                out.setdefault(n, (idx.checksum_format or checksum_format, hdr.metadata.get(n, "")))
        v -= 1
    return out, base_dir


def verify_local(
    local_checkpoint_dir: str,
    source_dir: str,
    version: int,
    seed_dir: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Hash every local tensor and compare with what ``version`` says it must be."""
    local = local_tensor_table(local_checkpoint_dir, checkpoint_weight_files(local_checkpoint_dir))
    want, base_dir = expected_digests(source_dir, version, seed_dir)
    base = local_tensor_table(base_dir, checkpoint_weight_files(base_dir)) if base_dir else {}
    mismatched, unchecked = [], []
    checked = 0
    names = sorted(local)
    for i, name in enumerate(names):
        path, e = local[name]
        data = np.fromfile(path, np.uint8, count=e.nbytes, offset=e.offset)
        if name in want:
            fmt, expected = want[name]
        elif name in base:
            fmt = "xxh3-128"
            bpath, be = base[name]
            expected = digest(fmt, np.fromfile(bpath, np.uint8, count=be.nbytes, offset=be.offset))
        else:
            unchecked.append(name)
            continue
        actual = digest(fmt, data)
        checked += 1
        if actual != expected:
            mismatched.append((name, expected, actual))
        if progress:
            progress(i + 1, len(names))
    return VerifyReport(version, checked, mismatched, unchecked)



