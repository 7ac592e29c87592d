"""sparse-v2 bitstream 2 (magnitude classes, Rice coded; bitstream 3, the range coder, is
``test_codec_sparse2_rc.py``): the golden vector, round trips over widths/densities/bit patterns and class
splits, the Rice and Exp-Golomb primitives, chained apply against the bytes the previous
payload produced, publish and pull, and one test per way a payload can be malformed
(docs/FORMAT.md, "sparse-v2" and the catalogue).

The bad payloads are assembled from the spec by the independent writer of ``interop_writer``
(its ``v2_class``: plain Python, bit by bit, nothing of ``weightsync``), so a test can break
exactly one rule while every other byte is valid.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import interop_writer as independent
from weightsync.codecs import sparse_v2 as codec_sparse2
from weightsync.codecs.sparse_v2 import Sparse2Codec, apply_sparse2_chain, choose_boundaries
from weightsync.codecs import get_codec
from weightsync.errors import LocalTensorMismatchError, PayloadBoundError

LE = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
CLASS = "<IIIIBBBBBBBB"  # members, changes, large, flagged; mask mode, gap r, flag mode, flag r, value a, shift, flag keys

# bf16 bits: three 1.0/128 (0x3C00, key 0x78) that all change (+1, -1, +3 ulps) and six 1.0
# (0x3F80, key 0x7F) of which one changes (-1): two classes split at key 0x7F
GOLDEN_OLD = [0x3C00, 0x3F80, 0x3C00, 0x3F80, 0x3C00, 0x3F80, 0x3F80, 0x3F80, 0x3F80]
GOLDEN_NEW = [0x3C01, 0x3F80, 0x3BFF, 0x3F80, 0x3C03, 0x3F80, 0x3F80, 0x3F7F, 0x3F80]
GOLDEN_HEX = (
    "57535332" "02" "02" "00" "00"  # magic, version 2, width 2, reserved 0, flags 0
    "0900000000000000" "00001000" "01000000"  # 9 elements, segments of 2^20, 1 segment
    "02" "7f"  # 2 classes; the second starts at key 0x7f
    "03000000" "03000000" "01000000" "01000000"  # class 0: 3 members, 3 changes, 1 large, 1 flagged
    "02" "00" "02" "00" "79" "00" "78" "78"  # bitmap mask, bitmap flags, value order 0x79 - key, flag keys [0x78, 0x78]
    "01000000" "01000000" "01000000"  # flag bitmap: 1 byte, value fields: 1 byte, value lengths: 1 byte
    "06000000" "01000000" "00000000" "00000000"  # class 1: 6 members, 1 change, none large
    "01" "01" "00" "00" "00" "00" "00" "00"  # Rice gaps with r = 1
    "01000000"  # gap quotients: 1 byte
    "07"  # class 0 bitmap: members 0, 1, 2 changed
    "02"  # class 0 signs: +, -, +
    "04"  # class 0 large: change 2 (|d| = 3)
    "01" "01"  # its value 3 - 2 = 1, order 0x79 - 0x78 = 1: w = 3, L = 0; field: 1 bit (1), length: unary 0
    "00" "04"  # class 1: gap 4 = 2 * 2 + 0: remainder bit 0, quotient 2 in unary (0, 0, 1)
    "01"  # class 1 sign: -
)
EAGER = Sparse2Codec(class_min_saving=0, class_overhead_bytes=0, bitstream=2)  # a class wherever it lowers the entropy


@pytest.fixture(autouse=True)
def bitstream_2(monkeypatch):
    """Every encode and publish of this module writes bitstream 2."""
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "2")


def _u8(values, width=2) -> np.ndarray:
    return np.array(values, dtype=LE[width]).view(np.uint8).copy()


def _t_diff(old: int, new: int, width: int) -> int:
    """T(new) - T(old) mod 2^bits, FORMAT.md's difference."""
    return (independent.v2_order(new, width) - independent.v2_order(old, width)) % (1 << (8 * width))


def build_payload(width: int, n: int, seg: int, segments, *, tail: bytes = b"", reserved: int = 0, version: int = 2) -> bytes:
    """Through the independent writer. ``segments``: per segment None (no change) or (starts,
    classes), a class being (members, local change indices, differences as signed ints) or a
    raw override ("raw", table bytes, data bytes) to break one rule."""
    head = b"WSS2" + bytes([version, width, reserved, 0]) + struct.pack("<QII", n, seg, len(segments))
    table, data = b"", b""
    for s in segments:
        if s is None:
            table += b"\0"
            continue
        starts, classes = s
        table += bytes([len(classes), *starts])
        for cls in classes:
            if cls[0] == "raw":
                table += cls[1]
                data += cls[2]
                continue
            members, local, diffs = cls
            d = [x % (1 << (8 * width)) for x in diffs]
            t, body = independent.v2_class(members, list(local), d, [0] * len(d), width)
            table += t
            data += body
    return head + table + data + tail


def _bits(*fields: tuple[int, int]) -> bytes:
    w = independent.BitWriter()
    for value, width in fields:
        w.field(value, width)
    return w.getvalue()


CODEC = get_codec("sparse-v2")


def test_golden_vector_encodes_to_exact_bytes():
    old, new = _u8(GOLDEN_OLD), _u8(GOLDEN_NEW)
    enc = EAGER.encode(old, new, 2, 1, "t")
    assert enc.payload.hex() == GOLDEN_HEX
    assert (enc.changed_elements, enc.changed_bytes) == (4, 5)


def test_golden_vector_decodes_and_the_independent_reader_agrees():
    old, new = _u8(GOLDEN_OLD), _u8(GOLDEN_NEW)
    payload = bytes.fromhex(GOLDEN_HEX)
    CODEC.check(payload, old.nbytes, 2, "t")
    region = old.copy()
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()
    assert independent.apply_sparse_v2(old.tobytes(), payload) == new.tobytes()


def test_the_independent_writers_own_choices_decode_here():
    """Its boundary at the median key, its Rice parameters from the mean gap and a constant
    value order are other valid choices than ours: the bytes differ, the result does not."""
    rng = np.random.default_rng(5)
    w = (0.02 * rng.standard_normal(5000)).astype(np.float32)
    moved = w + np.float32(3e-5) * rng.standard_normal(5000).astype(np.float32) * (rng.random(5000) < 0.3)
    old, new = w.view(np.uint8).copy(), moved.view(np.uint8).copy()
    theirs = independent.encode_sparse_v2(old.tobytes(), new.tobytes())
    assert theirs != EAGER.encode(old, new, 4, 1, "t").payload
    region = old.copy()
    CODEC.apply(region, theirs, 4, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


def test_the_receiver_classes_elements_by_the_old_bytes_not_the_new():
    """Element 0 moves from key 0x78 to 0x79 only in ``new``; its class is the old one's."""
    old = _u8([0x3C7F] + [0x3F80] * 7)
    new = _u8([0x3C80] + [0x3F80] * 6 + [0x3F81])
    payload = EAGER.encode(old, new, 2, 1, "t").payload
    parsed = codec_sparse2.parse(payload, old.nbytes, "t")
    assert [c.members for c in parsed.segments[0].classes] == [1, 7]
    region = old.copy()
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


def test_a_weight_crossing_zero_is_a_small_difference_in_float_order():
    """+tiny -> -tiny is 2^15 apart in raw bf16 bits, 3 steps apart in T's order."""
    old, new = _u8([0x0001, 0x3F80]), _u8([0x8001, 0x3F80])
    assert _t_diff(0x0001, 0x8001, 2) == (1 << 16) - 3  # past +0 and -0
    payload = EAGER.encode(old, new, 2, 1, "t").payload
    part = codec_sparse2.parse(payload, old.nbytes, "t").segments[0].classes[0]
    assert part.nbig == 1 and len(part.values.rem) + len(part.values.quo) <= 2
    region = old.copy()
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


def test_dynamic_programme_splits_where_the_change_rate_jumps():
    members = np.zeros(256)
    changes = np.zeros(256)
    members[[100, 101, 102, 103]] = 1000
    changes[[100, 101, 102, 103]] = [900, 880, 20, 10]
    assert choose_boundaries(members, changes, 0.0) == [101, 102, 103]  # free classes: every jump
    assert choose_boundaries(members, changes, 8 * 200.0) == [102]  # costly classes: only the big one
    assert choose_boundaries(members, changes, 1e12) == []


# --- the stream primitives ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300), st.integers(0, 12))
def test_rice_parts_round_trip_and_match_the_independent_bits(values, r):
    x = np.array(values, np.uint64)
    rem, quo = codec_sparse2.rice_encode(x, r)
    ref_rem, ref_quo = independent._rice(values, r)
    assert (rem, quo) == (ref_rem, ref_quo)
    code = codec_sparse2.Rice(len(values), r, memoryview(rem), memoryview(quo))
    assert codec_sparse2.rice_decode(code, "t", "x").tolist() == values
    assert codec_sparse2.rice_bits(x, r) == len(values) * (r + 1) + sum(v >> r for v in values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (1 << 15) - 2), st.integers(0, 255)), min_size=1, max_size=200),
       st.integers(0, 255), st.sampled_from([0, 3, 8]))
def test_exp_golomb_values_round_trip_with_orders_from_the_keys(pairs, a, shift):
    values = np.array([v for v, _ in pairs], np.uint64)
    keys = np.array([k for _, k in pairs], np.int64)
    a = min(a, 14) if shift == 8 else a
    orders = codec_sparse2.value_orders(keys, a, shift, 14)
    assert orders.tolist() == [independent.v2_value_order(k, a, shift, 2) for _, k in pairs]
    rem, quo = codec_sparse2.expgolomb_encode(values, orders)
    code = codec_sparse2.Values(len(pairs), a, shift, memoryview(rem), memoryview(quo))
    assert codec_sparse2.expgolomb_decode(code, orders, 15, "t", "x").tolist() == values.tolist()
    assert 8 * (len(rem) + len(quo)) - 14 <= codec_sparse2.expgolomb_bits(values, orders) <= 8 * (len(rem) + len(quo))


# --- round trips --------------------------------------------------------------------------


@st.composite
def pairs(draw):
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.sampled_from([1, 7, 600, 5000, 9000]))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0]))
    kind = draw(st.sampled_from(["random", "ulp", "signflip", "nan", "floats"]))
    rng = np.random.default_rng(seed)
    if kind == "floats" and width in (2, 4):  # magnitudes spread over many exponents: many classes
        w = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 2, n))).astype(np.float32)
        old = (w.view("<u4") >> 16).astype("<u2").view(np.uint8).copy() if width == 2 else w.view(np.uint8).copy()
    else:
        old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy()
    o = old.view(LE[width])
    nw = new.view(LE[width])
    mask = rng.random(n) < density
    top = np.array(1 << (8 * width - 1), dtype=LE[width])[()]
    if kind == "random":
        nw[mask] = rng.integers(0, 256, (n, width), dtype=np.uint8).view(LE[width]).reshape(-1)[mask]
    elif kind in ("ulp", "floats"):
        step = rng.integers(-300, 301, n).astype(np.int64) if rng.random() < 0.3 else rng.integers(-2, 3, n).astype(np.int64)
        nw[mask] = (o[mask].astype(np.int64) + step[mask]).astype(LE[width], casting="unsafe")
    elif kind == "signflip":
        nw[mask] = o[mask] ^ top
    else:  # all-ones exponent patterns (NaN / inf of every float width) against anything
        nw[mask] = ~np.zeros(1, LE[width])[0] ^ (o[mask] & 1)
    seg = draw(st.sampled_from([4096, 1 << 20]))
    eager = draw(st.booleans())
    return width, old, new, seg, eager


@settings(max_examples=150, deadline=None)
@given(pairs())
def test_round_trip_is_exact_for_any_width_density_and_bits(case):
    width, old, new, seg, eager = case
    codec = Sparse2Codec(seg, *((0, 0) if eager else ()))
    enc = codec.encode(old, new, width, 1, "t")
    changed_elements = int(np.count_nonzero(old.view(LE[width]) != new.view(LE[width])))
    if changed_elements == 0:
        assert enc is None
        return
    assert enc.changed_elements == changed_elements
    assert enc.changed_bytes == int(np.count_nonzero(old != new))
    CODEC.check_structure(enc.payload, "t")
    CODEC.check(enc.payload, old.nbytes, width, "t")
    region = old.copy()
    CODEC.apply(region, enc.payload, width, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


def test_float_magnitudes_get_several_classes_and_fewer_bytes_than_sparse_v1(rng):
    """The reason for the encoding: small weights change more often than large ones."""
    w = (0.02 * rng.standard_normal(200_000)).astype(np.float32)
    step = (2e-5 * rng.standard_normal(w.size)).astype(np.float32)
    bf = lambda x: (x.view("<u4") >> 16).astype("<u2")  # noqa: E731  (truncation is fine here)
    old, new = bf(w).view(np.uint8), bf(w + step).view(np.uint8)
    v2 = CODEC.encode(old, new, 2, 1, "t")
    v1 = get_codec("sparse-v1").encode(old, new, 2, 1, "t")
    parsed = codec_sparse2.parse(v2.payload, old.nbytes, "t")
    assert len(parsed.segments[0].classes) >= 2
    assert len(v2.payload) < 0.9 * len(v1.payload)


def test_a_chain_applies_in_order_each_against_the_previous_bytes(rng):
    """Segment-major folding equals applying version by version, though each payload's
    classes come from the bytes the one before it produced."""
    n = 3 * 4096 + 100
    codec = Sparse2Codec(4096, 0, 0)
    versions = [(rng.standard_normal(n) * np.exp2(rng.integers(-12, 0, n))).astype(np.float32)]
    for _ in range(4):
        versions.append(versions[-1] * (1 + np.float32(1e-3) * rng.standard_normal(n).astype(np.float32)))
    raw = [v.view(np.uint8).copy() for v in versions]
    payloads = [codec.encode(a, b, 4, 1, "t").payload for a, b in zip(raw, raw[1:])]
    region = raw[0].copy()
    h = xxhash.xxh3_128()
    apply_sparse2_chain(region, payloads, "t", 1 << 16, h)
    assert region.tobytes() == raw[-1].tobytes()
    assert h.hexdigest() == xxhash.xxh3_128(raw[-1]).hexdigest()
    for a, b in ((0, 2), (2, 3)):  # segment ranges, as split workers apply them
        apply_sparse2_chain(part := raw[0].copy(), payloads, "t", 1 << 16, None, seg_range=(a, b))
        assert part[a * 4096 * 4 : b * 4096 * 4].tobytes() == raw[-1][a * 4096 * 4 : b * 4096 * 4].tobytes()


def test_a_chain_with_unequal_segmenting_applies_payload_by_payload(rng):
    n = 10_000
    a = (rng.standard_normal(n) * 0.01).astype(np.float32)
    b = a * np.float32(1.001)
    c = b * np.float32(0.999)
    raw = [x.view(np.uint8).copy() for x in (a, b, c)]
    p1 = Sparse2Codec(4096, 0, 0).encode(raw[0], raw[1], 4, 1, "t").payload
    p2 = Sparse2Codec(8192).encode(raw[1], raw[2], 4, 1, "t").payload
    region = raw[0].copy()
    apply_sparse2_chain(region, [p1, p2], "t", 1 << 16, None)
    assert region.tobytes() == raw[2].tobytes()


# --- bad payloads ---------------------------------------------------------------------------


def _valid(n=5000):
    """Two segments of 4096: the first with two classes, the second without change."""
    return build_payload(2, n, 4096, [([0x40], [(2000, [0, 5, 7], [1, -1, 9]), (2096, [3], [1])]), None]), n


def _region(n=5000):
    region = np.zeros(2 * n, np.uint8)
    region.view("<u2")[2000:4096] = 0x4000  # key 0x80: members of the second class
    return region


def _apply(payload, n, old=None):
    region = _region(n) if old is None else old.copy()
    before = region.copy()
    CODEC.check_structure(payload, "t")
    CODEC.check(payload, 2 * n, 2, "t")
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    return before, region


def _one_class(head: tuple, declared: list[int], data: bytes, n: int = 4) -> bytes:
    """A one-segment, one-class payload of ``n`` elements with a hand-written class."""
    table = struct.pack(CLASS, *head) + struct.pack(f"<{len(declared)}I", *declared)
    return build_payload(2, n, 4096, [([], [("raw", table, data)])])


def _refused_at_apply(bad: bytes, match: str, n: int = 4) -> None:
    CODEC.check_structure(bad, "t")
    region = np.zeros(2 * n, np.uint8)
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.apply(region, bad, 2, "t", 1 << 20)
    assert not region.any()


def test_the_valid_hand_built_payload_passes():
    payload, n = _valid()
    before, region = _apply(payload, n)
    r, b = region.view("<u2"), before.view("<u2")
    t = [_t_diff(int(b[i]), int(r[i]), 2) for i in (0, 5, 7)]
    assert t == [1, 0xFFFF, 9]
    assert _t_diff(int(b[2003]), int(r[2003]), 2) == 1
    assert int(np.count_nonzero(r != b)) == 4


@pytest.mark.parametrize(
    "offset,value,match",
    [(0, b"WSSQ", "starts with"), (4, b"\x01", "version 1"), (5, b"\x03", "element width"),
     (6, b"\x01", "reserved"), (7, b"\x01", "flags")],
)
def test_bad_header_fields_are_rejected(offset, value, match):
    payload, n = _valid()
    bad = payload[:offset] + value + payload[offset + len(value):]
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check_structure(bad, "t")


def test_wrong_element_count_for_the_tensor_is_rejected():
    payload, n = _valid()
    with pytest.raises(PayloadBoundError, match="the tensor has"):
        CODEC.check(payload, 2 * n + 2, 2, "t")


@pytest.mark.parametrize("seg", [4095, (1 << 20) + 1, 0])
def test_segment_size_outside_the_bounds_is_rejected(seg):
    bad = build_payload(2, 5000, seg, [None])
    with pytest.raises(PayloadBoundError, match="segment size"):
        CODEC.check_structure(bad, "t")


def test_wrong_segment_count_is_rejected():
    bad = build_payload(2, 5000, 4096, [None])
    with pytest.raises(PayloadBoundError, match="declares 1 segments"):
        CODEC.check_structure(bad, "t")


def test_too_many_classes_is_rejected():
    bad = build_payload(2, 100, 4096, [(list(range(1, 9)), [(0, [], [])] * 8 + [(100, [0], [1])])])
    with pytest.raises(PayloadBoundError, match="9 classes"):
        CODEC.check_structure(bad, "t")


@pytest.mark.parametrize("starts", [[0x40, 0x40], [0x40, 0x20], [0]])
def test_class_boundaries_must_increase_inside_the_key_range(starts):
    classes = [(50, [0], [1])] + [(25, [], [])] * len(starts)
    bad = build_payload(2, 100, 4096, [(starts, classes)])
    with pytest.raises(PayloadBoundError, match="not increasing"):
        CODEC.check_structure(bad, "t")


def test_member_counts_that_do_not_add_up_to_the_segment_are_rejected():
    bad = build_payload(2, 100, 4096, [([0x40], [(60, [0], [1]), (41, [1], [1])])])
    with pytest.raises(PayloadBoundError, match="101 members, the segment 100"):
        CODEC.check_structure(bad, "t")


@pytest.mark.parametrize("members,k,nbig,match", [(10, 11, 0, "11 changes"), (10, 2, 3, r"2 changes \(3 large")])
def test_more_changes_than_members_or_large_changes_than_changes_is_rejected(members, k, nbig, match):
    table = struct.pack(CLASS, members, k, nbig, 0, 2, 0, 0, 0, 0, 0, 0, 0) + struct.pack("<2I", 1, 1)
    bad = build_payload(2, 100, 4096, [([0x40], [(90, [0], [1]), ("raw", table, b"")])])
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check_structure(bad, "t")


@pytest.mark.parametrize("head", [(10, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0), (10, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0),
                                  (10, 1, 0, 0, 2, 0, 2, 0, 0, 0, 0, 0), (10, 1, 0, 0, 2, 0, 0, 0, 5, 0, 0, 0),
                                  (10, 1, 0, 0, 2, 0, 0, 0, 0, 0, 3, 0), (10, 2, 1, 0, 2, 0, 0, 4, 0, 0, 0, 0)])
def test_a_class_declares_no_mode_or_parameter_for_what_it_lacks(head):
    table = struct.pack(CLASS, *head)
    bad = build_payload(2, 100, 4096, [([0x40], [(90, [0], [1]), ("raw", table, b"\x01\x00")])])
    with pytest.raises(PayloadBoundError, match="no changes but|no large change but|no flagged change but"):
        CODEC.check_structure(bad, "t")


@pytest.mark.parametrize("head,match", [
    ((10, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0), "mask mode 3"),
    ((10, 2, 1, 1, 2, 0, 5, 0, 0, 0, 0, 0), "flag mode 5"),
    ((10, 1, 0, 0, 2, 4, 0, 0, 0, 0, 0, 0), "Rice parameter for a bitmap"),
    ((10, 2, 1, 1, 2, 0, 2, 3, 0, 0, 0, 0), "Rice parameter for a bitmap"),
    ((10, 1, 0, 0, 1, 21, 0, 0, 0, 0, 0, 0), "Rice parameters 21/0 exceed 20"),
    ((10, 2, 1, 1, 2, 0, 2, 0, 0, 9, 0, 0), "shift is at most 8"),
    ((10, 2, 1, 1, 2, 0, 2, 0, 15, 8, 0, 0), "constant order at most 14"),
])
def test_unknown_modes_and_out_of_range_parameters_are_rejected(head, match):
    table = struct.pack(CLASS, *head) + struct.pack("<4I", 1, 1, 1, 1)
    bad = build_payload(2, 100, 4096, [([0x40], [(90, [0], [1]), ("raw", table, b"")])])
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check_structure(bad, "t")


def test_classes_without_any_change_must_be_written_as_zero_classes():
    bad = build_payload(2, 100, 4096, [([0x40], [(90, [], []), (10, [], [])])])
    with pytest.raises(PayloadBoundError, match="no change"):
        CODEC.check_structure(bad, "t")


@pytest.mark.parametrize("head,declared,match", [
    ((100, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0), [0], r"gap quotients of 0 bytes, the counts allow 1 to 13"),
    ((100, 2, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0), [5], r"gap quotients of 5 bytes, the counts allow 1 to 2"),
    ((100, 8, 2, 2, 2, 0, 1, 1, 0, 8, 0, 0), [2, 1, 1], r"flag quotients of 2 bytes, the counts allow 1 to 1"),
    ((100, 8, 2, 2, 2, 0, 2, 0, 0, 8, 0, 0), [2, 1, 1], r"flag bitmap of 2 bytes, the counts allow 1 to 1"),
    ((100, 8, 2, 2, 2, 0, 2, 0, 0, 8, 0, 0), [1, 5, 1], r"value remainders of 5 bytes, the counts allow at most 4"),
    ((100, 8, 2, 2, 2, 0, 2, 0, 0, 8, 0, 0), [1, 1, 5], r"value quotients of 5 bytes, the counts allow 1 to 4"),
])
def test_declared_part_sizes_beyond_what_the_counts_allow_are_rejected_at_load(head, declared, match):
    """Decoding work is tied to the segment: a quotient part holds terminators plus the zeros
    the counts allow, a value field at most 8 width - 1 bits."""
    table = struct.pack(CLASS, *head) + struct.pack(f"<{len(declared)}I", *declared)
    bad = build_payload(2, 100, 4096, [([], [("raw", table, b"\0" * 64)])])
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check_structure(bad, "t")


def test_truncated_table_and_streams_are_rejected():
    payload, n = _valid()
    for cut in (10, 30, 40, 60, len(payload) - 1):
        with pytest.raises(PayloadBoundError):
            CODEC.check_structure(payload[:cut], "t")


def test_trailing_bytes_are_rejected():
    payload, n = _valid()
    with pytest.raises(PayloadBoundError, match="trailing"):
        CODEC.check_structure(payload + b"\0", "t")


def test_a_change_past_its_class_members_is_rejected_before_the_segment_is_written():
    # class of 4 members, one change: Rice r = 0, gap 4 (unary 00001): index 4 is past 4 members
    bad = _one_class((4, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0), [1], _bits((16, 5)) + b"\x00")
    _refused_at_apply(bad, "index 4 is past its 4 slots")


@pytest.mark.parametrize("quo,match", [(_bits((1, 1), (1, 2)), "2 terminators, the table declares 1"),
                                       (b"\x01\x00", "1 bytes after the last terminator")])
def test_quotient_parts_must_hold_exactly_their_terminators(quo, match):
    bad = _one_class((40, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0), [len(quo)], quo + b"\x00", n=40)
    _refused_at_apply(bad, match, n=40)


def test_set_padding_bits_are_rejected():
    cases = [
        ((40, 1, 0, 0, 1, 3, 0, 0, 0, 0, 0, 0), [1], b"\xf9" + b"\x01" + b"\x00", "remainders have set bits"),  # 3-bit remainder
        ((4, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0), [], b"\x11" + b"\x00", "changes have set bits"),  # bitmap past 4 members
        ((4, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0), [], b"\x01" + b"\x02", "signs have set bits"),
    ]
    for head, declared, data, match in cases:
        n = head[0]
        _refused_at_apply(_one_class(head, declared, data, n=n), match, n=n)


def test_a_bitmap_marking_another_count_than_declared_is_rejected():
    bad = _one_class((4, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0), [], b"\x03" + b"\x00")
    _refused_at_apply(bad, "marks 2, the table declares 1")


def test_value_fields_must_be_exactly_the_bytes_their_lengths_need():
    # two changes, both large without a flag (their key 0 is below flag_lo 1), constant order 0:
    # lengths 0 and 0 -> no field bits, but one field byte
    bad = _one_class((4, 2, 2, 0, 2, 0, 0, 0, 0, 8, 1, 0), [1, 1], b"\x03" + b"\x00" + b"\x00" + _bits((1, 1), (1, 1)))
    _refused_at_apply(bad, "fields hold 1 bytes, their widths need 0")


def test_a_value_wider_than_the_element_is_rejected_before_the_segment_is_written():
    # one large change, constant order 1, length 15: a 17-bit w, its field of 16 bits (at most 15)
    lengths = _bits((0, 15), (1, 1))
    bad = _one_class((4, 1, 1, 1, 2, 0, 2, 0, 1, 8, 0, 0), [1, 2, len(lengths)], b"\x01" + b"\x00" + b"\x01" + b"\xff\x7f" + lengths)
    _refused_at_apply(bad, "16-bit field, at most 15 fit")


def test_a_magnitude_above_half_the_range_is_rejected():
    # order 0, length 15, field 0: w = 0x8000, value 0x7fff, |d| = 0x8001 > 2^15
    lengths = _bits((0, 15), (1, 1))
    bad = _one_class((4, 1, 1, 1, 2, 0, 2, 0, 0, 8, 0, 0), [1, 2, len(lengths)], b"\x01" + b"\x00" + b"\x01" + b"\x00\x00" + lengths)
    _refused_at_apply(bad, "magnitude above 2")


def test_keys_and_flags_that_make_another_count_of_large_changes_are_rejected():
    # nbig 1, but both changes have key 0 < flag_lo 1: both are large
    bad = _one_class((4, 2, 1, 0, 2, 0, 0, 0, 0, 8, 1, 0), [0, 1], b"\x03" + b"\x00" + _bits((1, 1)))
    _refused_at_apply(bad, "make 2 large changes, the table declares 1")


def test_large_changes_follow_from_the_keys_and_the_flags_of_the_others():
    """Keys below flag_lo: large without a flag; above flag_hi: not large; between: flagged,
    here by the Rice code of the candidates that are not large (flag mode 3)."""
    old = _u8([0x0100, 0x3F00, 0x3F00, 0x3F00, 0x4000])  # keys 0x02, 0x7e x 3, 0x80
    d = [5, 3, 1, 4, 1]  # large, large, not, large, not
    new = _u8([(independent.v2_unorder((independent.v2_order(o, 2) + x) % (1 << 16), 2)) for o, x in zip(
        [0x0100, 0x3F00, 0x3F00, 0x3F00, 0x4000], d)])
    payload = EAGER.encode(old, new, 2, 1, "t").payload
    part = codec_sparse2.parse(payload, old.nbytes, "t").segments[0].classes[0]
    assert (part.nbig, part.flag_lo, part.flag_hi, part.flag_mode, part.nflag) == (3, 0x7E, 0x7E, 3, 1)
    region = old.copy()
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()
    assert independent.apply_sparse_v2(old.tobytes(), payload) == new.tobytes()


def test_local_bytes_whose_classes_differ_from_the_payload_fail_before_the_segment_is_written():
    """The member counts travel: a local tensor that is not the base version is caught by
    its classes before any write (LocalStateError: the puller reseeds and replays)."""
    payload, n = _valid()
    old = np.zeros(2 * n, np.uint8)
    old.view("<u2")[2001:4096] = 0x4000  # one member fewer in the second class
    before = old.copy()
    with pytest.raises(LocalTensorMismatchError, match="hold 2001 elements"):
        CODEC.apply(old, payload, 2, "t", 1 << 20)
    assert old.tobytes() == before.tobytes()


def test_segment_table_larger_than_the_payload_is_rejected_without_looping():
    bad = b"WSS2" + bytes([2, 2, 0, 0]) + struct.pack("<QII", 1 << 40, 1 << 20, 1 << 20)
    with pytest.raises(PayloadBoundError, match="runs past"):
        CODEC.check_structure(bad, "t")


# --- publish and pull -------------------------------------------------------------------------


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 4096 elements, free classes and no split floor: test-sized tensors get
    several classes and are cut into parts across workers."""
    from weightsync.puller import apply as apply_mod
    from weightsync.publisher import encode as encode_mod  # the publisher's encode scheduling

    monkeypatch.setattr(codec_sparse2.CODEC, "seg_elements", 4096)
    monkeypatch.setattr(codec_sparse2.CODEC, "class_min_saving", 0.0)
    monkeypatch.setattr(codec_sparse2.CODEC, "class_overhead_bytes", 0)
    monkeypatch.setattr(apply_mod, "SPLIT_MIN_NBYTES", 0)
    monkeypatch.setattr(encode_mod, "SPLIT_MIN_NBYTES", 0)


def _float_chain(tmp, rng, versions: int, bitstream: int):
    """fp32 weights of spread magnitudes nudged each version, plus raw uint16 bits and a tiny
    tensor; every delta payload is checked to be of ``bitstream``."""
    import glob
    import os

    from core_support import write_hf_checkpoint

    from weightsync import Publisher
    from weightsync.format.layout import version_dir
    from weightsync.format.safetensors_io import read_header

    v = {"big": (0.02 * rng.standard_normal((40, 500)) * np.exp2(rng.integers(-6, 1, (40, 500)))).astype(np.float32),
         "bf": rng.integers(0, 1 << 16, (9, 1000)).astype(np.uint16),
         "tiny": rng.standard_normal(5).astype(np.float32)}
    write_hf_checkpoint(str(tmp / "seed"), v)
    pub = Publisher(str(tmp / "src"), encoding="sparse-v2", workers=2)
    pub.seed_snapshot(v)
    history = [v]
    for i in range(1, versions + 1):
        v = {n: a.copy() for n, a in v.items()}
        moved = rng.random(v["big"].shape) < 0.1
        v["big"][moved] += np.float32(1e-4) * rng.standard_normal(int(moved.sum())).astype(np.float32)
        v["bf"][rng.random(v["bf"].shape) < 0.05] += 1
        v["tiny"][i % 5] += np.float32(1e-3)
        assert pub.publish(i, v).kind == "delta"
        history.append(v)
    pub.close()
    for i in range(1, versions + 1):
        (shard,) = glob.glob(os.path.join(version_dir(str(tmp / "src"), i), "delta-*.safetensors"))
        header = read_header(shard)
        with open(shard, "rb") as f:
            for name in ("big", "bf", "tiny"):
                f.seek(header.tensors[name].offset + 4)
                assert f.read(1) == bytes([bitstream]), (i, name)
    return history


@pytest.fixture(params=[2, 3])
def bitstream(request, monkeypatch):
    """Both bitstreams (3 needs the compiled coder)."""
    if request.param == 3 and not codec_sparse2.compiled_coder_available():
        pytest.skip("the compiled range coder is not built")
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", str(request.param))
    return request.param


def test_publish_and_pull_a_sparse_v2_chain_split_across_workers(small_segments, bitstream, fast_tmp_path, rng):
    from core_support import assert_checkpoint_is, tensor_bytes

    from weightsync.puller import apply as apply_mod
    from weightsync import pull

    history = _float_chain(fast_tmp_path, rng, 4, bitstream)
    local, seed, src = (str(fast_tmp_path / n) for n in ("local", "seed", "src"))
    res = pull(local, seed, src, 1, workers=3)
    assert res.applied_version == 1
    assert_checkpoint_is(local, tensor_bytes(history[1]))
    plans = []
    real_plan = apply_mod._split_plan
    apply_mod._split_plan = lambda jobs, workers: plans.append(real_plan(jobs, workers)) or plans[-1]
    try:
        res = pull(local, seed, src, 4, workers=3)  # a folded chain of three, "big" in parts
    finally:
        apply_mod._split_plan = real_plan
    assert res.applied_version == 4 and res.deltas_applied == 3 and not res.reseeded
    assert_checkpoint_is(local, tensor_bytes(history[4]))
    assert any(len(p.get("big", [])) > 1 for p in plans), plans


@pytest.mark.parametrize("byte,caught", [(1003, "exponent"), (1001, "mantissa")])
def test_local_damage_under_a_sparse_v2_chain_reseeds_and_replays(small_segments, bitstream, fast_tmp_path, rng, caplog, byte, caught):
    """Byte 3 of an fp32 holds exponent bits: the element's class (bitstream 2) or the coder's
    context (3) changes, and the member counts, or the part's clean decode, catch it before the
    segment is written; byte 1 is mantissa: the digest catches it."""
    import logging

    from core_support import assert_checkpoint_is, flip_local_byte, tensor_bytes

    from weightsync import pull

    caught_by = "failed verification" if caught == "mantissa" else {
        2: "the local bytes hold", 3: "does not decode against the local bytes"}[bitstream]
    history = _float_chain(fast_tmp_path, rng, 3, bitstream)
    local, seed, src = (str(fast_tmp_path / n) for n in ("local", "seed", "src"))
    pull(local, seed, src, 1, workers=2)
    flip_local_byte(local, "big", byte)
    with caplog.at_level(logging.WARNING, logger="weightsync"):
        res = pull(local, seed, src, 3, workers=2)
    assert res.applied_version == 3 and res.reseeded
    assert caught_by in caplog.text
    assert_checkpoint_is(local, tensor_bytes(history[3]))


def test_broken_sparse_v2_payload_is_refused_at_load_before_any_seed(tmp_path):
    import os

    from core_support import publish_one_sparse2_delta

    from weightsync import errors, pull

    seed, source, local, shard, at = publish_one_sparse2_delta(str(tmp_path))
    with open(shard, "r+b") as f:  # break the segment table: more classes than allowed
        f.seek(at + codec_sparse2.HEADER.size)
        f.write(bytes([9]))
    with pytest.raises(errors.PayloadBoundError, match=r"v2: tensor w"):
        pull(local, seed, source, 2)
    seeded = os.path.exists(local) and any(f.endswith(".safetensors") for f in os.listdir(local))
    assert not seeded, "the seed ran before the broken payload was refused"


def test_the_class_saving_knob_trades_bytes_for_fewer_passes(monkeypatch, rng):
    """WEIGHTSYNC_SPARSE2_CLASS_MIN_SAVING: a class must save this many bytes per element; a
    large value leaves one class (no pass over the segment at apply), at more bytes."""
    w = (0.02 * rng.standard_normal(200_000)).astype(np.float32)
    step = (2e-5 * rng.standard_normal(w.size)).astype(np.float32)
    bf = lambda x: (x.view("<u4") >> 16).astype("<u2")  # noqa: E731
    old, new = bf(w).view(np.uint8), bf(w + step).view(np.uint8)
    payloads = {}
    for saving in ("0", "1e9"):
        monkeypatch.setenv("WEIGHTSYNC_SPARSE2_CLASS_MIN_SAVING", saving)
        payloads[saving] = CODEC.encode(old, new, 2, 1, "t").payload
        region = old.copy()
        CODEC.apply(region, payloads[saving], 2, "t", 1 << 20)
        assert region.tobytes() == new.tobytes()
    classes = {s: len(codec_sparse2.parse(p, old.nbytes, "t").segments[0].classes) for s, p in payloads.items()}
    assert classes["0"] >= 3 and classes["1e9"] == 1
    assert len(payloads["0"]) < len(payloads["1e9"])
