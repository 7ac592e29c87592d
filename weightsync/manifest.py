"""The version index and the applied-version marker, as typed structs.

A version dir's ``model.safetensors.index.json`` is the publication boundary: a version exists
once its index does. Its ``metadata`` tells a delta (``delta_encoding`` present) from a full
version. Readers accept integer strings of any width (and JSON integers) for versions, reject
what they do not know, and name what they support.
"""

from __future__ import annotations

import json
import os
import re
from typing import Literal

import msgspec

from . import knobs
from .checksum import supported_checksums
from .errors import (
    CorruptArtifactError,
    IndexMissingError,
    MalformedHeaderError,
    UnsupportedFormatError,
    VersionMissingError,
)
from .layout import INDEX_NAME, SINGLE_FILE_NAME, checked_file_name, format_version, index_path, version_dir

SUPPORTED_COMPRESSION = ("zstd",)
VersionKind = Literal["delta", "full"]


class VersionIndex(msgspec.Struct, frozen=True):
    version: int
    kind: VersionKind
    path: str  # the version dir
    weight_map: dict[str, str]  # tensor name -> shard file name
    base_version: int | None = None
    delta_encoding: str | None = None
    compression_format: str | None = None
    checksum_format: str | None = None
    metadata: dict[str, str] = {}

    def shards(self) -> dict[str, set[str]]:
        """shard file -> tensor names, as the index maps them."""
        out: dict[str, set[str]] = {}
        for name, fname in self.weight_map.items():
            out.setdefault(fname, set()).add(name)
        return out


_INTEGER_STRING = re.compile(r"\+?[0-9]+")


def parse_version_number(value: object, field: str, path: str) -> int:
    if isinstance(value, bool):
        raise MalformedHeaderError(path, f"metadata {field} must be an integer string, got {value!r}")
    if isinstance(value, int):
        v = value
    elif isinstance(value, str) and _INTEGER_STRING.fullmatch(value.strip()):
        # ASCII digits after at most one '+': str.isdigit() is also true of '³', and int()
        # refuses '++5' and reads '1_000' as 1000.
        v = int(value)
    else:
        raise MalformedHeaderError(path, f"metadata {field} must be an integer string, got {value!r}")
    if v < 0:
        raise MalformedHeaderError(path, f"metadata {field} must be >= 0, got {v}")
    return v


def _load_index_json(path: str) -> dict:
    limit = int(knobs.MAX_INDEX_NBYTES.get())
    size = os.path.getsize(path)
    if size > limit:
        raise MalformedHeaderError(path, f"index is {size} bytes, over the {limit}-byte limit")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedHeaderError(path, f"index is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "index is not a JSON object")
    return obj


def read_version_index(source_dir: str, version: int) -> VersionIndex:
    """The index of one published version; typed errors for missing, unready or malformed ones."""
    vdir = version_dir(source_dir, version)
    if not os.path.isdir(vdir):
        raise VersionMissingError(version, vdir)
    ipath = index_path(vdir)
    try:
        obj = _load_index_json(ipath)
    except FileNotFoundError:
        return _read_indexless_full(vdir, version)
    meta = obj.get("metadata") or {}
    wmap = obj.get("weight_map")
    if not isinstance(meta, dict):
        raise MalformedHeaderError(ipath, "metadata must be an object")
    if not isinstance(wmap, dict):
        raise MalformedHeaderError(ipath, "weight_map must be an object of tensor name -> shard file")
    for name, fname in wmap.items():
        checked_file_name(fname, f"{ipath} weight_map[{name!r}]")
    str_meta = {str(k): str(v) for k, v in meta.items()}
    if "delta_encoding" not in meta:
        if "version" in meta:
            declared = parse_version_number(meta["version"], "version", ipath)
            if declared != version:
                raise CorruptArtifactError(f"{ipath} declares version {declared} but lives in the dir of version {version}")
        return VersionIndex(version, "full", vdir, dict(wmap), metadata=str_meta)
    declared = parse_version_number(meta.get("version"), "version", ipath)
    base = parse_version_number(meta.get("base_version"), "base_version", ipath)
    if declared != version:
        raise CorruptArtifactError(f"{ipath} declares version {declared} but lives in the dir of version {version}")
    if base != version - 1:
        raise CorruptArtifactError(
            f"{ipath}: a delta's base_version must be version - 1 = {version - 1}, got {base}"
        )
    from .codecs import supported_encodings  # lazy: codecs import manifest-level helpers

    encoding = meta["delta_encoding"]
    if encoding not in supported_encodings():
        raise UnsupportedFormatError("delta_encoding", encoding, supported_encodings())
    compression = meta.get("compression_format", "zstd")
    if compression not in SUPPORTED_COMPRESSION:
        raise UnsupportedFormatError("compression_format", compression, list(SUPPORTED_COMPRESSION))
    checksum = meta.get("checksum_format", "xxh3-128")
    if checksum not in supported_checksums():
        raise UnsupportedFormatError("checksum_format", checksum, supported_checksums())
    return VersionIndex(
        version,
        "delta",
        vdir,
        dict(wmap),
        base_version=base,
        delta_encoding=encoding,
        compression_format=compression,
        checksum_format=checksum,
        metadata=str_meta,
    )


def _read_indexless_full(vdir: str, version: int) -> VersionIndex:
    """An index-less dir is a full version only if it is a complete single-file checkpoint."""
    from .safetensors_io import read_header

    weight_files = sorted(n for n in os.listdir(vdir) if n.endswith(".safetensors"))
    if weight_files != [SINGLE_FILE_NAME]:
        raise IndexMissingError(
            version, vdir, f"found {weight_files[:5]}; an index-less full version holds exactly {SINGLE_FILE_NAME}"
        )
    try:
        hdr = read_header(os.path.join(vdir, SINGLE_FILE_NAME))
    except MalformedHeaderError as e:
        # A single file still being copied looks truncated: that is "not ready", not corrupt.
        raise IndexMissingError(version, vdir, f"{SINGLE_FILE_NAME} is not complete: {e.detail}") from None
    end = max((t.offset + t.nbytes for t in hdr.tensors.values()), default=hdr.data_offset)
    if end != hdr.file_nbytes:
        raise IndexMissingError(version, vdir, f"{SINGLE_FILE_NAME} has {hdr.file_nbytes - end} bytes past its last tensor")
    return VersionIndex(version, "full", vdir, {n: SINGLE_FILE_NAME for n in hdr.tensors})


def build_delta_index(
    version: int, encoding: str, checksum_format: str, weight_map: dict[str, str], extra: dict[str, str] | None = None
) -> bytes:
    meta = {
        "version": format_version(version),
        "base_version": format_version(version - 1),
        "delta_encoding": encoding,
        "compression_format": "zstd",
        "checksum_format": checksum_format,
    }
    meta.update(extra or {})
    return json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=1).encode()


def build_full_index(version: int, weight_map: dict[str, str], total_size: int) -> bytes:
    meta = {"version": format_version(version), "total_size": str(total_size)}
    return json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=1).encode()


def checkpoint_weight_files(checkpoint_dir: str) -> list[str]:
    """The safetensors files of an HF checkpoint: those its index names, else model.safetensors."""
    ipath = index_path(checkpoint_dir)
    if os.path.exists(ipath):
        wmap = _load_index_json(ipath).get("weight_map") or {}
        if not isinstance(wmap, dict):
            raise MalformedHeaderError(ipath, "weight_map must be an object")
        return sorted({checked_file_name(f, f"{ipath} weight_map") for f in wmap.values()})
    if os.path.exists(os.path.join(checkpoint_dir, SINGLE_FILE_NAME)):
        return [SINGLE_FILE_NAME]
    raise FileNotFoundError(
        f"{checkpoint_dir} is not an HF safetensors checkpoint (no {INDEX_NAME}, no {SINGLE_FILE_NAME})"
    )


# --- the applied-version marker -----------------------------------------------------------


class AppliedState(msgspec.Struct, frozen=True):
    """``.weight_sync/state.json``. ``version`` is the only field upstream readers need; the
    source dir lets a pull refuse to chain deltas of one source onto the state of another."""

    version: str
    source_dir: str | None = None


def read_applied_state(path: str) -> AppliedState | None:
    """The marker, or None when it is absent or unreadable (both mean: state unknown)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        obj = json.loads(raw)
        state = AppliedState(version=str(obj["version"]), source_dir=obj.get("source_dir"))
        if parse_version_number(state.version, "version", path) < 0:
            return None
        return state
    except (OSError, ValueError, KeyError, TypeError, MalformedHeaderError):
        return None


def encode_applied_state(version: int, source_dir: str | None) -> bytes:
    obj: dict[str, str] = {"version": format_version(version)}
    if source_dir is not None:
        obj["source_dir"] = source_dir
    return json.dumps(obj).encode()


__all__ = [
    "VersionIndex",
    "AppliedState",
    "read_version_index",
    "read_applied_state",
    "encode_applied_state",
    "build_delta_index",
    "build_full_index",
    "INDEX_NAME",
]
