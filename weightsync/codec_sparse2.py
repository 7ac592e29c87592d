"""``sparse-v2``: sparse-v1's idea (only changed elements travel) with the change mask and the
differences coded per *class* of elements, a class being a range of the old element's
magnitude bits (spec: docs/FORMAT.md).

Why it is smaller: a bf16 ulp is proportional to |w| while an Adam step is about the same size
everywhere, so small-magnitude weights change far more often (and by more ulps) than large
ones. A coder that sees one stream pays the entropy of the average change rate; one stream
per class pays each class's own, which is what the receiver can predict from the old bytes it
already verified. The publisher picks each segment's class boundaries from the segment's own
statistics (a few bytes in the table); the receiver recomputes every element's class from the
old bytes before writing anything.

Invariants:
- exact for any bytes of any element width (classes only reorder what is coded; the
  difference is modular, as in sparse-v1);
- a class is a function of one element's old bytes, so segments stay independent: a chain of
  payloads is applied segment by segment, each payload against the bytes the previous one
  produced, and workers may split a tensor by segments;
- the payload is self-delimiting and every size is proven from headers at load: member and
  change counts per class add up to the segment, each frame's declared content size follows
  from them; at apply the member counts recomputed from the local bytes must equal the
  declared ones before the segment is written (a local tensor that is not the base version
  fails there, not after);
- memory per worker is bounded by the segment size (at most 2^20 elements), never by the
  tensor or by anything else the payload declares.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from .codec_sparse import LE_UINT, _gap_width, _planes, _signed, _width, encode_segment_range
from .codecs import SCRATCH, Encoded, PayloadDensity, register_codec
from .errors import LocalTensorMismatchError, PayloadBoundError
from .zstd_frames import check_frame, compress, decompress_exact

MAGIC = b"WSS2"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQII")  # magic, version, width, reserved, flags, nelements, seg_elements, nsegments
CLASS_HEAD = struct.Struct("<IIBB2x")  # members, changes, mask mode, magnitude planes, reserved
MAX_CLASSES = 8
MIN_SEG_ELEMENTS = 1 << 12  # a table entry per 4 Ki elements at most: parsing work tied to the tensor
MAX_SEG_ELEMENTS = 1 << 20  # bounds a worker's scratch (positions of one class: 8 bytes per element)
SEG_ELEMENTS = 1 << 20  # what the encoder writes
MASK_NONE, MASK_BITMAP = 0, 8  # mask modes besides the gap widths 1, 2 and 4
GAP_WIDTHS = (1, 2, 4)
# The key of an element: the top 8 bits of its magnitude (the bits below the sign): for bf16 and
# fp32 exactly the exponent, for fp16 the exponent and the top 3 mantissa bits.
KEY_SHIFT = {1: 0, 2: 7, 4: 23, 8: 55}
NKEYS = {1: 128, 2: 256, 4: 256, 8: 256}
# The size/cost rule: a class costs the puller one pass over the segment (a compare and a
# flatnonzero, ~1 ns per element), so a segment gets another class only when it saves at least
# this many bytes per element of the segment, plus the frames' own overhead.
CLASS_MIN_SAVING = 1 / 512
CLASS_OVERHEAD_BYTES = 48
STATS_STRIDE = 4  # element counts per key are estimated on every 4th element (boundaries only)


class ClassPart(NamedTuple):
    lo: int  # magnitude range [lo, hi) of the class, in element units
    hi: int
    members: int
    changes: int
    mask_mode: int  # 0 none, 1/2/4 gap plane width, 8 bitmap
    mag_planes: int
    mask_frames: list[memoryview]
    sign_frame: memoryview | None
    mag_frames: list[memoryview]


class Segment(NamedTuple):
    start: int
    length: int
    nchanged: int
    classes: list[ClassPart]


class Parsed(NamedTuple):
    width: int
    nelements: int
    seg_elements: int
    segments: list[Segment]


def _mag_mask(width: int) -> int:
    return (1 << (8 * width - 1)) - 1


# --- choosing classes -------------------------------------------------------------------


def _binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        q = 1.0 - p
        h = -(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0.0) + np.where(q > 0, q * np.log2(np.where(q > 0, q, 1)), 0.0))
    return n * h


def choose_boundaries(members_per_key: np.ndarray, changes_per_key: np.ndarray, penalty_bits: float) -> list[int]:
    """Class boundaries (keys where a class starts, the first class starting at 0 implied) that
    minimise the mask's conditional entropy plus ``penalty_bits`` per class beyond the first
    (the size/cost rule).
    Exact dynamic programme over the keys present (at most 256): intervals are contiguous
    because the change rate falls with the magnitude."""
    present = np.flatnonzero(members_per_key)
    m = present.size
    if m <= 1:
        return []
    cn = np.concatenate([[0.0], np.cumsum(members_per_key[present], dtype=np.float64)])
    ck = np.concatenate([[0.0], np.cumsum(changes_per_key[present], dtype=np.float64)])
    # cost[a, b]: bits of the mask of present keys [a, b) as one class
    n = cn[None, :] - cn[:, None]
    k = ck[None, :] - ck[:, None]
    cost = np.where(n > 0, _binary_entropy_bits(np.maximum(n, 0), np.maximum(k, 0)), np.inf)
    cost[np.tril_indices(m + 1)] = np.inf
    penalty = penalty_bits
    best = cost[0].copy()  # one class covering [0, b)
    back: list[np.ndarray] = []
    choice = (best[m], 1)
    for c in range(2, min(MAX_CLASSES, m) + 1):
        total = best[:, None] + cost  # [a, b]: best with c-1 classes up to a, then [a, b)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(m + 1)]
        back.append(arg)
        if best[m] + penalty * (c - 1) < choice[0] + penalty * (choice[1] - 1):
            choice = (best[m], c)
    c = choice[1]
    starts = []
    b = m
    for arg in reversed(back[: c - 1]):
        b = int(arg[b])
        starts.append(b)
    return [int(present[s]) for s in reversed(starts)]


# --- encode -----------------------------------------------------------------------------


class Layout(NamedTuple):
    """What a pull keeps of a sparse-v2 payload between its load and its apply (the header)."""

    width: int
    nelements: int
    seg_elements: int
    nsegments: int


class Sparse2Codec:
    name = "sparse-v2"

    def __init__(self, seg_elements: int = SEG_ELEMENTS, class_min_saving: float = CLASS_MIN_SAVING,
                 class_overhead_bytes: int = CLASS_OVERHEAD_BYTES):
        self.seg_elements = seg_elements
        self.class_min_saving = class_min_saving
        self.class_overhead_bytes = class_overhead_bytes

    def encode(self, old, new, itemsize, level, tensor):
        return self.join([self.encode_part(old, new, itemsize, level, tensor, None)], new.nbytes, itemsize)

    def segment_count(self, nbytes: int, itemsize: int) -> int:
        return -(-(nbytes // _width(nbytes, itemsize)) // self.seg_elements)

    def encode_part(self, old, new, itemsize, level, tensor, seg_range: tuple[int, int] | None) -> tuple:
        """Segments [a, b) (all when None) as (table entries, frames, changed bytes, changed
        elements), the form ``join`` takes."""
        return encode_segment_range(
            old, new, itemsize, self.seg_elements, seg_range,
            lambda o, nw, s0, s1, width: self._encode_segment(o[s0:s1], nw[s0:s1], width, level),
        )

    def join(self, parts: list, nbytes: int, itemsize: int) -> Encoded | None:
        changed_elements = sum(p[3] for p in parts)
        if changed_elements == 0:
            return None
        width = _width(nbytes, itemsize)
        n = nbytes // width
        nseg = -(-n // self.seg_elements)
        entries = [e for p in parts for e in p[0]]
        if len(entries) != nseg:
            raise AssertionError(f"parts cover {len(entries)} of {nseg} segments")
        head = HEADER.pack(MAGIC, VERSION, width, 0, 0, n, self.seg_elements, nseg)
        return Encoded(b"".join([head, *entries, *(f for p in parts for f in p[1])]), sum(p[2] for p in parts),
                       changed_elements)

    def _encode_segment(self, o: np.ndarray, nw: np.ndarray, width: int, level: int):
        dt = o.dtype
        length = o.size
        ne = SCRATCH.get("sp2-enc-ne", length).view(np.bool_)
        np.not_equal(o, nw, out=ne)
        idx = np.flatnonzero(ne)
        k = idx.size
        if k == 0:
            return b"\0", [], 0, 0
        ov = o[idx]
        nv = nw[idx]
        changed_bytes = int(np.count_nonzero((ov ^ nv).view(np.uint8)))
        d = np.subtract(nv, ov)  # modular: exact for any pair
        ds = d.view(_signed(dt))
        signs = ds < 0
        np.abs(ds, out=ds)  # -2^(b-1) stays itself, which read unsigned is 2^(b-1): right
        d -= dt.type(1)  # magnitude - 1
        mag = dt.type(_mag_mask(width))
        shift = KEY_SHIFT[width]
        nkeys = NKEYS[width]
        v = SCRATCH.get("sp2-enc-v", width * length).view(dt)
        np.bitwise_and(o, mag, out=v)
        keys_changed = (v[idx] >> dt.type(shift)).astype(np.intp)
        stride = STATS_STRIDE if length >= 1 << 16 else 1
        members = np.bincount((v[::stride] >> dt.type(shift)).astype(np.intp), minlength=nkeys) * stride
        changes = np.bincount(keys_changed, minlength=nkeys)
        members = np.maximum(members, changes)  # the estimate never below what changed
        starts = choose_boundaries(members, changes, 8.0 * (length * self.class_min_saving + self.class_overhead_bytes))
        bounds = [0, *starts, nkeys]
        entry = [struct.pack("<B", len(bounds) - 1), bytes(starts)]
        seg_frames: list[bytes] = []
        class_of_key = np.zeros(nkeys, np.uint8)
        for b in starts:
            class_of_key[b:] += 1
        cls_of_change = np.take(class_of_key, keys_changed)
        sel = SCRATCH.get("sp2-enc-sel", length).view(np.bool_)
        for c in range(len(bounds) - 1):
            lo, hi = bounds[c] << shift, bounds[c + 1] << shift
            if len(bounds) == 2:
                at = None
                kc, members_c, local = k, length, idx
            else:
                at = np.flatnonzero(cls_of_change == c)
                kc = at.size
                _select(v, lo, hi, width, sel)
                members_c, local = _ranks(sel, idx[at])
            if kc == 0:
                entry.append(CLASS_HEAD.pack(members_c, 0, MASK_NONE, 0))
                continue
            if 4 * kc >= members_c:
                mode = MASK_BITMAP
                chm = np.zeros(members_c, np.bool_)
                chm[local] = True
                cframes = [compress(np.packbits(chm, bitorder="little"), level)]
            else:
                gaps = np.empty(kc, "<u4")
                gaps[0] = local[0]
                np.subtract(local[1:], local[:-1], out=gaps[1:], casting="unsafe")
                gaps[1:] -= np.uint32(1)
                mode = _gap_width(int(gaps.max()))
                cframes = _planes(gaps, mode, level)
            sc = signs if at is None else signs[at]
            dc = d if at is None else d[at]
            cframes.append(compress(np.packbits(sc, bitorder="little"), level))
            top = int(dc.max())
            nplanes = (top.bit_length() + 7) // 8
            if nplanes:
                cframes.extend(_planes(dc, nplanes, level))
            entry.append(CLASS_HEAD.pack(members_c, kc, mode, nplanes) + struct.pack(f"<{len(cframes)}I", *map(len, cframes)))
            seg_frames.extend(cframes)
        return b"".join(entry), seg_frames, changed_bytes, k

    # --- check ----------------------------------------------------------------------------

    def check_structure(self, payload, tensor) -> "Layout":
        """Everything but the fit to the local tensor: at load, before any seed or write. Keeps
        only the header's layout (the apply parses the table again, without the frame checks)."""
        mv = memoryview(payload).cast("B")
        if mv.nbytes < HEADER.size:
            raise PayloadBoundError(tensor, f"sparse-v2 payload of {mv.nbytes} bytes is shorter than its {HEADER.size}-byte header")
        _, _, width, _, _, n, seg, nseg = HEADER.unpack_from(mv, 0)
        parse(payload, n * width, tensor, check_frames=True)
        return Layout(width, n, seg, nseg)

    def check_fit(self, structure: "Layout", nbytes, itemsize, tensor):
        if structure.nelements * structure.width != nbytes:
            raise PayloadBoundError(
                tensor, f"sparse-v2 payload covers {structure.nelements} x {structure.width} bytes, the tensor has {nbytes}"
            )

    def check(self, payload, nbytes, itemsize, tensor):
        parse(payload, nbytes, tensor, check_frames=True)

    def apply(self, region, payload, itemsize, tensor, chunk_nbytes, structure=None):
        apply_sparse2_chain(region, [payload], tensor, chunk_nbytes, hasher=None)

    def apply_chain(self, region, payloads, structures, tensor, chunk_nbytes, hasher, seg_range=None):
        apply_sparse2_chain(region, payloads, tensor, chunk_nbytes, hasher, seg_range=seg_range)

    def chain_segment_count(self, structures: list["Layout"]) -> int | None:
        if not structures or any((l.width, l.seg_elements) != (structures[0].width, structures[0].seg_elements) for l in structures):
            return None
        return structures[0].nsegments

    def density(self, payload, nbytes, itemsize, tensor) -> PayloadDensity:
        """From the segment table alone, like sparse-v1 (changed bytes would need the old bytes)."""
        mv = memoryview(payload).cast("B")
        if mv.nbytes < HEADER.size:
            raise PayloadBoundError(tensor, f"sparse-v2 payload of {mv.nbytes} bytes is shorter than its {HEADER.size}-byte header")
        _, _, width, _, _, n, _, _ = HEADER.unpack_from(mv, 0)
        parsed = parse(payload, n * width if nbytes is None else nbytes, tensor, check_frames=True)
        changed = sum(seg.nchanged for seg in parsed.segments)
        return PayloadDensity(parsed.nelements * parsed.width, parsed.nelements, changed, None)


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _popcount(packed: np.ndarray) -> np.ndarray:
    count = getattr(np, "bitwise_count", None)  # numpy >= 2
    return count(packed) if count is not None else np.take(_POPCOUNT, packed)


def _ranks(sel: np.ndarray, at: np.ndarray) -> tuple[int, np.ndarray]:
    """(members of ``sel``, rank among them of each position in ``at``, all members): a
    popcount prefix over the packed mask, so no pass writes a position per element."""
    packed = np.packbits(sel, bitorder="little")
    prefix = np.empty(packed.size + 1, np.int64)
    prefix[0] = 0
    np.cumsum(_popcount(packed), out=prefix[1:])
    byte = at >> 3
    below = packed[byte] & ((np.left_shift(1, at & 7)) - 1).astype(np.uint8)
    return int(prefix[-1]), prefix[byte] + _popcount(below)


POSITION_BLOCK = 1 << 14  # members listed per block: small, reused allocations that stay in cache


def _member_positions(sel: np.ndarray, local: np.ndarray) -> tuple[int, np.ndarray]:
    """(members of ``sel``, the positions of the members whose indices ``local`` lists,
    ascending). Members are listed block by block: one list for a whole segment would be a
    fresh multi-megabyte allocation per class, whose page faults cost more than the scan."""
    out = np.empty(local.size, np.int64)
    members = 0
    done = 0
    for b0 in range(0, sel.size, POSITION_BLOCK):
        at = np.flatnonzero(sel[b0 : b0 + POSITION_BLOCK])
        end = done + int(np.searchsorted(local[done:], members + at.size))
        if end > done:
            np.add(at[local[done:end] - members], b0, out=out[done:end])
        members += at.size
        done = end
    return members, out


def _select(v: np.ndarray, lo: int, hi: int, width: int, out: np.ndarray) -> None:
    """out = lo <= v < hi, for magnitudes v (the top bit is clear, so hi may be 2^(8w-1))."""
    dt = v.dtype
    if lo == 0 and hi > _mag_mask(width):
        out.fill(True)
        return
    if lo == 0:
        np.less(v, dt.type(hi), out=out)
        return
    if hi > _mag_mask(width):
        np.greater_equal(v, dt.type(lo), out=out)
        return
    t = SCRATCH.get("sp2-sel-t", v.nbytes).view(dt)
    np.subtract(v, dt.type(lo), out=t)  # wraps below lo: one unsigned compare covers both ends
    np.less(t, dt.type(hi - lo), out=out)


def parse(payload, nbytes: int, tensor: str, *, check_frames: bool = True) -> Parsed:
    """Read the header and segment table; prove every size (and, optionally, every frame's
    declared content size) without decompressing anything."""
    mv = memoryview(payload).cast("B")
    total = mv.nbytes
    if total < HEADER.size:
        raise PayloadBoundError(tensor, f"sparse-v2 payload of {total} bytes is shorter than its {HEADER.size}-byte header")
    magic, version, width, reserved, flags, n, seg, nseg = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadBoundError(tensor, f"sparse-v2 payload starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadBoundError(tensor, f"sparse-v2 payload version {version}, this reader knows {VERSION}")
    if width not in LE_UINT:
        raise PayloadBoundError(tensor, f"sparse-v2 element width {width}, expected 1, 2, 4 or 8")
    if reserved != 0 or flags != 0:
        raise PayloadBoundError(tensor, f"sparse-v2 reserved byte {reserved} / flags {flags} must be 0")
    if n * width != nbytes:
        raise PayloadBoundError(tensor, f"sparse-v2 payload covers {n} x {width} bytes, the tensor has {nbytes}")
    if not MIN_SEG_ELEMENTS <= seg <= MAX_SEG_ELEMENTS:
        raise PayloadBoundError(tensor, f"sparse-v2 segment size {seg} is outside [2^12, 2^20]")
    if nseg != -(-n // seg):
        raise PayloadBoundError(tensor, f"sparse-v2 declares {nseg} segments, {n} elements / {seg} need {-(-n // seg)}")
    if HEADER.size + nseg > total:
        raise PayloadBoundError(tensor, f"sparse-v2 segment table of {nseg} entries runs past the {total}-byte payload")
    shift = KEY_SHIFT[width]
    nkeys = NKEYS[width]
    pos = HEADER.size
    table: list[tuple[int, int, list[tuple[int, int, int, int, int, int, tuple[int, ...]]]]] = []  # start, length, classes
    for s in range(nseg):
        start = s * seg
        length = min(seg, n - start)
        if pos + 1 > total:
            raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
        nclasses = mv[pos]
        pos += 1
        if nclasses == 0:
            table.append((start, length, []))
            continue
        if nclasses > MAX_CLASSES:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} declares {nclasses} classes, at most {MAX_CLASSES}")
        if pos + nclasses - 1 > total:
            raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
        starts = list(mv[pos : pos + nclasses - 1])
        pos += nclasses - 1
        bounds = [0, *starts, nkeys]
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class boundaries {starts} are not increasing inside (0, {nkeys})")
        classes = []
        members_sum = 0
        changes_sum = 0
        for c in range(nclasses):
            if pos + CLASS_HEAD.size > total:
                raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
            members, changes, mode, planes = CLASS_HEAD.unpack_from(mv, pos)
            if bytes(mv[pos + CLASS_HEAD.size - 2 : pos + CLASS_HEAD.size]) != b"\0\0":
                raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class {c} has non-zero reserved bytes")
            pos += CLASS_HEAD.size
            if changes > members:
                raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class {c} claims {changes} changes in {members} members")
            if changes == 0:
                if mode != MASK_NONE or planes != 0:
                    raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class {c} has no changes but mask mode {mode} / {planes} planes")
                nframes = 0
            else:
                if mode not in (*GAP_WIDTHS, MASK_BITMAP):
                    raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class {c} mask mode {mode}, expected 1, 2, 4 or 8")
                if planes > width:
                    raise PayloadBoundError(tensor, f"sparse-v2 segment {s} class {c} has {planes} magnitude planes, the width is {width}")
                nframes = (1 if mode == MASK_BITMAP else mode) + 1 + planes
            if pos + 4 * nframes > total:
                raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
            sizes = struct.unpack_from(f"<{nframes}I", mv, pos)
            pos += 4 * nframes
            members_sum += members
            changes_sum += changes
            classes.append((bounds[c] << shift, bounds[c + 1] << shift, members, changes, mode, planes, sizes))
        if members_sum != length:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} classes have {members_sum} members, the segment {length} elements")
        if changes_sum == 0:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} declares classes but no change (write 0 classes)")
        table.append((start, length, classes))
    segments: list[Segment] = []
    for start, length, classes in table:
        parts: list[ClassPart] = []
        nchanged = 0
        for lo, hi, members, changes, mode, planes, sizes in classes:
            if changes == 0:
                parts.append(ClassPart(lo, hi, members, 0, MASK_NONE, 0, [], None, []))
                continue
            nmask = 1 if mode == MASK_BITMAP else mode
            contents = [(members + 7) // 8] if mode == MASK_BITMAP else [changes] * mode
            contents += [(changes + 7) // 8] + [changes] * planes
            frames: list[memoryview] = []
            for size, content in zip(sizes, contents):
                if pos + size > total:
                    raise PayloadBoundError(tensor, f"sparse-v2 stream of {size} bytes at {pos} runs past the {total}-byte payload")
                frame = mv[pos : pos + size]
                if check_frames:
                    check_frame(frame, content, tensor)
                frames.append(frame)
                pos += size
            parts.append(ClassPart(lo, hi, members, changes, mode, planes, frames[:nmask], frames[nmask], frames[nmask + 1 :]))
            nchanged += changes
        segments.append(Segment(start, length, nchanged, parts))
    if pos != total:
        raise PayloadBoundError(tensor, f"{total - pos} trailing bytes after the sparse-v2 streams")
    return Parsed(width, n, seg, segments)


# --- apply ------------------------------------------------------------------------------


def _apply_segment(rw: np.ndarray, seg: Segment, tensor: str, index: int) -> None:
    """Every class's positions from the old bytes first (a change may move an element to
    another class), each proven against the declared member count; then the writes."""
    if seg.nchanged == 0:
        return
    dt = rw.dtype
    width = dt.itemsize
    view = rw[seg.start : seg.start + seg.length]
    single = len(seg.classes) == 1
    if not single:
        v = SCRATCH.get("sp2-v", width * seg.length).view(dt)
        np.bitwise_and(view, dt.type(_mag_mask(width)), out=v)
        sel = SCRATCH.get("sp2-sel", seg.length).view(np.bool_)
    writes = []
    for c, part in enumerate(seg.classes):
        if part.changes == 0:
            continue
        local = _decode_mask(part, tensor, index, c)  # proven below the declared member count
        positions = local
        if not single:
            _select(v, part.lo, part.hi, width, sel)
            members, positions = _member_positions(sel, local)
            if members != part.members:
                raise LocalTensorMismatchError(
                    tensor,
                    f"sparse-v2 segment {index} class {c}: the local bytes hold {members} elements of magnitude "
                    f"[{part.lo:#x}, {part.hi:#x}), the payload was encoded against {part.members}",
                )
        writes.append((positions, _decode_differences(part, dt, tensor, index, c)))
    for positions, d in writes:
        view[positions] += d


def _decode_mask(part: ClassPart, tensor: str, index: int, c: int) -> np.ndarray:
    """Class-local indices of the changes, ascending, each proven below the member count."""
    k = part.changes
    if part.mask_mode == MASK_BITMAP:
        packed = np.frombuffer(decompress_exact(part.mask_frames[0], (part.members + 7) // 8, tensor), np.uint8)
        _check_padding(packed, part.members, tensor, "change bitmap")
        local = np.flatnonzero(np.unpackbits(packed, count=part.members, bitorder="little").view(np.bool_))
        if local.size != k:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c} bitmap marks {local.size} changes, the table declares {k}")
        return local
    local = np.empty(k, np.int64)
    tmp = np.empty(k, np.int64)
    for j, frame in enumerate(part.mask_frames):
        plane = np.frombuffer(decompress_exact(frame, k, tensor), np.uint8)
        if j == 0:
            np.add(plane, 1, out=local, dtype=np.int64)
        else:
            np.left_shift(plane, 8 * j, out=tmp, dtype=np.int64)
            local += tmp
    np.cumsum(local, out=local)
    local -= 1
    if int(local[-1]) >= part.members:
        raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c} change {int(local[-1])} is past its {part.members} members")
    return local


def _decode_differences(part: ClassPart, dt: np.dtype, tensor: str, index: int, c: int) -> np.ndarray:
    """(new - old) modulo 2^bits of each change: sign bit and magnitude - 1 in byte planes."""
    k = part.changes
    width = dt.itemsize
    d = np.zeros(k, dt) if part.mag_planes else np.ones(k, dt)
    if part.mag_planes:
        db = d.view(np.uint8).reshape(k, width)
        for j, frame in enumerate(part.mag_frames):
            db[:, j] = np.frombuffer(decompress_exact(frame, k, tensor), np.uint8)
        if part.mag_planes == width and int(db[:, width - 1].max()) >= 0x80:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c} has a magnitude of 2^{8 * width - 1} or more")
        d += dt.type(1)
    packed = np.frombuffer(decompress_exact(part.sign_frame, (k + 7) // 8, tensor), np.uint8)
    _check_padding(packed, k, tensor, "signs")
    m = np.negative(np.unpackbits(packed, count=k, bitorder="little"), dtype=dt, casting="unsafe")
    d ^= m  # two's complement where the sign is set: (x ^ -1) + 1
    d -= m
    return d


def _check_padding(packed: np.ndarray, k: int, tensor: str, what: str) -> None:
    rem = k % 8
    if rem and int(packed[-1]) >> rem:
        raise PayloadBoundError(tensor, f"sparse-v2 {what} have set bits past the last element")


def apply_sparse2_chain(
    region: np.ndarray, payloads: list, tensor: str, chunk_nbytes: int, hasher, seg_range: tuple[int, int] | None = None
) -> None:
    """Apply several sparse-v2 payloads (oldest first) to ``region`` in place, segment-major:
    each payload's changes to a segment against the bytes the previous payload left there,
    then the segment is hashed while in cache. ``seg_range``: only segments [a, b) (a worker's
    part; the caller hashes; the chain must segment alike)."""
    nbytes = region.nbytes
    parsed = [parse(p, nbytes, tensor, check_frames=False) for p in payloads]
    if not parsed:
        return
    aligned = all(p.width == parsed[0].width and p.seg_elements == parsed[0].seg_elements for p in parsed)
    if seg_range is not None and (not aligned or hasher is not None):
        raise ValueError("a segment range needs a chain that segments alike and no hasher")
    if not aligned:
        for p in parsed:
            rw = region.view(LE_UINT[p.width])
            for i, seg in enumerate(p.segments):
                _apply_segment(rw, seg, tensor, i)
        if hasher is not None:
            for pos in range(0, nbytes, chunk_nbytes):
                hasher.update(region[pos : pos + chunk_nbytes])
        return
    width = parsed[0].width
    rw = region.view(LE_UINT[width])
    first, stop = seg_range if seg_range is not None else (0, len(parsed[0].segments))
    for s in range(first, stop):
        seg0 = parsed[0].segments[s]
        for p in parsed:
            _apply_segment(rw, p.segments[s], tensor, s)
        if hasher is not None:
            hasher.update(region[seg0.start * width : (seg0.start + seg0.length) * width])


CODEC = Sparse2Codec()
register_codec(CODEC)
