"""``sparse-v1``: our delta encoding. Only the changed elements travel, as position gaps and
small integer differences, each byte plane in its own zstd frame (spec: docs/FORMAT.md).

Why it is small: an RL step moves most bf16 weights by 0 or 1 ulp. Reading the elements as
integers in float order (sign-magnitude folded into a monotone map), a 1-ulp move is a
difference of +-1, zigzag-coded to 1 or 2, so the low value plane carries ~1.5 bits per
change and the high planes are nearly all zero. Gaps between changed positions cost about
the entropy of the change mask. upstream ``xor`` pays for every zero run of the whole tensor.

Invariants:
- exact for any bytes of any element width (the map and the modular difference are
  bijections; NaNs, sign flips, all elements changed all round-trip);
- the payload is self-delimiting: a fixed header, a segment table, then exactly the frames
  the table announces, nothing after them; ``check`` proves all sizes from headers alone;
- apply writes a batch only after its positions were proven in range (ascending holds by
  construction, gaps are non-negative) and its values non-zero; memory per batch is bounded
  by the chunk budget, never by the tensor;
- segments (fixed element ranges, independent streams) bound the working set, let a chain
  of payloads be applied segment by segment while the segment is in cache, and let a
  worker pool split a large tensor.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, cast

import numpy as np

from ..errors import PayloadBoundError
from .base import SCRATCH, Encoded, PayloadDensity
from .zstd_frames import ExactReader, check_frame, compress, decompress_exact

MAGIC = b"WSSP"
VERSION = 1
TRANSFORM_NONE = 0  # difference of the plain unsigned integers
TRANSFORM_FLOAT_ORDER = 1  # difference after the sign-magnitude -> monotone map
HEADER = struct.Struct("<4sBBBBQII")  # magic, version, width, transform, flags, nelements, seg_elements, nsegments
ENTRY_HEAD = struct.Struct("<IIB3x")  # count, large-value count, gap width, reserved
MAX_SEG_ELEMENTS = 1 << 30  # gaps < 2^30 fit 4 bytes; count x (gap + 1) cannot overflow int64
# The spec's floor: seg >= min(n, 2^16). It bounds the table, the time to walk it and what a
# parse keeps, relative to the tensor (one element per segment made a 12 MiB payload cost
# seconds and hundreds of MiB per parse).
MIN_SEG_ELEMENTS = 1 << 16
SEG_ELEMENTS = 1 << 22  # what the encoder writes: 4 Mi elements (8 MiB of bf16)
ENCODE_BATCH = 1 << 20  # elements compared per pass while encoding (keeps temporaries small)
GAP_WIDTHS = (1, 2, 4)
LE_UINT: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class Segment(NamedTuple):
    start: int  # first element
    length: int  # elements
    nchanged: int  # changed elements (not ``count``: that is tuple.count)
    nbig: int  # changes whose |difference| > 1
    gap_width: int
    gap_frames: list[memoryview]  # least significant plane first
    sign_frame: memoryview | None
    big_frame: memoryview | None
    big_value_frames: list[memoryview]


class Parsed(NamedTuple):
    """A payload's header and segment table, proven once (at load) and kept for the check and
    the apply: offsets into the payload, never views of it, so the shard can be closed between
    uses. About 25 bytes per segment; with ``seg >= min(n, MIN_SEG_ELEMENTS)`` that is under
    1/2600 of the tensor, and never more than 3x the table, which lies inside the payload."""

    width: int
    transform: int
    nelements: int
    seg_elements: int
    counts: np.ndarray  # u32 per segment: changed elements
    nbigs: np.ndarray  # u32 per segment: changes with |d| > 1
    gap_widths: np.ndarray  # u8 per segment
    sizes_at: np.ndarray  # i64 per segment: where its stream sizes sit in the table
    streams_at: np.ndarray  # i64 per segment: where its first stream starts

    @property
    def nsegments(self) -> int:
        return int(self.counts.size)

    @property
    def nbytes(self) -> int:
        return self.nelements * self.width

    def changed_elements(self) -> int:
        return int(self.counts.sum(dtype=np.int64))

    def segment(self, payload, s: int) -> Segment:
        """Segment ``s`` with views of its streams in ``payload`` (the bytes this was parsed from)."""
        mv = memoryview(payload).cast("B")
        start = s * self.seg_elements
        length = min(self.seg_elements, self.nelements - start)
        count, nbig, gw = int(self.counts[s]), int(self.nbigs[s]), int(self.gap_widths[s])
        if count == 0:
            return Segment(start, length, 0, 0, 0, [], None, None, [])
        nframes = gw + 2 + (self.width if nbig else 0)
        pos = int(self.streams_at[s])
        frames = []
        for size in struct.unpack_from(f"<{nframes}I", mv, int(self.sizes_at[s])):
            frames.append(mv[pos : pos + size])
            pos += size
        return Segment(start, length, count, nbig, gw, frames[:gw], frames[gw], frames[gw + 1], frames[gw + 2 :])


# --- the element map --------------------------------------------------------------------


def _signed(dt: np.dtype) -> np.dtype:
    return np.dtype(dt.str.replace("u", "i"))


def _to_order(x: np.ndarray, mask: np.ndarray) -> None:
    """In place: sign-magnitude bits -> a monotone unsigned order (a bijection).
    ``mask`` is scratch of x's shape and dtype."""
    idt = _signed(x.dtype)
    bits = 8 * x.dtype.itemsize
    np.right_shift(x.view(idt), idt.type(bits - 1), out=mask.view(idt))  # all ones when negative
    mask |= x.dtype.type(1 << (bits - 1))
    x ^= mask


def _from_order(y: np.ndarray, mask: np.ndarray) -> None:
    """In place: inverse of ``_to_order``."""
    idt = _signed(y.dtype)
    bits = 8 * y.dtype.itemsize
    np.right_shift(y.view(idt), idt.type(bits - 1), out=mask.view(idt))
    np.invert(mask, out=mask)  # all ones when the order value's top bit is clear (a negative float)
    mask |= y.dtype.type(1 << (bits - 1))
    y ^= mask


# --- encode -----------------------------------------------------------------------------


def _gap_width(max_gap: int) -> int:
    for w in GAP_WIDTHS:
        if max_gap < 1 << (8 * w):
            return w
    raise AssertionError("gap does not fit 4 bytes; segments are smaller than 2^30")


def _planes(values: np.ndarray, nplanes: int, level: int) -> list[bytes]:
    """Compress the low ``nplanes`` byte planes of little-endian ``values``, one frame each."""
    k = values.size
    if values.dtype.itemsize == 1:
        return [compress(values, level)]
    as_bytes = values.view(np.uint8).reshape(k, values.dtype.itemsize)
    plane = SCRATCH.get("sp-enc-plane", k)
    frames = []
    for j in range(nplanes):
        np.copyto(plane, as_bytes[:, j])
        frames.append(compress(plane, level))
    return frames


def _width(nbytes: int, itemsize: int) -> int:
    return itemsize if itemsize in LE_UINT and nbytes % itemsize == 0 else 1


def join_segment_parts(parts: list, nbytes: int, itemsize: int, seg_elements: int, pack_head) -> Encoded | None:
    """One payload from a tensor's parts ``(entries, frames, compressed bytes, changed, ...)``, in
    segment order, behind the header ``pack_head(width, n, nseg)`` writes; None when nothing
    changed. Shared by the segmented encodings (sparse-v1 and sparse-v2)."""
    changed_elements = sum(p[3] for p in parts)
    if changed_elements == 0:
        return None
    width = _width(nbytes, itemsize)
    n = nbytes // width
    nseg = -(-n // seg_elements)
    entries = [e for p in parts for e in p[0]]
    if len(entries) != nseg:
        raise AssertionError(f"parts cover {len(entries)} of {nseg} segments")
    head = pack_head(width, n, nseg)
    return Encoded(b"".join([head, *entries, *(f for p in parts for f in p[1])]), sum(p[2] for p in parts),
                   changed_elements)


def encode_segment_range(old, new, itemsize: int, seg_elements: int, seg_range, encode_segment) -> tuple:
    """The segment loop both sparse encodings share: segments [a, b) of a tensor (all when
    ``seg_range`` is None) as (table entries, frames, changed bytes, changed elements), where
    ``encode_segment(o, nw, s0, s1, width)`` codes elements [s0, s1) of the unsigned views."""
    width = _width(new.nbytes, itemsize)
    dt = LE_UINT[width]
    o = old.reshape(-1).view(dt)
    nw = new.reshape(-1).view(dt)
    n = o.size
    first, stop = seg_range if seg_range is not None else (0, -(-n // seg_elements))
    entries: list[bytes] = []
    frames: list[bytes] = []
    changed_bytes = changed_elements = 0
    for s in range(first, stop):
        s0 = s * seg_elements
        entry, seg_frames, cb, count = encode_segment(o, nw, s0, min(n, s0 + seg_elements), width)
        entries.append(entry)
        frames.extend(seg_frames)
        changed_bytes += cb
        changed_elements += count
    return entries, frames, changed_bytes, changed_elements


class SparseCodec:
    name = "sparse-v1"
    seg_elements = SEG_ELEMENTS
    transform = TRANSFORM_NONE

    def encode(self, old, new, itemsize, level, tensor):
        return self.join([self.encode_part(old, new, itemsize, level, tensor, None)], new.nbytes, itemsize)

    def segment_count(self, nbytes: int, itemsize: int) -> int:
        return -(-(nbytes // _width(nbytes, itemsize)) // self.seg_elements)

    def encode_part(self, old, new, itemsize, level, tensor, seg_range: tuple[int, int] | None) -> tuple:
        """Segments [a, b) (all when None) as (table entries, frames, changed bytes, changed
        elements); ``join`` puts the parts of one tensor together, so several workers can
        encode one large tensor."""
        return encode_segment_range(
            old, new, itemsize, self.seg_elements, seg_range,
            lambda o, nw, s0, s1, width: self._encode_segment(o, nw, s0, s1, width, level),
        )

    def _encode_segment(self, o, nw, s0, s1, width, level) -> tuple:
        """One segment as (table entry, frames, changed bytes, changed elements)."""
        count, cb, gaps, signs, mags = self._diff_segment(o, nw, s0, s1, width)
        if count == 0:
            return ENTRY_HEAD.pack(0, 0, 0), [], cb, 0
        gw = _gap_width(int(gaps.max()))
        seg_frames = _planes(gaps, gw, level)
        seg_frames.append(compress(np.packbits(signs, bitorder="little"), level))
        big = SCRATCH.get("sp-enc-big", count).view(np.bool_)
        np.not_equal(mags, 0, out=big)
        seg_frames.append(compress(np.packbits(big, bitorder="little"), level))
        big_at = np.flatnonzero(big)  # cheaper than a boolean gather when the mask is unpredictable
        nbig = big_at.size
        if nbig:
            rest = np.take(mags, big_at)
            rest -= LE_UINT[width].type(1)
            seg_frames.extend(_planes(rest, width, level))
        entry = ENTRY_HEAD.pack(count, nbig, gw) + struct.pack(f"<{len(seg_frames)}I", *map(len, seg_frames))
        return entry, seg_frames, cb, count

    def join(self, parts: list, nbytes: int, itemsize: int) -> Encoded | None:
        """One payload from the parts of a tensor, in segment order; None when nothing changed."""
        return join_segment_parts(
            parts, nbytes, itemsize, self.seg_elements,
            lambda width, n, nseg: HEADER.pack(MAGIC, VERSION, width, self.transform, 0, n, self.seg_elements, nseg),
        )

    def _diff_segment(self, o, nw, s0, s1, width):
        """(count, changed bytes, gaps as <u4, sign flags, |difference| - 1) of elements [s0, s1)."""
        dt = o.dtype
        idt = _signed(dt)
        nseg = s1 - s0
        gaps_all = SCRATCH.get("sp-enc-gaps", 4 * nseg).view("<u4")
        mags_all = SCRATCH.get("sp-enc-mags", width * nseg).view(dt)
        signs_all = SCRATCH.get("sp-enc-signs", nseg).view(np.bool_)
        ne = SCRATCH.get("sp-enc-ne", min(ENCODE_BATCH, nseg)).view(np.bool_)
        count = changed_bytes = 0
        prev = -1  # last changed position, relative to s0
        for b0 in range(s0, s1, ENCODE_BATCH):
            b1 = min(s1, b0 + ENCODE_BATCH)
            m = ne[: b1 - b0]
            np.not_equal(o[b0:b1], nw[b0:b1], out=m)
            idx = np.flatnonzero(m)
            k = idx.size
            if k == 0:
                continue
            g = gaps_all[count : count + k]
            rel0 = b0 - s0
            g[0] = idx[0] + rel0 - prev - 1
            if k > 1:
                np.subtract(idx[1:], idx[:-1], out=g[1:], casting="unsafe")
                g[1:] -= np.uint32(1)
            prev = int(idx[-1]) + rel0
            idx += b0
            ov = o[idx]
            nv = nw[idx]
            changed_bytes += int(np.count_nonzero((ov ^ nv).view(np.uint8)))
            d = mags_all[count : count + k]
            if self.transform == TRANSFORM_FLOAT_ORDER:
                _to_order(ov, d)
                _to_order(nv, d)
            np.subtract(nv, ov, out=d)  # modular: exact for any pair
            ds = d.view(idt)
            np.less(ds, 0, out=signs_all[count : count + k])
            np.abs(ds, out=ds)  # -2^(b-1) stays itself, which read unsigned is 2^(b-1): right
            d -= dt.type(1)
            count += k
        return count, changed_bytes, gaps_all[:count], signs_all[:count], mags_all[:count]

    # --- check ----------------------------------------------------------------------------

    def check_structure(self, payload, tensor) -> Parsed:
        """Everything but the fit to the local tensor, at load, before any seed or write. The
        result is the payload's one parse of the pull: ``check_fit`` and ``apply`` take it."""
        return parse(payload, None, tensor, check_frames=True)

    def check_fit(self, structure: Parsed, nbytes, itemsize, tensor):
        if structure.nbytes != nbytes:
            raise PayloadBoundError(
                tensor, f"sparse-v1 payload covers {structure.nelements} x {structure.width} bytes, the tensor has {nbytes}"
            )

    def check(self, payload, nbytes, itemsize, tensor):
        parse(payload, nbytes, tensor, check_frames=True)

    # --- apply ----------------------------------------------------------------------------

    def apply(self, region, payload, itemsize, tensor, chunk_nbytes, structure=None):
        apply_sparse_chain(region, [payload], tensor, chunk_nbytes, hasher=None,
                           parsed=None if structure is None else [structure])

    def apply_chain(self, region, payloads, structures, tensor, chunk_nbytes, hasher, seg_range=None):
        apply_sparse_chain(region, payloads, tensor, chunk_nbytes, hasher, seg_range=seg_range, parsed=structures)

    def chain_segment_count(self, structures: list[Parsed]) -> int | None:
        return shared_segment_count(structures)

    def density(self, payload, nbytes, itemsize, tensor) -> PayloadDensity:
        """From the segment table alone: the header gives the tensor, the table the changed
        elements (changed bytes would need the old bytes)."""
        parsed = parse(payload, nbytes, tensor, check_frames=True)
        return PayloadDensity(parsed.nbytes, parsed.nelements, parsed.changed_elements(), None)


def parse(payload, nbytes: int | None, tensor: str, *, check_frames: bool = True) -> Parsed:
    """Read the header and segment table; prove every size (and, optionally, every frame's
    declared content size) without decompressing anything. ``nbytes`` None: any tensor length
    (the check against the local tensor comes later, from the result)."""
    mv = memoryview(payload).cast("B")
    total = mv.nbytes
    if total < HEADER.size:
        raise PayloadBoundError(tensor, f"sparse-v1 payload of {total} bytes is shorter than its {HEADER.size}-byte header")
    magic, version, width, transform, flags, n, seg, nseg = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadBoundError(tensor, f"sparse-v1 payload starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadBoundError(tensor, f"sparse-v1 payload version {version}, this reader knows {VERSION}")
    if width not in LE_UINT:
        raise PayloadBoundError(tensor, f"sparse-v1 element width {width}, expected 1, 2, 4 or 8")
    if transform not in (TRANSFORM_NONE, TRANSFORM_FLOAT_ORDER) or flags != 0:
        raise PayloadBoundError(tensor, f"sparse-v1 transform {transform} / flags {flags} unknown")
    if nbytes is not None and n * width != nbytes:
        raise PayloadBoundError(tensor, f"sparse-v1 payload covers {n} x {width} bytes, the tensor has {nbytes}")
    if not 1 <= seg <= MAX_SEG_ELEMENTS:
        raise PayloadBoundError(tensor, f"sparse-v1 segment size {seg} is outside [1, 2^30]")
    if seg < min(n, MIN_SEG_ELEMENTS):
        raise PayloadBoundError(
            tensor, f"sparse-v1 segment size {seg} is below the spec's minimum min(n, {MIN_SEG_ELEMENTS}) for {n} elements"
        )
    if nseg != -(-n // seg):
        raise PayloadBoundError(tensor, f"sparse-v1 declares {nseg} segments, {n} elements / {seg} need {-(-n // seg)}")
    if HEADER.size + ENTRY_HEAD.size * nseg > total:
        raise PayloadBoundError(tensor, f"sparse-v1 segment table of {nseg} entries runs past the {total}-byte payload")
    counts = np.zeros(nseg, np.uint32)
    nbigs = np.zeros(nseg, np.uint32)
    gap_widths = np.zeros(nseg, np.uint8)
    sizes_at = np.zeros(nseg, np.int64)
    streams_at = np.zeros(nseg, np.int64)
    pos = HEADER.size
    for s in range(nseg):
        if pos + ENTRY_HEAD.size > total:
            raise PayloadBoundError(tensor, f"sparse-v1 segment table truncated at segment {s}")
        count, nbig, gw = ENTRY_HEAD.unpack_from(mv, pos)
        if bytes(mv[pos + ENTRY_HEAD.size - 3 : pos + ENTRY_HEAD.size]) != b"\0\0\0":
            raise PayloadBoundError(tensor, f"sparse-v1 segment {s} has non-zero reserved bytes")
        pos += ENTRY_HEAD.size
        length = min(seg, n - s * seg)
        if count > length or nbig > count:
            raise PayloadBoundError(
                tensor, f"sparse-v1 segment {s} claims {count} changes ({nbig} large) in {length} elements"
            )
        if count == 0:
            if gw != 0:
                raise PayloadBoundError(tensor, f"sparse-v1 segment {s} has no changes but gap width {gw}")
            continue
        if gw not in GAP_WIDTHS:
            raise PayloadBoundError(tensor, f"sparse-v1 segment {s} gap width {gw}, expected 1, 2 or 4")
        nframes = gw + 2 + (width if nbig else 0)
        if pos + 4 * nframes > total:
            raise PayloadBoundError(tensor, f"sparse-v1 segment table truncated at segment {s}")
        counts[s], nbigs[s], gap_widths[s], sizes_at[s] = count, nbig, gw, pos
        pos += 4 * nframes
    for s in range(nseg):  # (no list of indices: a parse keeps ~25 bytes per segment, no more)
        count, nbig, gw = int(counts[s]), int(nbigs[s]), int(gap_widths[s])
        if count == 0:
            continue
        nframes = gw + 2 + (width if nbig else 0)
        streams_at[s] = pos
        contents = [count] * gw + [(count + 7) // 8] * 2 + [nbig] * (nframes - gw - 2)
        for size, content in zip(struct.unpack_from(f"<{nframes}I", mv, int(sizes_at[s])), contents):
            if pos + size > total:
                raise PayloadBoundError(tensor, f"sparse-v1 stream of {size} bytes at {pos} runs past the {total}-byte payload")
            if check_frames:
                check_frame(mv[pos : pos + size], content, tensor)
            pos += size
    if pos != total:
        raise PayloadBoundError(tensor, f"{total - pos} trailing bytes after the sparse-v1 streams")
    return Parsed(width, transform, n, seg, counts, nbigs, gap_widths, sizes_at, streams_at)


# --- apply ------------------------------------------------------------------------------


def _batch_changes(chunk_nbytes: int) -> int:
    # ~16 bytes of scratch per change (planes, int64 positions, values, temporaries); a
    # multiple of 8 so the bit-packed streams split on byte boundaries
    return max(1 << 12, (chunk_nbytes // 16) & ~7)


class _Source:
    """One stream of a segment: decompressed whole when it fits the batch, else streamed."""

    def __init__(self, frame, content: int, whole: bool, tensor: str, slot: int, scratch_key: str, batch_nbytes: int):
        self.tensor = tensor
        if whole:
            self.data: np.ndarray | None = np.frombuffer(decompress_exact(frame, content, tensor), np.uint8)
            self.reader: ExactReader | None = None
        else:
            self.data = None
            self.reader = ExactReader(frame, content, tensor, slot=slot)
            self.buf = SCRATCH.get(scratch_key, batch_nbytes)
        self.done = 0

    def take(self, k: int) -> np.ndarray:
        if self.reader is None:
            out = cast(np.ndarray, self.data)[self.done : self.done + k]  # whole: data is set
        else:
            out = self.buf[:k]
            self.reader.readinto(out.data)
        self.done += k
        return out


def _apply_segment(rw: np.ndarray, seg: Segment, transform: int, tensor: str, batch: int) -> None:
    """Apply one segment's changes in batches; every batch is range-checked before it is written."""
    count = seg.nchanged
    if count == 0:
        return
    dt = rw.dtype
    width = dt.itemsize
    idt = _signed(dt)
    batch = min(batch, count)
    whole = count <= batch
    slot = 0
    sources = []
    for j, f in enumerate(seg.gap_frames):
        sources.append(_Source(f, count, whole, tensor, slot, f"sp-g{j}", batch))
        slot += 1
    signs = _Source(seg.sign_frame, (count + 7) // 8, whole, tensor, slot, "sp-sign", batch // 8)
    bigs = _Source(seg.big_frame, (count + 7) // 8, whole, tensor, slot + 1, "sp-big", batch // 8)
    slot += 2
    big_planes = []
    for j, f in enumerate(seg.big_value_frames):
        big_planes.append(_Source(f, seg.nbig, seg.nbig <= batch, tensor, slot, f"sp-v{j}", batch))
        slot += 1
    pos_buf = SCRATCH.get("sp-pos", 8 * batch).view(np.int64)
    tmp_buf = SCRATCH.get("sp-tmp", 8 * batch).view(np.int64)
    d_buf = SCRATCH.get("sp-d", width * batch).view(dt)
    m_buf = SCRATCH.get("sp-m", width * batch).view(dt)
    o_buf = SCRATCH.get("sp-o", width * batch).view(dt)
    last = seg.start - 1  # absolute position of the previous change
    end = seg.start + seg.length
    done = 0
    nbig_seen = 0
    while done < count:
        k = min(batch, count - done)
        nb = (k + 7) // 8
        pos = pos_buf[:k]
        # positions: cumulative sum of (gap + 1), starting after the previous change
        for j, src in enumerate(sources):
            p = src.take(k)
            if j == 0:
                np.add(p, 1, out=pos, dtype=np.int64)
            else:
                np.left_shift(p, 8 * j, out=tmp_buf[:k], dtype=np.int64)
                pos += tmp_buf[:k]
        np.cumsum(pos, out=pos)
        pos += last
        if int(pos[-1]) >= end:
            raise PayloadBoundError(tensor, f"sparse-v1 position {int(pos[-1])} is past segment [{seg.start}, {end}) of the tensor")
        # magnitudes: 1, or 2 + the next large value
        d = d_buf[:k]
        d.fill(1)
        packed_big = bigs.take(nb)
        if done + k == count:
            _check_padding(packed_big, k, tensor, "large-value flags")
        # (flatnonzero on a bool view: several times faster than on the uint8 bits)
        big_at = np.flatnonzero(np.unpackbits(packed_big, count=k, bitorder="little").view(np.bool_))
        nbig = big_at.size
        if nbig:
            if nbig_seen + nbig > seg.nbig:
                raise PayloadBoundError(tensor, f"sparse-v1 flags more than the {seg.nbig} large values the table declares")
            big = m_buf[:nbig]
            if width == 1:
                big[:] = big_planes[0].take(nbig)
            else:
                bb = big.view(np.uint8).reshape(nbig, width)
                for j, src in enumerate(big_planes):
                    bb[:, j] = src.take(nbig)
            big += dt.type(2)
            d[big_at] = big
            nbig_seen += nbig
        # signs: negate where set (two's complement: (x ^ -1) + 1)
        packed_sign = signs.take(nb)
        if done + k == count:
            _check_padding(packed_sign, k, tensor, "signs")
        m = m_buf[:k]
        np.negative(np.unpackbits(packed_sign, count=k, bitorder="little"), out=m, dtype=dt, casting="unsafe")
        d ^= m
        d -= m
        if transform == TRANSFORM_FLOAT_ORDER:
            o = o_buf[:k]
            np.take(rw, pos, out=o)
            _to_order(o, m)
            o += d
            _from_order(o, m)
            rw[pos] = o
        else:
            rw[pos] += d
        last = int(pos[-1])
        done += k
    if nbig_seen != seg.nbig:
        raise PayloadBoundError(tensor, f"sparse-v1 segment flags {nbig_seen} large values, the table declares {seg.nbig}")


def _check_padding(packed: np.ndarray, k: int, tensor: str, what: str) -> None:
    rem = k % 8
    if rem and int(packed[-1]) >> rem:
        raise PayloadBoundError(tensor, f"sparse-v1 {what} have set bits past the last change")


def shared_segment_count(parsed: list[Parsed]) -> int | None:
    """The segment count of a chain whose payloads all segment the tensor alike, else None:
    only such a chain can be split by segment ranges across workers."""
    if not parsed or any(p.width != parsed[0].width or p.seg_elements != parsed[0].seg_elements for p in parsed):
        return None
    return parsed[0].nsegments


def apply_sparse_chain(
    region: np.ndarray, payloads: list, tensor: str, chunk_nbytes: int, hasher, seg_range: tuple[int, int] | None = None,
    parsed: list[Parsed] | None = None,
) -> None:
    """Apply several sparse-v1 payloads (oldest first) to ``region`` in place.

    With equal segmenting (what the encoder always writes) the chain runs segment-major:
    every payload's changes to one segment, then that segment is hashed while still in cache,
    so a catch-up over many versions touches the tensor's bytes once. ``seg_range`` applies
    only segments [a, b) (one worker's part of a large tensor; then the caller hashes, and the
    chain must segment alike: see ``shared_segment_count``). ``parsed``: the payloads' parses
    from the load (else they are parsed here)."""
    nbytes = region.nbytes
    if parsed is None:
        parsed = [parse(p, nbytes, tensor, check_frames=False) for p in payloads]
    batch = _batch_changes(chunk_nbytes)
    if not parsed:
        return
    for p in parsed:
        if p.nbytes != nbytes:
            raise PayloadBoundError(tensor, f"sparse-v1 payload covers {p.nelements} x {p.width} bytes, the tensor has {nbytes}")
    aligned = shared_segment_count(parsed) is not None
    if seg_range is not None and (not aligned or hasher is not None):
        raise ValueError("a segment range needs a chain that segments alike and no hasher")
    if not aligned:
        for payload, p in zip(payloads, parsed):
            rw = region.view(LE_UINT[p.width])
            for s in np.flatnonzero(p.counts).tolist():
                _apply_segment(rw, p.segment(payload, s), p.transform, tensor, batch)
        if hasher is not None:
            for pos in range(0, nbytes, chunk_nbytes):
                hasher.update(region[pos : pos + chunk_nbytes])
        return
    width, seg_elements = parsed[0].width, parsed[0].seg_elements
    rw = region.view(LE_UINT[width])
    first, stop = seg_range if seg_range is not None else (0, parsed[0].nsegments)
    for s in range(first, stop):
        for payload, p in zip(payloads, parsed):
            if p.counts[s]:
                _apply_segment(rw, p.segment(payload, s), p.transform, tensor, batch)
        if hasher is not None:
            start = s * seg_elements
            hasher.update(region[start * width : min(nbytes, (start + seg_elements) * width)])


CODEC: SparseCodec = SparseCodec()
