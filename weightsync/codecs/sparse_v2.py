"""``sparse-v2``: sparse-v1's idea (only changed elements travel) with every stream coded per
*class* of elements, a class being a range of the old element's magnitude bits, and each
stream Golomb-Rice coded instead of zstd'd byte planes (spec: docs/FORMAT.md).

Why it is smaller: a bf16 ulp is proportional to |w| while an Adam step is about the same size
everywhere, so small-magnitude weights change far more often (and by more ulps) than large
ones. One stream per class pays each class's own change rate, which is what the receiver can
predict from the old bytes it already verified. Within a class the changes are close to a
Bernoulli source, whose gaps are geometric: a Rice code with the class's own parameter is
within a few percent of their entropy, where zstd over gap bytes lost ~20%.

Every stream decodes with a few whole-array numpy operations (no per-element Python loop): a
Rice stream is two parts, the k-bit remainders packed at a fixed width and the quotients in
unary, whose terminators ``np.flatnonzero`` finds in the unpacked bits.

Bitstream 3 (the default where the compiled coder is built) codes the same changes with an
adaptive binary range coder instead: one decision per element of a segment, whose probability
follows the old element's key and how many of the previous 64 elements changed (a row that
moves, moves together), then the sign and size of each change, each with the key as context.
That is 0.64-0.71x sparse-v1's bytes on the benchmark's realistic steps (bitstream 2: 0.72-0.77x),
and its decoder is compiled (``_sparse2_rc.c``): a per-element coder is 50-150 ns an element in
numpy. Bitstream 2 stays readable, and is what a publisher without the compiled coder writes.

Invariants:
- exact for any bytes of any element width (classes only reorder what is coded; the
  difference is modular, as in sparse-v1);
- a class is a function of one element's old bytes, so segments stay independent: a chain of
  payloads is applied segment by segment, each payload against the bytes the previous one
  produced, and workers may split a tensor by segments;
- the payload is self-delimiting and every size is proven from the table at load, before any
  write: counts per class add up to the segment, every part's length follows from the counts
  or is declared and bounded by them, so decoding work is tied to the segment; at apply the
  member counts recomputed from the local bytes must equal the declared ones before the
  segment is written (a local tensor that is not the base version fails there, not after);
- memory per worker is bounded by the segment size (at most 2^20 elements), never by the
  tensor or by anything else the payload declares.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from .. import knobs
from ..errors import CoderUnavailableError, InvalidKnobError, LocalTensorMismatchError, PayloadBoundError
from .base import SCRATCH, Encoded, PayloadDensity
from .sparse_v1 import LE_UINT, _from_order, _signed, _to_order, _width, encode_segment_range, join_segment_parts

try:  # bitstream 3's range coder, built with the package (setup.py; scripts/setup_env.sh)
    from . import _sparse2_rc as _rc  # type: ignore[attr-defined]
except ImportError:  # an install built without a C compiler: bitstream 2 only
    _rc = None

MAGIC = b"WSS2"
VERSION = 2  # magnitude classes, Rice / Exp-Golomb streams (numpy)
VERSION_RC = 3  # adaptive binary range coder (compiled)
VERSIONS = (VERSION, VERSION_RC)
RC_ENTRY = struct.Struct("<II")  # bitstream 3's segment entry: changes, coded bytes
RC_MIN_PART = 5  # the coder's start bytes: a segment with changes codes at least these
HEADER = struct.Struct("<4sBBBBQII")  # magic, version, width, reserved, flags, nelements, seg_elements, nsegments
# members, changes, large changes, flagged large changes; mask mode, gap parameter, flag mode,
# flag parameter, value order base and shift, the key range whose large changes are flagged
CLASS_HEAD = struct.Struct("<IIIIBBBBBBBB")
MAX_CLASSES = 8
MIN_SEG_ELEMENTS = 1 << 12  # a table entry per 4 Ki elements at most: parsing work tied to the tensor
MAX_SEG_ELEMENTS = 1 << 20  # bounds a worker's scratch (positions of one class: 8 bytes per element)
SEG_ELEMENTS = 1 << 20  # what the encoder writes
MODE_NONE, MODE_RICE, MODE_BITMAP, MODE_RICE_OTHERS = 0, 1, 2, 3  # 3: flags only, the candidates not large
MAX_GAP_PARAM = 20  # gaps are below seg <= 2^20
# The key of an element: the top 8 bits of its magnitude (the bits below the sign): for bf16 and
# fp32 exactly the exponent, for fp16 the exponent and the top 3 mantissa bits.
KEY_SHIFT = {1: 0, 2: 7, 4: 23, 8: 55}
NKEYS = {1: 128, 2: 256, 4: 256, 8: 256}
# The size/cost rule: a class costs the puller one pass over the segment (a compare and a
# flatnonzero, ~1-1.5 ns per element), so a segment gets another class only when it saves at
# least knobs.SPARSE2_CLASS_MIN_SAVING bytes per element of the segment, plus the class's own
# table bytes.
CLASS_OVERHEAD_BYTES = 32
STATS_STRIDE = 4  # element counts per key are estimated on every 4th element (boundaries only)


class Rice(NamedTuple):
    """One Rice-coded sequence of ``nvalues`` integers: remainders, then quotients in unary."""

    nvalues: int
    param: int
    rem: memoryview
    quo: memoryview


class Values(NamedTuple):
    """The Exp-Golomb coded |d| - 2 of a class's large changes: fields, then lengths in unary;
    each value's order follows from ``a``, ``shift`` and the old element's key."""

    nvalues: int
    a: int
    shift: int
    rem: memoryview
    quo: memoryview


class ClassPart(NamedTuple):
    lo: int  # magnitude range [lo, hi) of the class, in element units
    hi: int
    members: int
    changes: int
    nbig: int  # changes with |d| > 1
    nflag: int  # of them, those with an old key in [flag_lo, flag_hi] (the others follow from the key)
    flag_lo: int  # a change whose old key is below is large; above flag_hi, not large
    flag_hi: int
    mask_mode: int
    mask: Rice | memoryview | None  # Rice gaps, or a bitmap of the members
    signs: memoryview | None
    flag_mode: int
    flags: Rice | memoryview | None  # Rice gaps among the flag candidates, or a bitmap of them
    values: Values | None  # |d| - 2 of each large change


class Segment(NamedTuple):
    start: int
    length: int
    nchanged: int
    classes: list[ClassPart]


class CodedSegment(NamedTuple):
    """Bitstream 3: one segment's changes as one range-coded part."""

    start: int
    length: int
    nchanged: int
    coded: memoryview


class Parsed(NamedTuple):
    width: int
    nelements: int
    seg_elements: int
    segments: "list[Segment | CodedSegment]"


def compiled_coder_available() -> bool:
    return _rc is not None


def writer_bitstream() -> int:
    """The bitstream a publisher writes now: the knob's, and 2 where the compiled coder is missing."""
    wanted = knobs.SPARSE2_BITSTREAM.get()
    if wanted not in VERSIONS:
        raise InvalidKnobError(knobs.SPARSE2_BITSTREAM.env, str(wanted), f"one of {list(VERSIONS)}")
    return VERSION_RC if wanted == VERSION_RC and _rc is not None else VERSION


def _mag_mask(width: int) -> int:
    return (1 << (8 * width - 1)) - 1


# --- Rice streams -----------------------------------------------------------------------


def rice_bits(x: np.ndarray, r: int) -> int:
    """Bits of ``x`` (non-negative) Rice-coded with parameter ``r``."""
    return x.size * (r + 1) + int(np.right_shift(x, r).sum(dtype=np.uint64))


def best_rice_param(x: np.ndarray, max_param: int) -> tuple[int, int]:
    """(parameter, bits) minimising the Rice code of ``x``: the optimum lies next to
    log2(mean * ln 2) for a geometric source; the neighbours are tried exactly."""
    mean = float(x.mean(dtype=np.float64)) if x.size else 0.0
    r0 = int(math.floor(math.log2(mean * math.log(2)))) if mean * math.log(2) >= 1 else 0
    best = None
    for r in range(max(0, r0 - 1), min(max_param, r0 + 2) + 1):
        bits = rice_bits(x, r)
        if best is None or bits < best[1]:
            best = (r, bits)
    assert best is not None
    return best


def pack_fields(x: np.ndarray, r: int) -> bytes:
    """The low ``r`` bits of each value, LSB first, value after value, zero-padded to a byte."""
    if r == 0 or x.size == 0:
        return b""
    nb = (r + 7) // 8
    le = np.ascontiguousarray(x, dtype="<u8").view(np.uint8).reshape(-1, 8)[:, :nb]
    bits = np.unpackbits(le, axis=1, bitorder="little")[:, :r]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def pack_unary(q: np.ndarray) -> bytes:
    """Each quotient as that many 0 bits and a terminating 1, LSB first, zero-padded."""
    ends = np.cumsum(q.astype(np.int64) + 1) - 1
    bits = np.zeros(int(ends[-1]) + 1, np.uint8)
    bits[ends] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def rice_encode(x: np.ndarray, r: int) -> tuple[bytes, bytes]:
    """(remainder part, quotient part) of non-negative ``x``."""
    x = x.astype(np.uint64, copy=False)
    return pack_fields(x & np.uint64((1 << r) - 1), r), pack_unary(x >> np.uint64(r))


def rice_decode(code: Rice, tensor: str, what: str) -> np.ndarray:
    """The ``count`` integers (uint64) of a Rice part pair whose sizes were proven at load: the
    quotient part holds exactly ``count`` terminators and ends in its last byte."""
    q = unary_decode(code.quo, code.nvalues, tensor, what).astype(np.uint64)
    if not code.param:
        return q
    raw = np.frombuffer(code.rem, np.uint8)
    _check_padding(raw, code.nvalues * code.param, tensor, f"{what} remainders")
    q <<= np.uint64(code.param)
    q |= read_fixed(raw, code.nvalues, code.param)
    return q


def bit_lengths(x: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 (0 for 0): frexp's exponent, corrected where float64 rounds up."""
    e = np.frexp(x.astype(np.float64))[1].astype(np.int64)
    big = e > 53
    if big.any():
        lo = np.left_shift(np.uint64(1), (e[big] - 1).astype(np.uint64))
        e[big] -= (lo > x[big]).astype(np.int64)
    return e


def write_fields(x: np.ndarray, widths: np.ndarray) -> bytes:
    """The low ``widths[j]`` bits of each ``x[j]``, LSB first, field after field, zero-padded."""
    ends = np.cumsum(widths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    if total == 0:
        return b""
    off = ends - widths
    bits = np.zeros(total, np.uint8)
    x = x.astype(np.uint64, copy=False)
    for b in range(int(widths.max())):
        at = np.flatnonzero(widths > b)
        bits[off[at] + b] = (x[at] >> np.uint64(b)) & np.uint64(1)
    return np.packbits(bits, bitorder="little").tobytes()


def _window_dtype(maxw: int):
    """The narrowest unsigned type whose window of whole bytes holds any field of ``maxw``
    bits at any bit offset, and that window's byte count."""
    for dt, nbytes in ((np.uint16, 2), (np.uint32, 4), (np.uint64, 8)):
        if maxw + 7 <= 8 * nbytes:
            return dt, nbytes
    return np.uint64, 9


def read_fixed(raw: np.ndarray, count: int, r: int) -> np.ndarray:
    """``count`` fields of ``r`` bits (1..20) packed LSB first: eight fields fill ``r`` bytes,
    so each of the eight is a fixed shift of fixed columns (no gather)."""
    groups = -(-count // 8)
    padded = np.zeros(groups * r + 2, np.uint8)
    padded[: raw.size] = raw
    cols = padded[: groups * r].reshape(groups, r)
    dt, nb = _window_dtype(r)
    out = np.empty((groups, 8), dt)
    mask = dt((1 << r) - 1)
    for j in range(8):
        b0, sh = divmod(j * r, 8)
        acc = cols[:, b0].astype(dt)
        for i in range(1, min(nb, r - b0)):
            acc |= cols[:, b0 + i].astype(dt) << dt(8 * i)
        out[:, j] = (acc >> dt(sh)) & mask
    return out.reshape(-1)[:count]


def read_fields(data, widths: np.ndarray, tensor: str, what: str) -> np.ndarray:
    """Inverse of ``write_fields``: ``data`` must be exactly the bytes the widths need, with
    zero padding. Widths are at most 63 (proven by the caller)."""
    ends = np.cumsum(widths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    raw = np.frombuffer(data, np.uint8)
    if raw.size != -(-total // 8):
        raise PayloadBoundError(tensor, f"sparse-v2 {what} hold {raw.size} bytes, their widths need {-(-total // 8)}")
    if total == 0:
        return np.zeros(widths.size, np.uint64)
    _check_padding(raw, total, tensor, what)
    maxw = int(widths.max())
    dt, nb = _window_dtype(maxw)
    buf = np.zeros(raw.size + 9, np.uint8)
    buf[: raw.size] = raw
    off = ends - widths
    byte = off >> 3
    sh = (off & 7).astype(dt)
    win = buf[byte].astype(dt)
    for i in range(1, min(nb, 8)):
        win |= buf[byte + i].astype(dt) << dt(8 * i)
    win >>= sh
    if nb > 8:  # a field may reach into a ninth byte
        ninth = buf[byte + 8].astype(np.uint64) << np.minimum(np.uint64(64) - sh, np.uint64(63))
        win |= np.where(sh > 0, ninth, np.uint64(0))
    w = widths.astype(dt)
    return (win & ((dt(1) << w) - dt(1))).astype(np.uint64)


VALUE_ORDER_CONSTANT = 8  # order shift meaning: every value has order ``a`` (the key is not used)


def value_orders(keys: np.ndarray, a: int, shift: int, max_order: int) -> np.ndarray:
    """Exp-Golomb order of each large change: ``a - (key >> shift)`` clipped to
    [0, max_order] (an ulp halves per exponent step, so a change of the same size is twice
    the integer difference one key lower), or ``a`` for every change with shift 8."""
    if shift == VALUE_ORDER_CONSTANT:
        return np.full(keys.size, a, np.int64)
    return np.clip(a - (keys.astype(np.int64) >> shift), 0, max_order)


def expgolomb_lengths(x: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """L of each value: ``x + 2^r`` has ``L + r + 1`` bits."""
    return bit_lengths(x.astype(np.uint64) + np.left_shift(np.uint64(1), orders.astype(np.uint64))) - 1 - orders


def expgolomb_bits(x: np.ndarray, orders: np.ndarray) -> int:
    """Bits of ``x`` in the Exp-Golomb code of the given orders: 2 L + 1 + r each."""
    return int((2 * expgolomb_lengths(x, orders) + 1 + orders).sum())


def best_value_orders(x: np.ndarray, keys: np.ndarray, max_order: int) -> tuple[int, int]:
    """(a, shift) of ``value_orders`` with the fewest bits: a constant order, or one that
    follows the key (one exponent per key for bf16/fp32, eight keys per exponent for fp16).
    Candidates are costed from a (key, bit length) histogram, not value by value."""
    lengths = bit_lengths(x.astype(np.uint64, copy=False))
    pairs, counts = np.unique(keys.astype(np.int64) * 128 + lengths, return_counts=True)
    key_of, bits_of = pairs >> 7, pairs & 127
    log_size = np.repeat(bits_of, counts)
    candidates = []
    for shift in (0, 3):
        centre = int(np.median(np.repeat(key_of >> shift, counts) + log_size)) - 1
        candidates += [(a, shift) for a in range(max(0, centre - 2), min(255, centre + 2) + 1)]
    centre = int(np.median(log_size)) - 1
    candidates += [(a, VALUE_ORDER_CONSTANT) for a in range(max(0, centre - 2), min(max_order, centre + 2) + 1)]

    def cost(c: tuple[int, int]) -> int:
        # x + 2^r has max(bits(x), r + 1) bits, or one more: an estimate, ties do not matter
        r = value_orders(key_of, c[0], c[1], max_order)
        return int((counts * (2 * np.maximum(bits_of - r, 0) + 1 + r)).sum())

    return min(candidates, key=cost)


def expgolomb_encode(x: np.ndarray, orders: np.ndarray) -> tuple[bytes, bytes]:
    """(field part, length part): ``w = x + 2^r`` has ``L + r + 1`` bits; L goes in unary,
    the low ``L + r`` bits of w as a field."""
    lengths = expgolomb_lengths(x, orders)
    w = x.astype(np.uint64) + np.left_shift(np.uint64(1), orders.astype(np.uint64))
    return write_fields(w, lengths + orders), pack_unary(lengths)


def unary_decode(quo, count: int, tensor: str, what: str) -> np.ndarray:
    """The ``count`` unary numbers (int64) of a part that ends with its last terminator."""
    bits = np.unpackbits(np.frombuffer(quo, np.uint8), bitorder="little").view(np.bool_)
    ends = np.flatnonzero(bits)
    if ends.size != count:
        raise PayloadBoundError(tensor, f"sparse-v2 {what} quotients hold {ends.size} terminators, the table declares {count}")
    if int(ends[-1]) < bits.size - 8:
        raise PayloadBoundError(tensor, f"sparse-v2 {what} quotients have {(bits.size - 1 - int(ends[-1])) // 8} bytes after the last terminator")
    q = np.diff(ends, prepend=-1)
    q -= 1
    return q


def expgolomb_decode(code: "Values", orders: np.ndarray, max_bits: int, tensor: str, what: str) -> np.ndarray:
    """The values of an Exp-Golomb part pair; every field width is proven to be at most
    ``max_bits`` before any field is read."""
    lengths = unary_decode(code.quo, code.nvalues, tensor, what)
    widths = lengths + orders
    if int(widths.max()) > max_bits:
        raise PayloadBoundError(tensor, f"sparse-v2 {what} need a {int(widths.max())}-bit field, at most {max_bits} fit the element")
    fields = read_fields(code.rem, widths, tensor, f"{what} fields")
    w = fields | np.left_shift(np.uint64(1), widths.astype(np.uint64))
    return w - np.left_shift(np.uint64(1), orders.astype(np.uint64))


def gaps_of(local: np.ndarray) -> np.ndarray:
    """Ascending indices -> gaps (the first index, then differences less one)."""
    g = np.empty(local.size, np.int64)
    g[0] = local[0]
    np.subtract(local[1:], local[:-1], out=g[1:])
    g[1:] -= 1
    return g


def indices_of(gaps: np.ndarray) -> np.ndarray:
    local = gaps.astype(np.int64)
    local += 1
    np.cumsum(local, out=local)
    local -= 1
    return local


def _positions_code(local: np.ndarray, universe: int) -> tuple[int, int, list[bytes]]:
    """(mode, parameter, parts) of ascending indices into ``universe`` slots: Rice gaps or a
    bitmap, whichever is smaller."""
    g = gaps_of(local)
    r, bits = best_rice_param(g, MAX_GAP_PARAM)
    if universe <= bits:
        m = np.zeros(universe, np.bool_)
        m[local] = True
        return MODE_BITMAP, 0, [np.packbits(m, bitorder="little").tobytes()]
    rem, quo = rice_encode(g, r)
    return MODE_RICE, r, [rem, quo]


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


def _encode_class(members: int, local: np.ndarray, signs: np.ndarray, mags: np.ndarray, keys: np.ndarray,
                  width: int) -> tuple[bytes, list[bytes]]:
    """One class's table entry and parts: its changes at class indices ``local`` (ascending),
    their sign flags, |d| - 1 and the old elements' keys."""
    k = local.size
    mask_mode, rg, parts = _positions_code(local, members)
    parts.append(np.packbits(signs, bitorder="little").tobytes())
    big = mags != 0
    big_at = np.flatnonzero(big)
    nbig = big_at.size
    nflag = flag_mode = rf = va = vs = flag_lo = flag_hi = 0
    declared: list[int] = [len(parts[1])] if mask_mode == MODE_RICE else []
    if nbig:
        # below the smallest key of a change that is not large, every change is large; above the
        # largest key of a large one, none is: only changes with keys in between carry a flag
        flag_hi = int(keys[big_at].max())
        flag_lo = int(keys[~big].min()) if nbig < k else flag_hi
        candidates = np.flatnonzero((keys >= flag_lo) & (keys <= flag_hi))
        if flag_hi < 255 and big[candidates].all():  # every change up to flag_hi is large: no flag
            flag_lo = flag_hi + 1
            candidates = candidates[:0]
        flagged = np.flatnonzero(big[candidates])
        # most candidates large: code the few that are not (some are not: an empty part would read as none large)
        others = candidates.size > flagged.size > candidates.size // 2
        if others:
            flagged = np.flatnonzero(~big[candidates])
        nflag = flagged.size
        if nflag:
            flag_mode, rf, fparts = _positions_code(flagged, candidates.size)
            if others and flag_mode == MODE_RICE:
                flag_mode = MODE_RICE_OTHERS
            elif others:  # a bitmap of the others is the bitmap of the large ones, inverted
                fparts = [np.packbits(big[candidates], bitorder="little").tobytes()]
                nflag = candidates.size - nflag
            parts += fparts
            declared.append(len(fparts[-1]))
        values = mags[big_at].astype(np.uint64)
        values -= np.uint64(1)
        big_keys = keys[big_at]
        va, vs = best_value_orders(values, big_keys, 8 * width - 2)
        rem, quo = expgolomb_encode(values, value_orders(big_keys, va, vs, 8 * width - 2))
        parts += [rem, quo]
        declared += [len(rem), len(quo)]
    head = CLASS_HEAD.pack(members, k, nbig, nflag, mask_mode, rg, flag_mode, rf, va, vs, flag_lo, flag_hi)
    return head + struct.pack(f"<{len(declared)}I", *declared), parts


class Sparse2Codec:
    name = "sparse-v2"

    def __init__(self, seg_elements: int = SEG_ELEMENTS, class_min_saving: float | None = None,
                 class_overhead_bytes: int = CLASS_OVERHEAD_BYTES, bitstream: int | None = None):
        """``class_min_saving`` and ``bitstream`` None: the knobs' (read at every encode)."""
        if bitstream == VERSION_RC and _rc is None:
            raise CoderUnavailableError("<encoder>")
        self.bitstream = bitstream
        self.seg_elements = seg_elements
        self.class_min_saving = class_min_saving
        self.class_overhead_bytes = class_overhead_bytes

    def encode(self, old, new, itemsize, level, tensor):
        return self.join([self.encode_part(old, new, itemsize, level, tensor, None)], new.nbytes, itemsize)

    def segment_count(self, nbytes: int, itemsize: int) -> int:
        return -(-(nbytes // _width(nbytes, itemsize)) // self.seg_elements)

    def encode_part(self, old, new, itemsize, level, tensor, seg_range: tuple[int, int] | None) -> tuple:
        """Segments [a, b) (all when None) as (table entries, parts, changed bytes, changed
        elements, bitstream), the form ``join`` takes."""
        bitstream = self.bitstream or writer_bitstream()
        encode = self._encode_coded_segment if bitstream == VERSION_RC else self._encode_segment
        return (*encode_segment_range(
            old, new, itemsize, self.seg_elements, seg_range,
            lambda o, nw, s0, s1, width: encode(o[s0:s1], nw[s0:s1], width),
        ), bitstream)

    def join(self, parts: list, nbytes: int, itemsize: int) -> Encoded | None:
        def pack_head(width: int, n: int, nseg: int) -> bytes:
            bitstreams = {p[4] for p in parts}
            if len(bitstreams) != 1:
                raise AssertionError(f"parts of one tensor were coded in bitstreams {sorted(bitstreams)}")
            return HEADER.pack(MAGIC, bitstreams.pop(), width, 0, 0, n, self.seg_elements, nseg)

        return join_segment_parts(parts, nbytes, itemsize, self.seg_elements, pack_head)

    def _encode_segment(self, o: np.ndarray, nw: np.ndarray, width: int):
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
        d = np.empty_like(ov)
        _to_order(ov, d)  # float order: a weight crossing zero moves a few steps, not 2^15
        _to_order(nv, d)
        np.subtract(nv, ov, out=d)  # modular: exact for any pair
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
        saving = knobs.SPARSE2_CLASS_MIN_SAVING.get() if self.class_min_saving is None else self.class_min_saving
        starts = choose_boundaries(members, changes, 8.0 * (length * saving + self.class_overhead_bytes))
        bounds = [0, *starts, nkeys]
        entry = [struct.pack("<B", len(bounds) - 1), bytes(starts)]
        seg_parts: list[bytes] = []
        if len(bounds) == 2:
            head, parts = _encode_class(length, idx, signs, d, keys_changed, width)
            return b"".join([*entry, head]), parts, changed_bytes, k
        class_of_key = np.zeros(nkeys, np.uint8)
        for b in starts:
            class_of_key[b:] += 1
        cls_of_change = np.take(class_of_key, keys_changed)
        sel = SCRATCH.get("sp2-enc-sel", length).view(np.bool_)
        for c in range(len(bounds) - 1):
            lo, hi = bounds[c] << shift, bounds[c + 1] << shift
            at = np.flatnonzero(cls_of_change == c)
            _select(v, lo, hi, width, sel)
            members_c, local = _ranks(sel, idx[at])
            if at.size == 0:
                entry.append(CLASS_HEAD.pack(members_c, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
                continue
            head, parts = _encode_class(members_c, local, signs[at], d[at], keys_changed[at], width)
            entry.append(head)
            seg_parts.extend(parts)
        return b"".join(entry), seg_parts, changed_bytes, k

    def _encode_coded_segment(self, o: np.ndarray, nw: np.ndarray, width: int):
        coded, k, changed_bytes = _rc.encode_segment(o, nw, width)
        if k == 0:
            return RC_ENTRY.pack(0, 0), [], 0, 0
        return RC_ENTRY.pack(k, len(coded)), [coded], changed_bytes, k

    # --- check ----------------------------------------------------------------------------

    def check_structure(self, payload, tensor) -> "Layout":
        """Everything but the fit to the local tensor: at load, before any seed or write. Keeps
        only the header's layout (the apply parses the table again: it is cheap)."""
        mv = memoryview(payload).cast("B")
        if mv.nbytes < HEADER.size:
            raise PayloadBoundError(tensor, f"sparse-v2 payload of {mv.nbytes} bytes is shorter than its {HEADER.size}-byte header")
        _, _, width, _, _, n, seg, nseg = HEADER.unpack_from(mv, 0)
        parse(payload, n * width, tensor)
        return Layout(width, n, seg, nseg)

    def check_fit(self, structure: "Layout", nbytes, itemsize, tensor):
        if structure.nelements * structure.width != nbytes:
            raise PayloadBoundError(
                tensor, f"sparse-v2 payload covers {structure.nelements} x {structure.width} bytes, the tensor has {nbytes}"
            )

    def check(self, payload, nbytes, itemsize, tensor):
        parse(payload, nbytes, tensor)

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
        parsed = parse(payload, n * width if nbytes is None else nbytes, tensor)
        changed = sum(seg.nchanged for seg in parsed.segments)
        return PayloadDensity(parsed.nelements * parsed.width, parsed.nelements, changed, None)


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _popcount(packed: np.ndarray) -> np.ndarray:
    count = getattr(np, "bitwise_count", None)  # numpy >= 2
    return count(packed) if count is not None else np.take(_POPCOUNT, packed)


def _ranks(sel: np.ndarray, at: np.ndarray) -> tuple[int, np.ndarray]:
    """(members of ``sel``, rank among them of each position in ``at``): a popcount prefix
    over the packed mask, so no pass writes a position per element."""
    packed = np.packbits(sel, bitorder="little")
    prefix = np.empty(packed.size + 1, np.int64)
    prefix[0] = 0
    np.cumsum(_popcount(packed), out=prefix[1:])
    byte = at >> 3
    below = packed[byte] & ((np.left_shift(1, at & 7)) - 1).astype(np.uint8)
    return int(prefix[-1]), prefix[byte] + _popcount(below)


def _member_positions(sel: np.ndarray, local: np.ndarray, declared: int) -> tuple[int, np.ndarray]:
    """(members of ``sel``, the positions of the members whose ranks ``local`` lists; the
    positions only when the members are ``declared``). One list of every member: a binary
    search in a popcount prefix measured no faster, even for classes with few changes."""
    listed = np.flatnonzero(sel)
    return listed.size, listed[local] if listed.size == declared else local


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


# --- parse ------------------------------------------------------------------------------


class _Reader:
    """Walks the parts of a payload, each proven to lie inside it."""

    def __init__(self, mv: memoryview, pos: int, tensor: str):
        self.mv, self.pos, self.tensor = mv, pos, tensor

    def take(self, nbytes: int, what: str) -> memoryview:
        if self.pos + nbytes > self.mv.nbytes:
            raise PayloadBoundError(self.tensor, f"sparse-v2 {what} of {nbytes} bytes at {self.pos} runs past the {self.mv.nbytes}-byte payload")
        part = self.mv[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return part


def _class_head(mv, pos: int, total: int, s: int, c: int, width: int, tensor: str):
    """One class's head and declared quotient sizes, every rule the table alone can prove."""
    if pos + CLASS_HEAD.size > total:
        raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
    members, k, nbig, nflag, mask_mode, rg, flag_mode, rf, va, vs, flag_lo, flag_hi = CLASS_HEAD.unpack_from(mv, pos)
    pos += CLASS_HEAD.size
    where = f"sparse-v2 segment {s} class {c}"
    if not nflag <= nbig <= k <= members:
        raise PayloadBoundError(tensor, f"{where} claims {k} changes ({nbig} large, {nflag} flagged) in {members} members")
    if k == 0 and (mask_mode, rg, flag_mode, rf, va, vs, flag_lo, flag_hi) != (0,) * 8:
        raise PayloadBoundError(tensor, f"{where} has no changes but mask mode {mask_mode} / parameters")
    if k and mask_mode not in (MODE_RICE, MODE_BITMAP):
        raise PayloadBoundError(tensor, f"{where} mask mode {mask_mode}, expected 1 (Rice) or 2 (bitmap)")
    if nbig == 0 and (va, vs, flag_lo, flag_hi) != (0, 0, 0, 0):
        raise PayloadBoundError(tensor, f"{where} has no large change but value orders / flag keys")
    if nflag == 0 and (flag_mode, rf) != (0, 0):
        raise PayloadBoundError(tensor, f"{where} has no flagged change but flag mode {flag_mode} / parameters")
    if nflag and flag_mode not in (MODE_RICE, MODE_BITMAP, MODE_RICE_OTHERS):
        raise PayloadBoundError(tensor, f"{where} flag mode {flag_mode}, expected 1 (Rice), 2 (bitmap) or 3 (Rice, the others)")
    if (mask_mode != MODE_RICE and rg) or (flag_mode == MODE_BITMAP and rf):
        raise PayloadBoundError(tensor, f"{where} has a Rice parameter for a bitmap")
    if rg > MAX_GAP_PARAM or rf > MAX_GAP_PARAM:
        raise PayloadBoundError(tensor, f"{where} Rice parameters {rg}/{rf} exceed {MAX_GAP_PARAM}")
    if vs > VALUE_ORDER_CONSTANT or (vs == VALUE_ORDER_CONSTANT and va > 8 * width - 2):
        raise PayloadBoundError(tensor, f"{where} value order {va} / shift {vs}: the shift is at most 8, a constant order at most {8 * width - 2}")
    ndeclared = (mask_mode == MODE_RICE) + (nflag > 0) + 2 * (nbig > 0)
    if pos + 4 * ndeclared > total:
        raise PayloadBoundError(tensor, f"sparse-v2 segment table truncated at segment {s}")
    declared = list(struct.unpack_from(f"<{ndeclared}I", mv, pos))
    pos += 4 * ndeclared
    # quotient parts: terminators plus the zeros the counts allow (sum of floor(g / 2^r) is at
    # most floor(sum g / 2^r)); values: a length of at most 8 width - 1 - r each, and fields of
    # at most 8 width - 1 bits
    bounds = []
    if mask_mode == MODE_RICE:
        bounds.append(("gap", k + ((members - k) >> rg)))
    if flag_mode in (MODE_RICE, MODE_RICE_OTHERS):  # the candidates are some of the k changes
        bounds.append(("flag", nflag + ((k - nflag) >> rf)))
    if flag_mode == MODE_BITMAP:
        bounds.append(("flag bitmap", k))
    if nbig:
        bounds.append(("value remainder", nbig * (8 * width - 1)))
        bounds.append(("value", nbig * 8 * width))
    for (what, bits), size in zip(bounds, declared):
        if what == "flag bitmap":
            if not 1 <= size <= -(-bits // 8):
                raise PayloadBoundError(tensor, f"{where} flag bitmap of {size} bytes, the counts allow 1 to {-(-bits // 8)}")
            continue
        if what == "value remainder":
            if size > -(-bits // 8):
                raise PayloadBoundError(tensor, f"{where} value remainders of {size} bytes, the counts allow at most {-(-bits // 8)}")
            continue
        if not 1 <= size <= -(-bits // 8):
            raise PayloadBoundError(tensor, f"{where} {what} quotients of {size} bytes, the counts allow 1 to {-(-bits // 8)}")
    return (members, k, nbig, nflag, mask_mode, rg, flag_mode, rf, va, vs, flag_lo, flag_hi, declared), pos


def parse(payload, nbytes: int, tensor: str) -> Parsed:
    """Read the header and segment table and locate every part, proving every size; nothing
    is decoded."""
    mv = memoryview(payload).cast("B")
    total = mv.nbytes
    if total < HEADER.size:
        raise PayloadBoundError(tensor, f"sparse-v2 payload of {total} bytes is shorter than its {HEADER.size}-byte header")
    magic, version, width, reserved, flags, n, seg, nseg = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadBoundError(tensor, f"sparse-v2 payload starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in VERSIONS:
        raise PayloadBoundError(tensor, f"sparse-v2 payload version {version}, this reader knows {list(VERSIONS)}")
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
    if version == VERSION_RC:
        return _parse_coded(mv, width, n, seg, nseg, tensor)
    if HEADER.size + nseg > total:
        raise PayloadBoundError(tensor, f"sparse-v2 segment table of {nseg} entries runs past the {total}-byte payload")
    shift = KEY_SHIFT[width]
    nkeys = NKEYS[width]
    pos = HEADER.size
    table: list[tuple[int, int, list]] = []  # start, length, classes
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
        members_sum = changes_sum = 0
        for c in range(nclasses):
            head, pos = _class_head(mv, pos, total, s, c, width, tensor)
            members_sum += head[0]
            changes_sum += head[1]
            classes.append((bounds[c] << shift, bounds[c + 1] << shift, head))
        if members_sum != length:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} classes have {members_sum} members, the segment {length} elements")
        if changes_sum == 0:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {s} declares classes but no change (write 0 classes)")
        table.append((start, length, classes))
    reader = _Reader(mv, pos, tensor)
    segments: list[Segment | CodedSegment] = []
    for start, length, classes in table:
        parts: list[ClassPart] = []
        nchanged = 0
        for lo, hi, (members, k, nbig, nflag, mask_mode, rg, flag_mode, rf, va, vs, flag_lo, flag_hi, declared) in classes:
            if k == 0:
                parts.append(ClassPart(lo, hi, members, 0, 0, 0, 0, 0, MODE_NONE, None, None, MODE_NONE, None, None))
                continue
            sizes = iter(declared)
            mask: Rice | memoryview
            if mask_mode == MODE_BITMAP:
                mask = reader.take(-(-members // 8), "change bitmap")
            else:
                mask = Rice(k, rg, reader.take(-(-k * rg // 8), "gap remainders"), reader.take(next(sizes), "gap quotients"))
            signs = reader.take(-(-k // 8), "signs")
            large: Rice | memoryview | None = None
            values = None
            if nflag:
                if flag_mode == MODE_BITMAP:
                    large = reader.take(next(sizes), "large-change bitmap")
                else:
                    large = Rice(nflag, rf, reader.take(-(-nflag * rf // 8), "flag remainders"), reader.take(next(sizes), "flag quotients"))
            if nbig:
                values = Values(nbig, va, vs, reader.take(next(sizes), "value fields"), reader.take(next(sizes), "value lengths"))
            parts.append(ClassPart(lo, hi, members, k, nbig, nflag, flag_lo, flag_hi, mask_mode, mask, signs, flag_mode, large, values))
            nchanged += k
        segments.append(Segment(start, length, nchanged, parts))
    if reader.pos != total:
        raise PayloadBoundError(tensor, f"{total - reader.pos} trailing bytes after the sparse-v2 streams")
    return Parsed(width, n, seg, segments)


def _parse_coded(mv: memoryview, width: int, n: int, seg: int, nseg: int, tensor: str) -> Parsed:
    """Bitstream 3's table: per segment the changes and the size of its coded part, proven
    against the segment and the payload (vectorised: a table may have 2^18 entries)."""
    if _rc is None:
        raise CoderUnavailableError(tensor)
    total = mv.nbytes
    table_end = HEADER.size + nseg * RC_ENTRY.size
    if table_end > total:
        raise PayloadBoundError(tensor, f"sparse-v2 segment table of {nseg} entries runs past the {total}-byte payload")
    table = np.frombuffer(mv, dtype="<u4", count=2 * nseg, offset=HEADER.size).reshape(nseg, 2).astype(np.int64)
    changes, sizes = table[:, 0], table[:, 1]
    starts = np.arange(nseg, dtype=np.int64) * seg
    lengths = np.minimum(seg, n - starts)
    for bad, why in (
        (changes > lengths, "declares more changes than it has elements"),
        ((changes == 0) != (sizes == 0), "declares changes without a coded part, or a coded part without changes"),
        ((changes > 0) & (sizes < RC_MIN_PART), f"has a coded part shorter than the coder's {RC_MIN_PART} start bytes"),
    ):
        if bad.any():
            s = int(np.flatnonzero(bad)[0])
            raise PayloadBoundError(
                tensor, f"sparse-v2 segment {s} ({int(lengths[s])} elements, {int(changes[s])} changes, "
                f"{int(sizes[s])} coded bytes) {why}",
            )
    ends = table_end + np.cumsum(sizes)
    end = int(ends[-1]) if nseg else table_end
    if end > total:
        raise PayloadBoundError(tensor, f"sparse-v2 coded parts need {end} bytes, the payload has {total}")
    if end != total:
        raise PayloadBoundError(tensor, f"{total - end} trailing bytes after the sparse-v2 coded parts")
    offsets = (ends - sizes).tolist()
    segments: list[Segment | CodedSegment] = [
        CodedSegment(start, length, k, mv[at : at + size])
        for start, length, k, at, size in zip(starts.tolist(), lengths.tolist(), changes.tolist(), offsets, sizes.tolist())
    ]
    return Parsed(width, n, seg, segments)


# --- apply ------------------------------------------------------------------------------


def _apply_coded_segment(rw: np.ndarray, seg: CodedSegment, tensor: str, index: int) -> None:
    """The decoder writes the segment only once all of it decoded cleanly: exactly the declared
    changes and exactly the declared bytes. Its contexts are the local old bytes, so a part that
    does not decode cleanly means those are not the base version, or the part is damaged."""
    if seg.nchanged == 0:
        return
    view = rw[seg.start : seg.start + seg.length]
    try:
        _rc.decode_segment(view, seg.coded, rw.dtype.itemsize, seg.nchanged)
    except ValueError as e:
        raise LocalTensorMismatchError(
            tensor,
            f"sparse-v2 segment {index} does not decode against the local bytes ({e}): they are not the version "
            "the delta builds on, or the payload is damaged",
        ) from None


def _apply_segment(rw: np.ndarray, seg: "Segment | CodedSegment", tensor: str, index: int) -> None:
    """Every class's positions from the old bytes first (a change may move an element to
    another class), each proven against the declared member count; then the writes."""
    if seg.nchanged == 0:
        return
    if isinstance(seg, CodedSegment):
        return _apply_coded_segment(rw, seg, tensor, index)
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
            members, positions = _member_positions(sel, local, part.members)
            if members != part.members:
                raise LocalTensorMismatchError(
                    tensor,
                    f"sparse-v2 segment {index} class {c}: the local bytes hold {members} elements of magnitude "
                    f"[{part.lo:#x}, {part.hi:#x}), the payload was encoded against {part.members}",
                )
        o = view[positions]  # old values: every class's before the first write
        d = _decode_differences(part, o, tensor, index, c)
        m = np.empty_like(o)
        _to_order(o, m)
        o += d
        _from_order(o, m)
        writes.append((positions, o))
    for positions, new in writes:
        view[positions] = new


def _decode_indices(code: Rice | memoryview, mode: int, count: int, universe: int, tensor: str, what: str) -> np.ndarray:
    """Ascending indices (int64) of ``count`` marked slots among ``universe``, proven below it."""
    if mode == MODE_BITMAP:
        packed = np.frombuffer(code, np.uint8)  # type: ignore[arg-type]
        _check_padding(packed, universe, tensor, what)
        local = np.flatnonzero(np.unpackbits(packed, count=universe, bitorder="little").view(np.bool_))
        if local.size != count:
            raise PayloadBoundError(tensor, f"sparse-v2 {what} marks {local.size}, the table declares {count}")
        return local
    assert isinstance(code, Rice)
    local = indices_of(rice_decode(code, tensor, what))
    if int(local[-1]) >= universe:
        raise PayloadBoundError(tensor, f"sparse-v2 {what}: index {int(local[-1])} is past its {universe} slots")
    return local


def _decode_mask(part: ClassPart, tensor: str, index: int, c: int) -> np.ndarray:
    """Class-local indices of the changes, ascending, each proven below the member count."""
    assert part.mask is not None
    return _decode_indices(part.mask, part.mask_mode, part.changes, part.members, tensor,
                           f"segment {index} class {c} changes")


def _decode_differences(part: ClassPart, old: np.ndarray, tensor: str, index: int, c: int) -> np.ndarray:
    """T(new) - T(old) modulo 2^bits of each change: 1, or 2 + the large value, then the sign.
    ``old``: the changed elements' old values (their keys set the value orders)."""
    k = part.changes
    dt = old.dtype
    width = dt.itemsize
    d = np.ones(k, dt)
    if part.nbig:
        assert part.values is not None
        all_keys = (old & dt.type(_mag_mask(width))) >> dt.type(KEY_SHIFT[width])
        large = all_keys < dt.type(part.flag_lo)
        if part.nflag:
            assert part.flags is not None
            candidates = np.flatnonzero((all_keys >= dt.type(part.flag_lo)) & (all_keys <= dt.type(part.flag_hi)))
            if part.flag_mode == MODE_BITMAP and len(part.flags) != -(-candidates.size // 8):  # type: ignore[arg-type]
                raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c} flag bitmap of {len(part.flags)} bytes "  # type: ignore[arg-type]
                                        f"for {candidates.size} candidates")
            mode = MODE_RICE if part.flag_mode == MODE_RICE_OTHERS else part.flag_mode
            flagged = _decode_indices(part.flags, mode, part.nflag, candidates.size, tensor,
                                      f"segment {index} class {c} large changes")
            if part.flag_mode == MODE_RICE_OTHERS:
                large[candidates] = True
                large[candidates[flagged]] = False
            else:
                large[candidates[flagged]] = True
        at = np.flatnonzero(large)
        if at.size != part.nbig:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c}: its keys and flags make {at.size} large changes, "
                                    f"the table declares {part.nbig}")
        keys = all_keys[at]
        orders = value_orders(keys, part.values.a, part.values.shift, 8 * width - 2)
        values = expgolomb_decode(part.values, orders, 8 * width - 1, tensor, f"segment {index} class {c} values")
        if int(values.max()) > (1 << (8 * width - 1)) - 2:
            raise PayloadBoundError(tensor, f"sparse-v2 segment {index} class {c} has a magnitude above 2^{8 * width - 1}")
        values += np.uint64(2)
        d[at] = values.astype(dt)
    assert part.signs is not None
    packed = np.frombuffer(part.signs, np.uint8)
    _check_padding(packed, k, tensor, "signs")
    m = np.negative(np.unpackbits(packed, count=k, bitorder="little"), dtype=dt, casting="unsafe")
    d ^= m  # two's complement where the sign is set: (x ^ -1) + 1
    d -= m
    return d


def _check_padding(packed: np.ndarray, nbits: int, tensor: str, what: str) -> None:
    rem = nbits % 8
    if rem and int(packed[-1]) >> rem:
        raise PayloadBoundError(tensor, f"sparse-v2 {what} have set bits past the last one")


def apply_sparse2_chain(
    region: np.ndarray, payloads: list, tensor: str, chunk_nbytes: int, hasher, seg_range: tuple[int, int] | None = None
) -> None:
    """Apply several sparse-v2 payloads (oldest first) to ``region`` in place, segment-major:
    each payload's changes to a segment against the bytes the previous payload left there,
    then the segment is hashed while in cache. ``seg_range``: only segments [a, b) (a worker's
    part; the caller hashes; the chain must segment alike)."""
    nbytes = region.nbytes
    parsed = [parse(p, nbytes, tensor) for p in payloads]
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


CODEC: Sparse2Codec = Sparse2Codec()
