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

from .. import knobs
from ..codecs import supported_encodings
from ..errors import (
    CorruptArtifactError,
    IndexMissingError,
    MalformedHeaderError,
    SourceNotReadyError,
    UnsupportedFormatError,
    VersionMissingError,
)
from .checksum import supported_checksums
from .layout import (
    INDEX_NAME,
    SINGLE_FILE_NAME,
    anchor_dir,
    checked_file_name,
    format_version,
    index_path,
    version_dir,
)

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
    # The side-anchor binding (FORMAT.md "Side anchors"): the commit id both indexes carry, and
    # in an anchor's index the digest of each tensor's bytes. None: an index without them (an
    # older publisher's, or a version that has no anchor), which binds no anchor.
    anchor_commit: str | None = None
    digests: dict[str, str] | None = None
    # A full version's or an anchor's recorded layout (ours): tensor -> (dtype, shape) as its
    # shards' headers had them when written. A digest covers a tensor's bytes, never its
    # header; a seed and verify check the headers against this. None: not recorded.
    layout: "dict[str, tuple[str, tuple[int, ...]]] | None" = None

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


class TruncatedIndex(Exception):
    """The index ends before its JSON does: a file still being written (no atomic rename)."""


def _ends_mid_json(raw: bytes) -> bool:
    """True when ``raw`` is empty or a proper prefix of some JSON text: every error is at the end.

    A publisher without rename writes the index in place, so a reader can see any prefix of
    it. A prefix of one JSON object always fails to parse at its end (or mid-character at its
    end), never earlier; a byte that is wrong in the middle is corruption.
    """
    text_end = len(raw.rstrip())
    if text_end == 0:
        return True
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data" and e.end >= text_end
    try:
        json.loads(text)
    except RecursionError:
        return False  # nested too deeply to parse: complete but malformed
    except json.JSONDecodeError as e:
        # A string cut off by the end of the file is reported at its opening quote.
        # (and an escape cut short, at its backslash).
        if e.msg.startswith("Invalid \\uXXXX escape"):
            return e.pos + len("\\uXXXX") >= len(text)
        return e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
    return False


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
        if _ends_mid_json(raw):
            raise TruncatedIndex(f"{len(raw)} bytes that end mid-JSON") from None
        raise MalformedHeaderError(path, f"index is not valid JSON ({e})") from None
    except RecursionError:
        # A small index can nest deeper than the interpreter recurses (a RecursionError would
        # escape every typed handler): it is complete and malformed.
        raise MalformedHeaderError(path, "index nests too deeply to be an index") from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "index is not a JSON object")
    return obj


def is_committed(directory: str) -> bool:
    """A version (or anchor) dir whose index is complete: what a publisher must not rewrite.

    An index that is absent or still being written (a prefix of its JSON) does not count, so a
    publisher restarted after a crash mid-index can write that version again.
    """
    try:
        _load_index_json(index_path(directory))
    except (FileNotFoundError, TruncatedIndex):
        return False
    except MalformedHeaderError:
        return True  # complete but bad: never overwrite what a reader may have judged
    return True


def read_version_index(source_dir: str, version: int) -> VersionIndex:
    """The index of one published version; typed errors for missing, unready or malformed ones."""
    vdir = version_dir(source_dir, version)
    if not os.path.isdir(vdir):
        raise VersionMissingError(version, vdir)
    ipath = index_path(vdir)
    try:
        obj = _load_index_json(ipath)
    except FileNotFoundError:
        try:
            return _read_indexless_full(vdir, version)
        except IndexMissingError:
            raise
        except FileNotFoundError:
            # The dir went away after the isdir above (pruned meanwhile): as if never seen.
            if os.path.isdir(vdir):
                raise IndexMissingError(version, vdir, "a file vanished while it was read") from None
            raise VersionMissingError(version, vdir) from None
    except TruncatedIndex as e:
        raise IndexMissingError(version, vdir, f"the index holds {e}: still being written") from None
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
        digests, checksum = _full_digests(obj, meta, wmap, ipath)
        return VersionIndex(version, "full", vdir, dict(wmap), checksum_format=checksum, metadata=str_meta,
                            anchor_commit=_anchor_commit(meta, ipath), digests=digests,
                            layout=_recorded_layout(obj, wmap, ipath))
    declared = parse_version_number(meta.get("version"), "version", ipath)
    base = parse_version_number(meta.get("base_version"), "base_version", ipath)
    if declared != version:
        raise CorruptArtifactError(f"{ipath} declares version {declared} but lives in the dir of version {version}")
    if base != version - 1:
        raise CorruptArtifactError(
            f"{ipath}: a delta's base_version must be version - 1 = {version - 1}, got {base}"
        )
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
        anchor_commit=_anchor_commit(meta, ipath),
    )


ANCHOR_COMMIT_KEY = "anchor_commit"
ANCHOR_DIGESTS_KEY = "digests"
_COMMIT_ID = re.compile(r"[0-9a-f]{32}")


def _anchor_commit(meta: dict, ipath: str) -> str | None:
    """The commit id that binds a side anchor to this index, or None when it names none.

    A malformed value binds nothing rather than failing the version: the version's own bytes
    are verified by the chain, and only the anchor needs the binding.
    """
    value = meta.get(ANCHOR_COMMIT_KEY)
    return value if isinstance(value, str) and _COMMIT_ID.fullmatch(value) else None


def anchor_commit_of(version: int, checksum_format: str, digests: dict[str, str]) -> str:
    """The commit id binding a side anchor to its version: the xxh3-128 of the version number,
    the checksum format and every tensor's digest of the version's bytes (sorted by name).

    Derived from the bytes, not drawn at random: an earlier attempt's anchor matches a version
    republished with other bytes (or without an anchor) never, and one with the same bytes
    only when it holds exactly those bytes (its seed is checked against the digests); a retried
    commit writes byte-identical indexes. A reader recomputes it from the anchor's digests, so
    damage to those digests shows at plan time.
    """
    import xxhash

    text = json.dumps([format_version(version), checksum_format, sorted(digests.items())], separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def read_anchor_index(source_dir: str, version: int) -> VersionIndex:
    """The index of a side anchor (``anchor_vNNNNNN/``): a full checkpoint of ``version``.

    Raises SourceNotReadyError (absent, or its index not complete yet) or CorruptArtifactError.
    """
    adir = anchor_dir(source_dir, version)
    ipath = index_path(adir)
    try:
        obj = _load_index_json(ipath)
    except FileNotFoundError:
        raise IndexMissingError(version, adir, "side anchor without an index") from None
    except TruncatedIndex as e:
        raise IndexMissingError(version, adir, f"the anchor index holds {e}: still being written") from None
    meta, wmap = obj.get("metadata"), obj.get("weight_map")
    if not isinstance(meta, dict) or not isinstance(wmap, dict) or "delta_encoding" in meta:
        raise MalformedHeaderError(ipath, "an anchor index is a full HF index: metadata and weight_map objects")
    for name, fname in wmap.items():
        checked_file_name(fname, f"{ipath} weight_map[{name!r}]")
    declared = parse_version_number(meta.get("version"), "version", ipath)
    if declared != version:
        raise CorruptArtifactError(f"{ipath} declares version {declared} but lives in the dir of anchor {version}")
    commit, digests, checksum = _anchor_binding(obj, meta, wmap, ipath, version)
    return VersionIndex(
        version, "full", adir, dict(wmap), checksum_format=checksum,
        metadata={str(k): str(v) for k, v in meta.items() if k != ANCHOR_DIGESTS_KEY},
        anchor_commit=commit, digests=digests, layout=_recorded_layout(obj, wmap, ipath),
    )


def _checked_digests(raw: object, checksum: object, wmap: dict, ipath: str) -> dict[str, str]:
    """``digests`` of an index: a well-formed digest for exactly the tensors of its weight map."""
    from .checksum import is_well_formed_digest

    if not isinstance(raw, dict):
        raise MalformedHeaderError(ipath, f"{ANCHOR_DIGESTS_KEY} must be an object of tensor name -> digest")
    if checksum not in supported_checksums():
        raise UnsupportedFormatError("checksum_format", checksum, supported_checksums())
    if set(raw) != set(wmap):
        raise MalformedHeaderError(ipath, f"{ANCHOR_DIGESTS_KEY} must name exactly the tensors of weight_map "
                                          f"(missing {sorted(set(wmap) - set(raw))[:5]}, extra {sorted(set(raw) - set(wmap))[:5]})")
    bad = [n for n, d in raw.items() if not is_well_formed_digest(str(checksum), d)]
    if bad:
        raise MalformedHeaderError(ipath, f"{ANCHOR_DIGESTS_KEY} of {bad[:5]} are not well-formed {checksum} digests")
    return dict(raw)


LAYOUT_KEY = "layout"


def _recorded_layout(obj: dict, wmap: dict, ipath: str) -> "dict[str, tuple[str, tuple[int, ...]]] | None":
    """``layout`` of a full or anchor index: ``{name: [dtype, [dims...]]}`` for exactly the
    tensors of its weight map, or None when absent (an upstream writer's, an older publisher's)."""
    from .safetensors_io import DTYPE_NBYTES

    raw = obj.get(LAYOUT_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != set(wmap):
        raise MalformedHeaderError(ipath, f"{LAYOUT_KEY} must map exactly the tensors of weight_map to [dtype, shape]")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in raw.items():
        ok = (isinstance(entry, list) and len(entry) == 2 and entry[0] in DTYPE_NBYTES and isinstance(entry[1], list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1]))
        if not ok:
            raise MalformedHeaderError(ipath, f"{LAYOUT_KEY} of {name!r} is not [dtype, shape]: {str(entry)[:80]}")
        out[name] = (entry[0], tuple(entry[1]))
    return out


def layout_of_shards(directory: str, weight_map: dict[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor -> (dtype, shape) from the headers of the shards ``weight_map`` names in
    ``directory``: what a publisher records in a full or anchor index right after writing them."""
    from .safetensors_io import local_tensor_table

    table = local_tensor_table(directory, sorted(set(weight_map.values())))
    return {n: (e.dtype, e.shape) for n, (_, e) in table.items() if n in weight_map}


def _layout_json(layout: "dict[str, tuple[str, tuple[int, ...]]]") -> dict[str, list]:
    return {n: [d, list(s)] for n, (d, s) in sorted(layout.items())}


def _full_digests(obj: dict, meta: dict, wmap: dict, ipath: str) -> tuple[dict[str, str] | None, str | None]:
    """(digests, checksum format) of a full version's index: ours names each tensor's digest,
    an upstream writer's none (then nothing checks a seed from it beyond its headers)."""
    raw = obj.get(ANCHOR_DIGESTS_KEY)
    if raw is None:
        return None, None
    checksum = meta.get("checksum_format", "xxh3-128")
    return _checked_digests(raw, checksum, wmap, ipath), str(checksum)


def _anchor_binding(
    obj: dict, meta: dict, wmap: dict, ipath: str, version: int,
) -> tuple[str | None, dict[str, str] | None, str | None]:
    """(commit id, digests, checksum format) of an anchor index; (None, None, None) for an
    index without a binding (an older publisher's). A binding that is there but wrong (digests
    that do not cover exactly the weight map, a malformed digest) is a damaged anchor."""
    commit = _anchor_commit(meta, ipath)
    raw = obj.get(ANCHOR_DIGESTS_KEY)
    if commit is None and raw is None:
        return None, None, None
    checksum = meta.get("checksum_format", "xxh3-128")
    if commit is None or not isinstance(raw, dict):
        raise MalformedHeaderError(ipath, f"an anchor index names both {ANCHOR_COMMIT_KEY} (32 hex digits) and {ANCHOR_DIGESTS_KEY}, or neither")
    raw = _checked_digests(raw, checksum, wmap, ipath)
    if anchor_commit_of(version, checksum, raw) != commit:
        raise MalformedHeaderError(ipath, f"{ANCHOR_COMMIT_KEY} is not the one its {ANCHOR_DIGESTS_KEY} give: the index is damaged")
    return commit, dict(raw), checksum


AnchorState = Literal["bound", "legacy", "orphan", "pending", "damaged"]


class AnchorCheck(msgspec.Struct, frozen=True):
    """What a side anchor is worth: ``bound`` (usable), or why not, with its index if read.

    - ``bound``: its index and its version's committed index name the same commit id, and its
      index holds a digest for every tensor;
    - ``legacy``: its index has no binding (an older publisher's). Never used: nothing proves
      its bytes are the published version's;
    - ``orphan``: its version is committed with another commit id, or none: an earlier
      attempt's anchor, dead for good (prune deletes it);
    - ``pending``: its own index, or its version's, is not complete: maybe a publish in flight;
    - ``damaged``: its index is complete but unreadable.
    """

    state: AnchorState
    why: str
    index: VersionIndex | None = None


def check_anchor(source_dir: str, version: int, version_index: VersionIndex | None = None) -> AnchorCheck:
    """Judge the side anchor of ``version`` against its version's index (read unless given)."""
    try:
        idx = read_anchor_index(source_dir, version)
    except IndexMissingError as e:
        # An anchor's index is committed before its version's (FORMAT.md): one that reads as
        # incomplete while its version is committed naming a commit id was complete once, and a
        # byte of it changed since (a prefix of JSON and a damaged index can look alike).
        if version_index is None:
            try:
                version_index = read_version_index(source_dir, version)
            except (CorruptArtifactError, SourceNotReadyError):
                return AnchorCheck("pending", str(e))
        if version_index.anchor_commit is not None and os.path.exists(index_path(anchor_dir(source_dir, version))):
            return AnchorCheck("damaged", "its index reads as incomplete JSON though its version, committed after it, "
                                          f"names its commit {version_index.anchor_commit}")
        return AnchorCheck("pending", str(e))
    except CorruptArtifactError as e:
        return AnchorCheck("damaged", str(e))
    if idx.anchor_commit is None:
        return AnchorCheck("legacy", "its index has no commit id and no digests (an older publisher's)", idx)
    if version_index is None:
        try:
            version_index = read_version_index(source_dir, version)
        except IndexMissingError as e:  # includes a version dir still being written
            return AnchorCheck("pending", f"its version is not committed: {e}", idx)
        except VersionMissingError:
            return AnchorCheck("pending", f"version {version} is not published", idx)
        except CorruptArtifactError as e:
            return AnchorCheck("damaged", f"its version's index is unreadable: {e}", idx)
    if version_index.anchor_commit != idx.anchor_commit:
        return AnchorCheck(
            "orphan", f"commit id {idx.anchor_commit} is not the committed version's ({version_index.anchor_commit})", idx
        )
    return AnchorCheck("bound", "", idx)


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


def build_anchor_index(
    version: int, weight_map: dict[str, str], total_size: int, commit: str, checksum_format: str, digests: dict[str, str],
    layout: "dict[str, tuple[str, tuple[int, ...]]] | None" = None,
) -> bytes:
    """A side anchor's index: an HF index plus its binding (the commit id its version's index
    names too, and the digest of every tensor's bytes), and with ``layout`` each tensor's dtype
    and shape (what binds its headers)."""
    meta: dict[str, object] = {
        "version": format_version(version), "total_size": int(total_size), ANCHOR_COMMIT_KEY: commit,
        "checksum_format": checksum_format,
    }
    obj: dict[str, object] = {
        "metadata": meta, "weight_map": dict(sorted(weight_map.items())), ANCHOR_DIGESTS_KEY: dict(sorted(digests.items())),
    }
    if layout is not None:
        obj[LAYOUT_KEY] = _layout_json(layout)
    return json.dumps(obj, indent=1).encode()


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


def build_full_index(
    version: int, weight_map: dict[str, str], total_size: int, checksum_format: str | None = None,
    digests: dict[str, str] | None = None, layout: "dict[str, tuple[str, tuple[int, ...]]] | None" = None,
) -> bytes:
    """An HF index; ``total_size`` is the tensor bytes, an integer (the HF convention). With
    ``digests`` (ours), each tensor's digest, so a seed from this version checks its copy."""
    meta: dict[str, object] = {"version": format_version(version), "total_size": int(total_size)}
    obj: dict[str, object] = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    if digests is not None and checksum_format is not None:
        meta["checksum_format"] = checksum_format
        obj[ANCHOR_DIGESTS_KEY] = dict(sorted(digests.items()))
    if layout is not None:
        obj[LAYOUT_KEY] = _layout_json(layout)
    return json.dumps(obj, indent=1).encode()


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
    """``.weight_sync/state.json``. ``version`` is the only field upstream readers need. The
    rest binds the local bytes to where they came from, so a pull never mistakes another
    origin's state for its own: ``source_dir`` (real path), ``run`` (the source dir's run id,
    when it has one) and ``seed`` (the fingerprint of the seed dir the state grew from)."""

    version: str
    source_dir: str | None = None
    run: str | None = None
    seed: str | None = None
    # weight file name -> its size when the marker was written: a no-op checks them, so a
    # local shard cut short (or grown) under a valid marker reseeds instead of being served.
    files: dict[str, int] | None = None


def _file_sizes(obj: dict) -> dict[str, int] | None:
    value = obj.get("files")
    if not isinstance(value, dict):
        return None
    if not all(isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0 for k, n in value.items()):
        return None
    return dict(value)


def _optional_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    return value if isinstance(value, str) else None


def read_applied_state(path: str) -> AppliedState | None:
    """The marker, or None when it is absent or unreadable (both mean: state unknown)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        obj = json.loads(raw)
        state = AppliedState(
            version=str(obj["version"]), source_dir=_optional_str(obj, "source_dir"),
            run=_optional_str(obj, "run"), seed=_optional_str(obj, "seed"), files=_file_sizes(obj),
        )
        if parse_version_number(state.version, "version", path) < 0:
            return None
        return state
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, MalformedHeaderError):
        return None


def encode_applied_state(
    version: int, source_dir: str | None, run: str | None = None, seed: str | None = None,
    files: dict[str, int] | None = None,
) -> bytes:
    obj: dict[str, object] = {"version": format_version(version)}
    for key, value in (("source_dir", source_dir), ("run", run), ("seed", seed)):
        if value is not None:
            obj[key] = value
    if files is not None:
        obj["files"] = dict(sorted(files.items()))
    return json.dumps(obj).encode()


# --- the run identity of a source dir ---------------------------------------------------------


class RunIdentity(msgspec.Struct, frozen=True):
    """``weightsync-run.json``: written once by our publisher into a fresh source dir."""

    run_id: str
    created_unix_s: float = 0.0


def read_run_id(path: str) -> str | None:
    """The run id of a source dir, or None when it has none (an upstream writer's dir).

    An unreadable file (torn by a filesystem without rename) also reads as None: a marker that
    recorded a run id then no longer matches, and the pull reseeds, which is the safe side.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 12)
        return msgspec.json.decode(raw, type=RunIdentity).run_id or None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def encode_run_identity(run_id: str, created_unix_s: float) -> bytes:
    return msgspec.json.encode(RunIdentity(run_id, created_unix_s))


__all__ = [
    "VersionIndex",
    "AppliedState",
    "read_version_index",
    "read_anchor_index",
    "check_anchor",
    "AnchorCheck",
    "is_committed",
    "read_run_id",
    "read_applied_state",
    "encode_applied_state",
    "build_delta_index",
    "build_full_index",
    "build_anchor_index",
    "anchor_commit_of",
    "layout_of_shards",
    "INDEX_NAME",
]
