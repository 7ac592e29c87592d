"""An independent minimal writer and reader of the format, written from docs/FORMAT.md only.

It uses ``safetensors.numpy``, ``json``, ``zstandard``, ``xxhash``, ``blake3`` and ``zlib``
directly and nothing of ``weightsync``, so it stands in for another implementation (an
upstream trainer or reader): versions it writes must pull bit-exact with our ``pull``, and it
must read back what our ``Publisher`` writes.

Deliberate variations upstream writers are allowed: shard names of its own, several shards,
versions as JSON integers or unpadded strings, a full version without an index (one complete
``model.safetensors``), a full version whose metadata has no ``version``.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Mapping

import numpy as np
import zstandard
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"


# --- shared definitions (FORMAT.md "Delta shards" and "Encodings") ---------------------------


def hex_digest(checksum: str, data: bytes) -> str:
    if checksum == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128(data).hexdigest()
    if checksum == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    if checksum == "adler32":
        return "%08x" % zlib.adler32(data, 1)
    raise ValueError(f"unknown checksum {checksum}")


def encode_payload(encoding: str, old: bytes, new: bytes) -> bytes:
    """One zstd frame, level 1, content size declared."""
    a, b = np.frombuffer(old, np.uint8), np.frombuffer(new, np.uint8)
    if encoding == "xor":
        body = np.bitwise_xor(a, b).tobytes()
    elif encoding == "overwrite":
        pos = np.flatnonzero(a != b)
        body = struct.pack("<I", pos.size) + pos.astype("<u4").tobytes() + b[pos].tobytes()
    elif encoding == "sparse-v2":
        return encode_sparse_v2(old, new)
    else:
        raise ValueError(f"this writer knows only xor, overwrite and sparse-v2, not {encoding}")
    return _zframe(body)


def _zframe(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)


# --- sparse-v2 (FORMAT.md "sparse-v2") --------------------------------------------------------

V2_SEG = 4096  # the smallest segment the format allows: several segments even for small tensors
V2_LE = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _v2_width(nbytes: int) -> int:
    # any width dividing nbytes is valid; this writer does not know dtypes
    return next(w for w in (4, 2, 1) if nbytes % w == 0)


def _v2_keys(x: np.ndarray, width: int) -> np.ndarray:
    magnitude = x.astype(np.uint64) & np.uint64((1 << (8 * width - 1)) - 1)
    shift = {1: 0, 2: 7, 4: 23, 8: 55}[width]
    return (magnitude >> np.uint64(shift)).astype(np.int64)


def encode_sparse_v2(old: bytes, new: bytes) -> bytes:
    """Classes: one boundary at the median key of the segment's old elements (when there are two
    keys or more); the format leaves the choice to the writer."""
    width = _v2_width(len(old))
    bits = 8 * width
    o = np.frombuffer(old, V2_LE[width]).astype(np.uint64)
    nw = np.frombuffer(new, V2_LE[width]).astype(np.uint64)
    n = o.size
    nseg = -(-n // V2_SEG)
    table, streams = b"", b""
    for s in range(nseg):
        a, b = s * V2_SEG, min(n, (s + 1) * V2_SEG)
        so, sn = o[a:b], nw[a:b]
        if not np.any(so != sn):
            table += b"\0"
            continue
        keys = _v2_keys(so, width)
        median = int(np.median(keys))
        starts = [median] if 0 < median and np.any(keys < median) else []
        bounds = [0, *starts, 256 if width > 1 else 128]
        table += bytes([len(bounds) - 1, *starts])
        for c in range(len(bounds) - 1):
            members = np.flatnonzero((keys >= bounds[c]) & (keys < bounds[c + 1]))
            changed = np.flatnonzero(so[members] != sn[members])  # class indices
            k = changed.size
            if k == 0:
                table += struct.pack("<IIBB2x", members.size, 0, 0, 0)
                continue
            at = members[changed]
            d = [(int(sn[i]) - int(so[i])) % (1 << bits) for i in at]
            negative = [x >= 1 << (bits - 1) for x in d]
            mags = [((1 << bits) - x if neg else x) - 1 for x, neg in zip(d, negative)]
            if 4 * k >= members.size:
                mode = 8
                bitmap = np.zeros(members.size, bool)
                bitmap[changed] = True
                parts = [np.packbits(bitmap, bitorder="little").tobytes()]
            else:
                gaps = np.diff(np.concatenate([[-1], changed])) - 1
                mode = next(w for w in (1, 2, 4) if int(gaps.max()) < 1 << (8 * w))
                g = gaps.astype("<u4").view(np.uint8).reshape(k, 4)
                parts = [g[:, j].tobytes() for j in range(mode)]
            parts.append(np.packbits(np.array(negative, bool), bitorder="little").tobytes())
            planes = (max(mags).bit_length() + 7) // 8
            m = np.array(mags, V2_LE[width]).view(np.uint8).reshape(k, width)
            parts += [m[:, j].tobytes() for j in range(planes)]
            frames = [_zframe(x) for x in parts]
            table += struct.pack("<IIBB2x", members.size, k, mode, planes) + struct.pack(f"<{len(frames)}I", *map(len, frames))
            streams += b"".join(frames)
    head = b"WSS2" + bytes([1, width, 0, 0]) + struct.pack("<QII", n, V2_SEG, nseg)
    return head + table + streams


def _frame_content(frame: bytes) -> bytes:
    size = zstandard.get_frame_parameters(frame).content_size
    out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    assert len(out) == size
    return out


def apply_sparse_v2(old: bytes, payload: bytes) -> bytes:
    magic, version, width, reserved, flags, n, seg, nseg = struct.unpack_from("<4sBBBBQII", payload, 0)
    assert (magic, version, reserved, flags) == (b"WSS2", 1, 0, 0) and width in V2_LE
    assert n * width == len(old) and 1 << 12 <= seg <= 1 << 20 and nseg == -(-n // seg)
    nkeys = 256 if width > 1 else 128
    bits = 8 * width
    out = np.frombuffer(old, V2_LE[width]).astype(np.uint64)
    pos = 24
    segments = []
    for s in range(nseg):
        nclasses = payload[pos]
        pos += 1
        starts = list(payload[pos : pos + max(nclasses - 1, 0)])
        pos += max(nclasses - 1, 0)
        bounds = [0, *starts, nkeys]
        classes = []
        for c in range(nclasses):
            members, k, mode, planes = struct.unpack_from("<IIBB2x", payload, pos)
            pos += 12
            nframes = 0 if k == 0 else (1 if mode == 8 else mode) + 1 + planes
            sizes = struct.unpack_from(f"<{nframes}I", payload, pos)
            pos += 4 * nframes
            classes.append((bounds[c], bounds[c + 1], members, k, mode, planes, sizes))
        segments.append(classes)
    for s, classes in enumerate(segments):
        a, b = s * seg, min(n, (s + 1) * seg)
        keys = _v2_keys(out[a:b], width)  # all classes from the old bytes, before any write
        updates = []
        for lo, hi, members_declared, k, mode, planes, sizes in classes:
            frames = []
            for size in sizes:
                frames.append(_frame_content(payload[pos : pos + size]))
                pos += size
            members = np.flatnonzero((keys >= lo) & (keys < hi))
            assert members.size == members_declared
            if k == 0:
                continue
            if mode == 8:
                q = np.flatnonzero(np.unpackbits(np.frombuffer(frames[0], np.uint8), count=members.size, bitorder="little"))
                rest = frames[1:]
            else:
                gaps = sum(np.frombuffer(frames[j], np.uint8).astype(np.int64) << (8 * j) for j in range(mode))
                q = np.cumsum(gaps + 1) - 1
                rest = frames[mode:]
            assert q.size == k and int(q[-1]) < members.size
            negative = np.unpackbits(np.frombuffer(rest[0], np.uint8), count=k, bitorder="little")
            mags = sum((np.frombuffer(rest[1 + j], np.uint8).astype(np.uint64) << np.uint64(8 * j) for j in range(planes)),
                       np.zeros(k, np.uint64))
            for i, neg, m in zip(members[q], negative, mags):
                step = (1 << bits) - (int(m) + 1) if neg else int(m) + 1
                updates.append((a + int(i), (int(out[a + i]) + step) % (1 << bits)))
        for i, value in updates:
            out[i] = value
    assert pos == len(payload), "trailing bytes after the sparse-v2 streams"
    return out.astype(V2_LE[width]).tobytes()


def apply_payload(encoding: str, old: bytes, payload: bytes) -> bytes:
    if encoding == "sparse-v2":
        return apply_sparse_v2(old, payload)
    params = zstandard.get_frame_parameters(payload)
    body = zstandard.ZstdDecompressor().decompress(payload, max_output_size=params.content_size)
    assert len(body) == params.content_size
    if encoding == "xor":
        assert len(body) == len(old), "xor payload must decompress to exactly nbytes"
        return np.bitwise_xor(np.frombuffer(old, np.uint8), np.frombuffer(body, np.uint8)).tobytes()
    if encoding == "overwrite":
        (count,) = struct.unpack_from("<I", body)
        assert len(body) == 4 + 5 * count
        pos = np.frombuffer(body, "<u4", count=count, offset=4)
        assert count == 0 or (np.all(pos[1:] > pos[:-1]) and int(pos[-1]) < len(old))
        out = np.frombuffer(old, np.uint8).copy()
        out[pos] = np.frombuffer(body, np.uint8, offset=4 + 4 * count)
        return out.tobytes()
    raise ValueError(f"unsupported delta_encoding {encoding!r}; supported ['overwrite', 'sparse-v2', 'xor']")


# --- the writer ---------------------------------------------------------------------------------


def _version_value(version: int, style: str):
    return {"padded": f"{version:06d}", "plain": str(version), "int": version}[style]


def _write_index(vdir: str, metadata: dict, weight_map: dict) -> None:
    # The commit point, written last, under a temporary name and renamed.
    tmp = os.path.join(vdir, INDEX + ".partial")
    with open(tmp, "w") as f:
        json.dump({"metadata": metadata, "weight_map": weight_map}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(vdir, INDEX))


def write_delta_version(
    source_dir: str,
    version: int,
    old: Mapping[str, bytes],
    new: Mapping[str, bytes],
    *,
    encoding: str,
    checksum: str,
    shards: int = 1,
    version_style: str = "padded",
    omit_defaults: bool = False,
) -> list[str]:
    """A delta version: payloads of the changed tensors spread over ``shards`` files."""
    vdir = os.path.join(source_dir, f"weight_v{version:06d}")
    os.makedirs(vdir, exist_ok=True)
    changed = sorted(n for n in new if new[n] != old[n])
    weight_map = {}
    for i in range(shards):
        part = changed[i::shards]
        if not part:
            continue
        fname = f"upstream_part{i}.safetensors"
        arrays = {n: np.frombuffer(encode_payload(encoding, old[n], new[n]), np.uint8) for n in part}
        digests = {n: hex_digest(checksum, new[n]) for n in part}
        save_file(arrays, os.path.join(vdir, fname), metadata=digests)
        weight_map.update({n: fname for n in part})
    metadata = {
        "version": _version_value(version, version_style),
        "base_version": _version_value(version - 1, version_style),
        "delta_encoding": encoding,
    }
    if not omit_defaults or checksum != "xxh3-128":
        metadata["checksum_format"] = checksum
    if not omit_defaults:
        metadata["compression_format"] = "zstd"
    _write_index(vdir, metadata, weight_map)
    return changed


def write_full_version(
    source_dir: str,
    version: int,
    arrays: Mapping[str, np.ndarray],
    *,
    with_index: bool = True,
    shards: int = 2,
    version_style: str | None = "padded",
    extra_files: Mapping[str, str] | None = None,
) -> None:
    """A full version: an ordinary HF checkpoint, sharded with an index, or one index-less
    ``model.safetensors`` (written last, so its completeness is the commit point)."""
    vdir = os.path.join(source_dir, f"weight_v{version:06d}")
    os.makedirs(vdir, exist_ok=True)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(vdir, name), "w") as f:
            f.write(text)
    names = sorted(arrays)
    if not with_index:
        tmp = os.path.join(vdir, "model.partial")
        save_file({n: arrays[n] for n in names}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(vdir, "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: arrays[n] for n in part}, os.path.join(vdir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    metadata: dict = {"total_size": sum(a.nbytes for a in arrays.values())}
    if version_style is not None:
        metadata["version"] = _version_value(version, version_style)
    _write_index(vdir, metadata, weight_map)


# --- the reader ---------------------------------------------------------------------------------


def _read_safetensors(path: str) -> tuple[dict[str, bytes], dict[str, str]]:
    with safe_open(path, framework="numpy") as f:
        return {n: f.get_tensor(n).tobytes() for n in f.keys()}, (f.metadata() or {})


def _read_index(vdir: str) -> dict | None:
    try:
        with open(os.path.join(vdir, INDEX)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _is_complete_single_file(vdir: str) -> bool:
    files = sorted(n for n in os.listdir(vdir) if n.endswith(".safetensors"))
    if files != ["model.safetensors"]:
        return False
    path = os.path.join(vdir, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    return 8 + n + end == size


def read_version(source_dir: str, target: int, seed: Mapping[str, bytes]) -> dict[str, bytes]:
    """The bytes of every tensor at ``target``: walk down to a full version (or the seed, v0),
    then apply each delta and verify every digest."""
    chain = []
    state: dict[str, bytes] | None = None
    v = target
    while v > 0:
        vdir = os.path.join(source_dir, f"weight_v{v:06d}")
        index = _read_index(vdir)
        if index is None:
            assert _is_complete_single_file(vdir), f"v{v} is not published"
            state, _ = _read_safetensors(os.path.join(vdir, "model.safetensors"))
            break
        meta = index["metadata"]
        if "delta_encoding" not in meta:
            state = {}
            for fname in sorted(set(index["weight_map"].values())):
                assert "/" not in fname and fname not in ("", ".", "..")
                tensors, _ = _read_safetensors(os.path.join(vdir, fname))
                state.update(tensors)
            assert set(state) == set(index["weight_map"])
            break
        assert int(meta["version"]) == v and int(meta["base_version"]) == v - 1
        chain.append((vdir, index))
        v -= 1
    if state is None:
        state = dict(seed)
    for vdir, index in reversed(chain):
        meta = index["metadata"]
        encoding = meta["delta_encoding"]
        checksum = meta.get("checksum_format", "xxh3-128")
        assert meta.get("compression_format", "zstd") == "zstd"
        by_shard: dict[str, set[str]] = {}
        for name, fname in index["weight_map"].items():
            by_shard.setdefault(fname, set()).add(name)
        for fname, names in by_shard.items():
            payloads, digests = _read_safetensors(os.path.join(vdir, fname))
            assert set(payloads) == names
            for name in names:
                state[name] = apply_payload(encoding, state[name], payloads[name])
                assert hex_digest(checksum, state[name]) == digests[name], f"{name} fails its digest"
    return state
