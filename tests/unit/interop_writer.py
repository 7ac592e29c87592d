"""An independent minimal writer and reader of the format, written from docs/FORMAT.md only.

It uses ``safetensors.numpy``, ``json``, ``zstandard``, ``xxhash``, ``blake3`` and ``zlib``
directly and nothing of ``weightsync``, so it stands in for another implementation (an
upstream trainer or reader): versions it writes must pull bit-exact with our ``pull``, and it
must read back what our ``Publisher`` writes. It reads both sparse-v2 bitstreams: 2 (it also
writes it) and 3, the range-coded one (a plain-Python range decoder, slow: small tensors only).

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


# --- bit streams (FORMAT.md "sparse-v2": LSB first within each byte, zero padding) -------------


class BitWriter:
    def __init__(self) -> None:
        self.bits: list[int] = []

    def field(self, value: int, width: int) -> None:
        self.bits += [(value >> i) & 1 for i in range(width)]

    def unary(self, q: int) -> None:
        self.bits += [0] * q + [1]

    def getvalue(self) -> bytes:
        bits = self.bits + [0] * (-len(self.bits) % 8)
        return bytes(sum(b << i for i, b in enumerate(bits[j : j + 8])) for j in range(0, len(bits), 8))


class BitReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def bit(self) -> int:
        assert self.pos < 8 * len(self.data), "read past the end of a part"
        b = (self.data[self.pos >> 3] >> (self.pos & 7)) & 1
        self.pos += 1
        return b

    def field(self, width: int) -> int:
        return sum(self.bit() << i for i in range(width))

    def unary(self) -> int:
        q = 0
        while not self.bit():
            q += 1
        return q

    def finish(self) -> None:
        """The part is exactly used: what is left is zero padding inside its last byte."""
        assert -(-self.pos // 8) == len(self.data), "a part is longer than its contents"
        while self.pos < 8 * len(self.data):
            assert self.bit() == 0, "padding bits must be zero"


# --- sparse-v2 (FORMAT.md "sparse-v2") --------------------------------------------------------

V2_SEG = 4096  # the smallest segment the format allows: several segments even for small tensors
V2_LE = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
V2_CLASS = "<IIIIBBBBBBBB"


def _v2_width(nbytes: int) -> int:
    # any width dividing nbytes is valid; this writer does not know dtypes
    return next(w for w in (4, 2, 1) if nbytes % w == 0)


def v2_key(x: int, width: int) -> int:
    return (x & ((1 << (8 * width - 1)) - 1)) >> {1: 0, 2: 7, 4: 23, 8: 55}[width]


def v2_order(x: int, width: int) -> int:
    """T: sign-magnitude bits -> a monotone order."""
    bits = 8 * width
    return x ^ ((1 << bits) - 1 if x >> (bits - 1) else 1 << (bits - 1))


def v2_unorder(y: int, width: int) -> int:
    bits = 8 * width
    return y ^ (1 << (bits - 1) if y >> (bits - 1) else (1 << bits) - 1)


def _rice(values: list[int], r: int) -> tuple[bytes, bytes]:
    rem, quo = BitWriter(), BitWriter()
    for x in values:
        rem.field(x & ((1 << r) - 1), r)
        quo.unary(x >> r)
    return rem.getvalue(), quo.getvalue()


def _rice_param(values: list[int]) -> int:
    mean = sum(values) / len(values)
    return max(0, min(20, int(mean).bit_length() - 1))


def _indices_part(indices: list[int], universe: int, use_bitmap: bool) -> tuple[int, int, list[bytes], list[int]]:
    """(mode, parameter, parts, declared sizes) of ascending indices into ``universe`` slots
    (a bitmap's size is declared by the caller when it is not implied)."""
    if use_bitmap:
        w = BitWriter()
        marked = set(indices)
        for i in range(universe):
            w.field(int(i in marked), 1)
        return 2, 0, [w.getvalue()], [len(w.getvalue())]
    gaps = [b - a - 1 for a, b in zip([-1, *indices], indices)]
    r = _rice_param(gaps)
    rem, quo = _rice(gaps, r)
    return 1, r, [rem, quo], [len(quo)]


def v2_value_order(key: int, a: int, shift: int, width: int) -> int:
    return a if shift == 8 else max(0, min(8 * width - 2, a - (key >> shift)))


def v2_class(members: int, local: list[int], d: list[int], keys: list[int], width: int, *,
             bitmap: bool | None = None, value_order: tuple[int, int] = (0, 8)) -> tuple[bytes, bytes]:
    """One class's table bytes and data bytes: changes at class indices ``local`` (ascending)
    with differences ``d`` (T(new) - T(old) mod 2^bits) and old keys ``keys``."""
    bits = 8 * width
    k = len(local)
    if k == 0:
        return struct.pack(V2_CLASS, members, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), b""
    negative = [x >= 1 << (bits - 1) for x in d]
    mags = [((1 << bits) - x if neg else x) - 1 for x, neg in zip(d, negative)]
    mode, rg, parts, declared = _indices_part(local, members, 4 * k >= members if bitmap is None else bitmap)
    if mode == 2:
        declared = []  # the change bitmap's size follows from members
    signs = BitWriter()
    for neg in negative:
        signs.field(int(neg), 1)
    parts.append(signs.getvalue())
    big = [j for j, m in enumerate(mags) if m > 0]
    flag_mode = rf = nflag = lo = hi = 0
    a, shift = value_order if big else (0, 0)
    if big:
        # this writer flags every large change: keys [0, max key of a large one] are candidates
        hi = max(keys[j] for j in big)
        candidates = [j for j in range(k) if keys[j] <= hi]
        flagged = [i for i, j in enumerate(candidates) if mags[j] > 0]
        nflag = len(flagged)
        flag_mode, rf, fparts, fdeclared = _indices_part(flagged, len(candidates), 4 * nflag >= len(candidates))
        parts += fparts
        declared += fdeclared
        fields, lengths = BitWriter(), BitWriter()
        for j in big:
            r = v2_value_order(keys[j], a, shift, width)
            w = mags[j] - 1 + (1 << r)
            length = w.bit_length() - 1 - r
            lengths.unary(length)
            fields.field(w, length + r)  # the low L + r bits (the top bit is implied)
        parts += [fields.getvalue(), lengths.getvalue()]
        declared += [len(parts[-2]), len(parts[-1])]
    head = struct.pack(V2_CLASS, members, k, len(big), nflag, mode, rg, flag_mode, rf, a, shift, lo, hi)
    return head + struct.pack(f"<{len(declared)}I", *declared), b"".join(parts)


def encode_sparse_v2(old: bytes, new: bytes) -> bytes:
    """Classes: one boundary at the median key of the segment's old elements (when there are two
    keys or more); Rice parameters from the mean gap; value orders constant 0. The format leaves
    all of these to the writer."""
    width = _v2_width(len(old))
    o = [int(x) for x in np.frombuffer(old, V2_LE[width])]
    nw = [int(x) for x in np.frombuffer(new, V2_LE[width])]
    n = len(o)
    nseg = -(-n // V2_SEG)
    table, data = b"", b""
    for s in range(nseg):
        a, b = s * V2_SEG, min(n, (s + 1) * V2_SEG)
        if o[a:b] == nw[a:b]:
            table += b"\0"
            continue
        keys = [v2_key(x, width) for x in o[a:b]]
        median = sorted(keys)[len(keys) // 2]
        starts = [median] if median > 0 and min(keys) < median else []
        bounds = [0, *starts, 256 if width > 1 else 128]
        table += bytes([len(bounds) - 1, *starts])
        for c in range(len(bounds) - 1):
            members = [i for i, key in enumerate(keys) if bounds[c] <= key < bounds[c + 1]]
            local = [j for j, i in enumerate(members) if o[a + i] != nw[a + i]]
            d = [(v2_order(nw[a + members[j]], width) - v2_order(o[a + members[j]], width)) % (1 << (8 * width)) for j in local]
            head, body = v2_class(len(members), local, d, [keys[members[j]] for j in local], width)
            table += head
            data += body
    head = b"WSS2" + bytes([2, width, 0, 0]) + struct.pack("<QII", n, V2_SEG, nseg)
    return head + table + data


def _read_indices(mode: int, r: int, parts: list[bytes], count: int, universe: int) -> list[int]:
    if mode == 2:
        bm = BitReader(parts.pop(0))
        marked = [i for i in range(universe) if bm.field(1)]
        bm.finish()
        assert len(marked) == count
        return marked
    rem, quo = BitReader(parts.pop(0)), BitReader(parts.pop(0))
    out, last = [], -1
    for _ in range(count):
        last += 1 + ((quo.unary() << r) | rem.field(r))
        out.append(last)
    rem.finish()
    quo.finish()
    assert last < universe
    return out


def apply_sparse_v2(old: bytes, payload: bytes) -> bytes:
    magic, version, width, reserved, flags, n, seg, nseg = struct.unpack_from("<4sBBBBQII", payload, 0)
    assert (magic, version, reserved, flags) == (b"WSS2", 2, 0, 0) and width in V2_LE
    assert n * width == len(old) and 1 << 12 <= seg <= 1 << 20 and nseg == -(-n // seg)
    nkeys = 256 if width > 1 else 128
    bits = 8 * width
    out = [int(x) for x in np.frombuffer(old, V2_LE[width])]
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
            members, k, nbig, nflag, mode, rg, flag_mode, rf, a, shift, lo_key, hi_key = struct.unpack_from(V2_CLASS, payload, pos)
            pos += struct.calcsize(V2_CLASS)
            ndeclared = (mode == 1) + (nflag > 0) + 2 * (nbig > 0)
            declared = list(struct.unpack_from(f"<{ndeclared}I", payload, pos))
            pos += 4 * ndeclared
            classes.append((bounds[c], bounds[c + 1], members, k, nbig, nflag, mode, rg, flag_mode, rf, a, shift, lo_key, hi_key,
                            declared))
        segments.append(classes)
    for s, classes in enumerate(segments):
        a0, b0 = s * seg, min(n, (s + 1) * seg)
        keys = [v2_key(x, width) for x in out[a0:b0]]  # all classes from the old bytes, before any write
        updates = []
        for lo, hi, members_declared, k, nbig, nflag, mode, rg, flag_mode, rf, va, vs, lo_key, hi_key, declared in classes:
            members = [i for i, key in enumerate(keys) if lo <= key < hi]
            assert len(members) == members_declared
            if k == 0:
                continue
            sizes = iter(declared)
            parts = []

            def take(size: int) -> None:
                nonlocal pos
                parts.append(payload[pos : pos + size])
                pos += size

            if mode == 2:
                take(-(-members_declared // 8))
            else:
                take(-(-k * rg // 8))
                take(next(sizes))
            take(-(-k // 8))
            if nflag:
                if flag_mode == 2:
                    take(next(sizes))
                else:
                    take(-(-nflag * rf // 8))
                    take(next(sizes))
            if nbig:
                take(next(sizes))
                take(next(sizes))
            local = _read_indices(mode, rg, parts, k, members_declared)
            sign_bits = BitReader(parts.pop(0))
            negative = [sign_bits.field(1) for _ in range(k)]
            sign_bits.finish()
            mags = [1] * k
            if nbig:
                change_keys = [keys[members[q]] for q in local]
                large = [key < lo_key for key in change_keys]
                candidates = [j for j, key in enumerate(change_keys) if lo_key <= key <= hi_key]
                if nflag:
                    coded = _read_indices(1 if flag_mode == 3 else flag_mode, rf, parts, nflag, len(candidates))
                    for i in range(len(candidates)) if flag_mode == 3 else []:
                        large[candidates[i]] = True
                    for i in coded:
                        large[candidates[i]] = flag_mode != 3
                big = [j for j in range(k) if large[j]]
                assert len(big) == nbig
                fields, lengths = BitReader(parts.pop(0)), BitReader(parts.pop(0))
                for j in big:
                    r = v2_value_order(keys[members[local[j]]], va, vs, width)
                    length = lengths.unary()
                    w = fields.field(length + r) | (1 << (length + r))
                    mags[j] = w - (1 << r) + 2
                    assert mags[j] <= 1 << (bits - 1)
                fields.finish()
                lengths.finish()
            for j, q in enumerate(local):
                i = a0 + members[q]
                step = (1 << bits) - mags[j] if negative[j] else mags[j]
                updates.append((i, v2_unorder((v2_order(out[i], width) + step) % (1 << bits), width)))
        for i, value in updates:
            out[i] = value
    assert pos == len(payload), "trailing bytes after the sparse-v2 streams"
    return np.array(out, dtype=np.uint64).astype(V2_LE[width]).tobytes()


# --- sparse-v2 bitstream 3 (FORMAT.md "Bitstream 3: range coded"), reader only ---------------


class RangeDecoderError(AssertionError):
    """A coded part that does not decode cleanly (first byte, early end, extra bytes)."""


class RangeDecoder:
    """FORMAT.md "The decoder": 32-bit code and range, 16-bit probabilities, byte renormalisation."""

    def __init__(self, part: bytes) -> None:
        if len(part) < 5 or part[0] != 0:
            raise RangeDecoderError(f"a coded part starts with 0 and holds 5 bytes at least, got {part[:5].hex()}")
        self.part = part
        self.pos = 5
        self.range = (1 << 32) - 1
        self.code = int.from_bytes(part[:5], "big") & 0xFFFFFFFF

    def modelled(self, context: list[int]) -> int:
        p0, count = context
        bit = self._decide((self.range >> 16) * max(p0 >> 16, 1))
        shift = min((count + 2).bit_length() - 1, 12)  # floor(log2(c + 2))
        context[0] = p0 - (p0 >> shift) if bit else p0 + (((1 << 32) - p0) >> shift)
        context[1] = min(count + 1, 4096)
        return bit

    def _decide(self, bound: int) -> int:
        if self.code < bound:
            bit, self.range = 0, bound
        else:
            bit, self.code, self.range = 1, self.code - bound, self.range - bound
        while self.range < 1 << 24:
            if self.pos >= len(self.part):
                raise RangeDecoderError(f"a decision reads past its part of {len(self.part)} bytes")
            self.range = (self.range << 8) & 0xFFFFFFFF
            self.code = ((self.code << 8) | self.part[self.pos]) & 0xFFFFFFFF
            self.pos += 1
        return bit

    def finish(self) -> None:
        if self.pos != len(self.part):
            raise RangeDecoderError(f"the decisions consume {self.pos} of the part's {len(self.part)} bytes")


class _Contexts(dict):
    """One (p0, count) state per (table, index), created at p0 = 2^31, c = 0 on first use."""

    def __missing__(self, key: tuple) -> list[int]:
        self[key] = state = [1 << 31, 0]
        return state


def _recent_bucket(r: int) -> int:
    for bucket, top in enumerate((0, 1, 2, 4, 7, 12, 20)):
        if r <= top:
            return bucket
    return 7


def rc_decode_segment(old: list[int], part: bytes, width: int) -> dict[int, int]:
    """The changes of one segment, {position in segment: signed d}, from its coded part."""
    decoder, contexts = RangeDecoder(part), _Contexts()
    bits = 8 * width
    changed: list[int] = []
    changes: dict[int, int] = {}
    recent = 0  # changed elements among the previous min(i, 64)
    for i, x in enumerate(old):
        key = v2_key(x, width)
        if i > 64:
            recent -= changed[i - 65]
        is_changed = decoder.modelled(contexts["mask", key, _recent_bucket(recent)])
        changed.append(is_changed)
        recent += is_changed
        if not is_changed:
            continue
        negative = decoder.modelled(contexts["sign", key])
        magnitude = 1
        if decoder.modelled(contexts["large", key]):
            length = 0
            while length < bits - 2 and decoder.modelled(contexts["len", key, min(length, 15)]):
                length += 1
            v = 1
            if length > 0:
                v = (v << 1) | decoder.modelled(contexts["top", min(length, 15)])
                for j in range(1, length):
                    v = (v << 1) | decoder.modelled(contexts["low", min(length, 15), min(j, 15)])
            magnitude = v + 1
        changes[i] = -magnitude if negative else magnitude
    decoder.finish()
    return changes


def apply_sparse_v2_rc(old: bytes, payload: bytes) -> bytes:
    magic, version, width, reserved, flags, n, seg, nseg = struct.unpack_from("<4sBBBBQII", payload, 0)
    assert (magic, version, reserved, flags) == (b"WSS2", 3, 0, 0) and width in V2_LE
    assert n * width == len(old) and 1 << 12 <= seg <= 1 << 20 and nseg == -(-n // seg)
    entries = [struct.unpack_from("<II", payload, 24 + 8 * s) for s in range(nseg)]
    pos = 24 + 8 * nseg
    for s, (k, b) in enumerate(entries):
        assert k <= min(n, (s + 1) * seg) - s * seg and (b == 0) == (k == 0) and (b == 0 or b >= 5)
    assert pos + sum(b for _, b in entries) == len(payload), "parts past the payload or trailing bytes"
    bits = 8 * width
    out = [int(x) for x in np.frombuffer(old, V2_LE[width])]
    for s, (k, b) in enumerate(entries):
        a0, b0 = s * seg, min(n, (s + 1) * seg)
        part, pos = payload[pos : pos + b], pos + b
        if k == 0:
            continue
        changes = rc_decode_segment(out[a0:b0], part, width)
        if len(changes) != k:
            raise RangeDecoderError(f"segment {s} decodes {len(changes)} changes, its entry declares {k}")
        for i, d in changes.items():
            out[a0 + i] = v2_unorder((v2_order(out[a0 + i], width) + d) % (1 << bits), width)
    return np.array(out, dtype=np.uint64).astype(V2_LE[width]).tobytes()


# --- sparse-v1 (FORMAT.md "sparse-v1"), reader only -------------------------------------------


def apply_sparse_v1(old: bytes, payload: bytes) -> bytes:
    magic, version, width, transform, flags, n, seg, nseg = struct.unpack_from("<4sBBBBQII", payload, 0)
    assert (magic, version, flags) == (b"WSSP", 1, 0) and width in V2_LE and transform in (0, 1)
    assert n * width == len(old) and 1 <= seg <= 1 << 30 and seg >= min(n, 1 << 16) and nseg == -(-n // seg)
    bits = 8 * width
    out = [int(x) for x in np.frombuffer(old, V2_LE[width])]
    pos = 24
    entries = []
    for s in range(nseg):
        count, nbig, gw = struct.unpack_from("<IIB", payload, pos)
        assert payload[pos + 9 : pos + 12] == b"\0\0\0"
        pos += 12
        nframes = 0 if count == 0 else gw + 2 + (width if nbig else 0)
        entries.append((count, nbig, gw, struct.unpack_from(f"<{nframes}I", payload, pos)))
        pos += 4 * nframes
    order = (lambda x: v2_order(x, width)) if transform else (lambda x: x)
    unorder = (lambda y: v2_unorder(y, width)) if transform else (lambda y: y)
    for s, (count, nbig, gw, sizes) in enumerate(entries):
        frames = []
        for size in sizes:
            frames.append(_frame_content(payload[pos : pos + size]))
            pos += size
        if count == 0:
            continue
        gaps = [sum(frames[j][i] << (8 * j) for j in range(gw)) for i in range(count)]
        signs = BitReader(frames[gw])
        large = BitReader(frames[gw + 1])
        planes = frames[gw + 2 :]
        at, b = s * seg - 1, 0
        for i in range(count):
            at += gaps[i] + 1
            assert at < min(n, (s + 1) * seg)
            negative, is_large = signs.field(1), large.field(1)
            m = 1
            if is_large:
                m = 2 + sum(planes[j][b] << (8 * j) for j in range(width))
                b += 1
            step = (1 << bits) - m if negative else m
            out[at] = unorder((order(out[at]) + step) % (1 << bits))
        assert b == nbig
        signs.finish()
        large.finish()
    assert pos == len(payload), "trailing bytes after the sparse-v1 streams"
    return np.array(out, dtype=np.uint64).astype(V2_LE[width]).tobytes()


def _frame_content(frame: bytes) -> bytes:
    size = zstandard.get_frame_parameters(frame).content_size
    out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    assert len(out) == size
    return out


def apply_payload(encoding: str, old: bytes, payload: bytes) -> bytes:
    if encoding == "sparse-v2":
        return apply_sparse_v2_rc(old, payload) if payload[4:5] == b"\x03" else apply_sparse_v2(old, payload)
    if encoding == "sparse-v1":
        return apply_sparse_v1(old, payload)
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
    raise ValueError(f"unsupported delta_encoding {encoding!r}; supported ['overwrite', 'sparse-v1', 'sparse-v2', 'xor']")


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
