"""sparse-v2 bitstream 3 (the range-coded segments): the golden vector, agreement with the
independent reader of ``interop_writer`` (written from docs/FORMAT.md, "Bitstream 3", alone),
round trips, the size it saves on float weights, one test per abuse-catalogue row, chains
(pure and mixed with bitstream 2), a local tensor that is not the base version, an install
without the compiled coder, the bitstream knob, and publish + pull across workers.

Bad payloads are made from valid ones by editing the 8-byte segment entries and the coded
parts, so each test breaks exactly one rule while every other byte stays valid.
"""

from __future__ import annotations

import glob
import os
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import interop_writer as independent
from weightsync.codecs import sparse_v2 as codec_sparse2
from weightsync.codecs.sparse_v2 import HEADER, RC_ENTRY, Sparse2Codec, writer_bitstream
from weightsync.codecs import get_codec
from weightsync.errors import CoderUnavailableError, InvalidKnobError, LocalTensorMismatchError, PayloadBoundError

needs_coder = pytest.mark.skipif(not codec_sparse2.compiled_coder_available(), reason="the compiled range coder is not built")

LE = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
CODEC = get_codec("sparse-v2")
# the smallest segment: several segments on small arrays
RC = Sparse2Codec(4096, bitstream=3) if codec_sparse2.compiled_coder_available() else None
V2 = Sparse2Codec(4096, bitstream=2)

# FORMAT.md, "Bitstream 3", Example: bf16 bits, elements 0 and 2 (1/128, key 0x78) move +1, -3
GOLDEN_OLD = [0x3C00, 0x3F80, 0x3C00]
GOLDEN_NEW = [0x3C01, 0x3F80, 0x3BFD]
GOLDEN_HEX = (
    "57535332" "03" "02" "00" "00"  # magic, version 3, width 2, reserved 0, flags 0
    "0300000000000000" "00100000" "01000000"  # 3 elements, segments of 4096, 1 segment
    "02000000" "06000000"  # segment 0: 2 changes, 6 coded bytes
    "008fbf800000"  # its coded part (first byte 0)
)


def _u8(values, width=2) -> np.ndarray:
    return np.array(values, dtype=LE[width]).view(np.uint8).copy()


def _nudged(rng, width: int, n: int, density: float, kind: str = "ulp") -> tuple[np.ndarray, np.ndarray]:
    """Random old bytes; a ``density`` share of the elements moved by a few ulps in float
    order ("ulp") or replaced by any bits ("random")."""
    old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy()
    o, nw = old.view(LE[width]), new.view(LE[width])
    mask = rng.random(n) < density
    if kind == "random":
        nw[mask] = rng.integers(0, 256, n * width, dtype=np.uint8).view(LE[width])[mask]
    else:
        step = rng.integers(-300, 301, n).astype(np.int64)
        nw[mask] = (o[mask].astype(np.int64) + step[mask]).astype(LE[width], casting="unsafe")
    return old, new


def _apply(payload: bytes, old: np.ndarray, width: int, codec=CODEC) -> np.ndarray:
    codec.check_structure(payload, "t")
    codec.check(payload, old.nbytes, width, "t")
    region = old.copy()
    codec.apply(region, payload, width, "t", 1 << 20)
    return region


def _assert_reads_back(payload: bytes, old: np.ndarray, new: np.ndarray, width: int) -> None:
    assert payload[4] == 3
    assert _apply(payload, old, width).tobytes() == new.tobytes()
    assert independent.apply_payload("sparse-v2", old.tobytes(), payload) == new.tobytes()


# --- the golden vector and the independent reader ---------------------------------------------


@needs_coder
def test_golden_vector_encodes_to_exact_bytes():
    enc = RC.encode(_u8(GOLDEN_OLD), _u8(GOLDEN_NEW), 2, 1, "t")
    assert enc.payload.hex() == GOLDEN_HEX
    assert len(enc.payload) == 38
    assert (enc.changed_elements, enc.changed_bytes) == (2, 3)


@needs_coder
def test_golden_vector_decodes_and_the_independent_reader_agrees():
    old, new, payload = _u8(GOLDEN_OLD), _u8(GOLDEN_NEW), bytes.fromhex(GOLDEN_HEX)
    assert _apply(payload, old, 2).tobytes() == new.tobytes()
    assert independent.apply_sparse_v2_rc(old.tobytes(), payload) == new.tobytes()
    assert independent.apply_payload("sparse-v2", old.tobytes(), payload) == new.tobytes()


@needs_coder
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("density,kind", [(0.003, "ulp"), (0.1, "ulp"), (0.6, "random"), (1.0, "ulp")])
def test_the_independent_reader_decodes_the_codecs_segments_of_every_width_and_density(width, density, kind):
    """Two segments of 4096 and a short third (more than 64 elements each: the window of
    previous changes slides), decoded by the spec-only reader to the same bytes."""
    rng = np.random.default_rng(width * 1000 + int(density * 100))
    n = 2 * 4096 + 700 if density < 0.5 else 4096 + 300  # the reader is plain Python: dense ones smaller
    old, new = _nudged(rng, width, n, density, kind)
    enc = RC.encode(old, new, width, 1, "t")
    assert struct.unpack_from("<I", enc.payload, 20)[0] == -(-n // 4096)
    _assert_reads_back(enc.payload, old, new, width)


@needs_coder
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_tiny_tensors_round_trip_and_the_independent_reader_agrees(width, n):
    rng = np.random.default_rng(n * 10 + width)
    old, new = _nudged(rng, width, n, 1.0, "random" if n % 2 else "ulp")
    enc = RC.encode(old, new, width, 1, "t")
    _assert_reads_back(enc.payload, old, new, width)


@needs_coder
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_the_largest_differences_code_with_the_capped_length_and_no_terminator(width):
    """|d| = 2^(8 width - 1) (T(new) - T(old) = half the range: a length of 8 width - 2, no
    terminating 0) and its neighbours, each sign, at keys 0 and the top key."""
    bits = 8 * width
    half, top = 1 << (bits - 1), (1 << bits) - 1
    olds = [0, 1, half - 1, top, half, 5, 1 << (bits - 2), 0]
    news = [independent.v2_unorder((independent.v2_order(x, width) + d) % (1 << bits), width)
            for x, d in zip(olds, [half, half - 1, half - 2, -(half - 1), 2, -2, 3, 1])]
    old, new = _u8(olds, width), _u8(news, width)
    enc = RC.encode(old, new, width, 1, "t")
    _assert_reads_back(enc.payload, old, new, width)


@needs_coder
@pytest.mark.parametrize("width", [2, 4, 8])
def test_old_new_and_local_bytes_at_unaligned_addresses_code_and_decode(width):
    """Tensors of a safetensors file sit at any byte offset of the mapped file."""
    rng = np.random.default_rng(width)
    n = 4096 + 900
    old = np.zeros(n * width + 1, np.uint8)[1:]
    new = np.zeros(n * width + 1, np.uint8)[1:]
    old[:] = rng.integers(0, 256, n * width, dtype=np.uint8)
    new[:] = old
    new[:: 7 * width] ^= 1
    payload = RC.encode(old, new, width, 1, "t").payload
    region = np.zeros(n * width + 3, np.uint8)[3:]
    region[:] = old
    CODEC.apply(region, payload, width, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


@st.composite
def pairs(draw):
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.sampled_from([1, 3, 65, 300, 5000]))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 1.0]))
    kind = draw(st.sampled_from(["random", "ulp", "signflip"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = _nudged(rng, width, n, density, "random" if kind == "random" else "ulp")
    if kind == "signflip":
        new = old.copy()
        mask = rng.random(n) < density
        new.view(LE[width])[mask] ^= np.array(1 << (8 * width - 1), dtype=LE[width])[()]
    return width, old, new


@needs_coder
@given(pairs())
def test_round_trip_is_exact_for_any_bytes_of_any_width(case):
    """The profile sets the examples (``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough`` for many)."""
    width, old, new = case
    enc = RC.encode(old, new, width, 1, "t")
    changed = int(np.count_nonzero(old.view(LE[width]) != new.view(LE[width])))
    if changed == 0:
        assert enc is None
        return
    assert (enc.changed_elements, enc.changed_bytes) == (changed, int(np.count_nonzero(old != new)))
    assert _apply(enc.payload, old, width).tobytes() == new.tobytes()
    if old.size <= 300 * width:
        assert independent.apply_payload("sparse-v2", old.tobytes(), enc.payload) == new.tobytes()


# --- size -----------------------------------------------------------------------------------


def _adam_like_weights(rng, n: int):
    """fp32 weights of magnitudes spread over 2^-12..2^1 and steps of about the same scale
    everywhere (an Adam update, lr 1e-5), so small weights move by more ulps and more often."""
    w = (0.02 * rng.standard_normal(n) * np.exp2(rng.integers(-12, 1, n))).astype(np.float32)
    step = (1e-5 * rng.standard_normal(n)).astype(np.float32)
    return w, w + step


@needs_coder
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_float_weights_with_adam_like_steps_take_fewer_bytes_than_bitstream_2_and_sparse_v1(dtype, rng):
    w, moved = _adam_like_weights(rng, 100_000)
    if dtype == "bf16":
        bf = lambda x: (x.view("<u4") >> 16).astype("<u2")  # noqa: E731  (truncation is fine here)
        w, moved = bf(w), bf(moved)
    old, new = w.view(np.uint8), moved.view(np.uint8)
    width = w.dtype.itemsize
    rc = Sparse2Codec(bitstream=3).encode(old, new, width, 1, "t").payload
    v2 = Sparse2Codec(bitstream=2).encode(old, new, width, 1, "t").payload
    v1 = get_codec("sparse-v1").encode(old, new, width, 1, "t").payload
    assert (rc[4], v2[4]) == (3, 2)
    assert len(rc) < len(v2) and len(rc) < len(v1), (len(rc), len(v2), len(v1))
    assert _apply(rc, old, width).tobytes() == new.tobytes()


@needs_coder
def test_a_step_of_one_size_costs_few_bytes_because_the_low_bits_are_modelled(rng):
    """Adam's first step is sign-only: every element of one exponent moves by the same number
    of fp32 ulps, thousands of them. Coded raw, those low bits made bitstream 3 1.4x sparse-v1's
    bytes; modelled by length and position they cost a fraction of it."""
    w = (0.02 * rng.standard_normal(100_000)).astype(np.float32)
    moved = rng.random(w.size) < 0.7
    new = (w - np.float32(1e-5) * np.sign(rng.standard_normal(w.size)).astype(np.float32) * moved).astype(np.float32)
    old_u8, new_u8 = w.view(np.uint8), new.view(np.uint8)
    rc = Sparse2Codec(bitstream=3).encode(old_u8, new_u8, 4, 1, "t").payload
    v1 = get_codec("sparse-v1").encode(old_u8, new_u8, 4, 1, "t").payload
    assert len(rc) < 0.5 * len(v1), (len(rc), len(v1))
    assert _apply(rc, old_u8, 4).tobytes() == new_u8.tobytes()


# --- abuse catalogue: load ------------------------------------------------------------------


def _valid():
    """Three segments: 4096 elements with changes, 4096 without, 808 with changes (width 2)."""
    rng = np.random.default_rng(11)
    n = 2 * 4096 + 808
    old, new = _nudged(rng, 2, n, 0.05)
    new.view("<u2")[4096:8192] = old.view("<u2")[4096:8192]
    payload = RC.encode(old, new, 2, 1, "t").payload
    return payload, old, new


def _split(payload: bytes) -> tuple[bytes, list[list[int]], list[bytes]]:
    """(header, [[k, b] per segment], [coded part per segment, b"" when none])."""
    nseg = struct.unpack_from("<I", payload, 20)[0]
    entries = [list(RC_ENTRY.unpack_from(payload, HEADER.size + 8 * s)) for s in range(nseg)]
    parts, pos = [], HEADER.size + 8 * nseg
    for _, b in entries:
        parts.append(payload[pos : pos + b])
        pos += b
    assert pos == len(payload)
    return payload[: HEADER.size], entries, parts


def _join(head: bytes, entries, parts, tail: bytes = b"") -> bytes:
    return head + b"".join(RC_ENTRY.pack(k, b) for k, b in entries) + b"".join(parts) + tail


def _refused_at_load(bad: bytes, match: str, nbytes: int) -> None:
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check_structure(bad, "t")
    with pytest.raises(PayloadBoundError, match=match):
        CODEC.check(bad, nbytes, 2, "t")


@needs_coder
def test_the_valid_payload_has_three_segments_the_middle_one_unchanged():
    payload, old, new = _valid()
    head, entries, parts = _split(payload)
    assert len(entries) == 3 and entries[1] == [0, 0] and entries[0][0] > 0 and entries[2][0] > 0
    assert _join(head, entries, parts) == payload
    assert _apply(payload, old, 2).tobytes() == new.tobytes()


@needs_coder
def test_a_segment_with_more_changes_than_elements_is_rejected_at_load():
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[2][0] = 809  # the last segment has 808 elements
    _refused_at_load(_join(head, entries, parts), "more changes than it has elements", old.nbytes)


@needs_coder
def test_changes_without_a_coded_part_are_rejected_at_load():
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[2][1], parts[2] = 0, b""
    _refused_at_load(_join(head, entries, parts), "changes without a coded part", old.nbytes)


@needs_coder
def test_a_coded_part_without_changes_is_rejected_at_load():
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[1][1], parts[1] = 5, bytes(5)
    _refused_at_load(_join(head, entries, parts), "coded part without changes", old.nbytes)


@needs_coder
@pytest.mark.parametrize("size", [1, 4])
def test_a_coded_part_under_five_bytes_is_rejected_at_load(size):
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[2][1], parts[2] = size, parts[2][:size]
    _refused_at_load(_join(head, entries, parts), "shorter than the coder's 5 start bytes", old.nbytes)


@needs_coder
def test_parts_past_the_payload_are_rejected_at_load():
    payload, old, _ = _valid()
    _refused_at_load(payload[:-1], "coded parts need", old.nbytes)


@needs_coder
def test_trailing_bytes_are_rejected_at_load():
    payload, old, _ = _valid()
    _refused_at_load(payload + b"\0", "1 trailing bytes", old.nbytes)


@needs_coder
def test_a_table_past_the_payload_is_rejected_at_load_without_looping():
    bad = b"WSS2" + bytes([3, 2, 0, 0]) + struct.pack("<QII", 1 << 40, 1 << 20, 1 << 20)
    with pytest.raises(PayloadBoundError, match="runs past"):
        CODEC.check_structure(bad, "t")


@needs_coder
@pytest.mark.parametrize(
    "offset,value,match",
    [
        (0, b"WSS3", "starts with"),
        (4, bytes([4]), "version"),
        (5, bytes([3]), "width"),
        (6, bytes([1]), "reserved"),
        (7, bytes([1]), "flags"),
        (16, struct.pack("<I", 2048), "segment size 2048"),
        (16, struct.pack("<I", (1 << 20) + 1), "segment size 1048577"),
        (20, struct.pack("<I", 4), "segment"),
    ],
)
def test_bad_header_fields_of_version_3_are_rejected_at_load(offset, value, match):
    payload, old, _ = _valid()
    bad = payload[:offset] + value + payload[offset + len(value) :]
    _refused_at_load(bad, match, old.nbytes)


@needs_coder
def test_an_element_count_that_is_not_the_tensors_is_rejected():
    payload, old, _ = _valid()
    structure = CODEC.check_structure(payload, "t")
    with pytest.raises(PayloadBoundError, match="the tensor has"):
        CODEC.check_fit(structure, old.nbytes + 2, 2, "t")
    with pytest.raises(PayloadBoundError):
        CODEC.check(payload, old.nbytes + 2, 2, "t")


# --- abuse catalogue: apply (the local bytes are the base; the part is damaged) -------------


def _refused_at_apply(bad: bytes, old: np.ndarray, match: str = "does not decode against the local bytes") -> None:
    """Valid structure; the apply refuses it and leaves the region exactly as it was."""
    CODEC.check_structure(bad, "t")
    CODEC.check(bad, old.nbytes, 2, "t")
    region = old.copy()
    with pytest.raises(LocalTensorMismatchError, match=match):
        CODEC.apply(region, bad, 2, "t", 1 << 20)
    assert region.tobytes() == old.tobytes()
    with pytest.raises(AssertionError):  # the spec-only reader refuses it too
        independent.apply_payload("sparse-v2", old.tobytes(), bad)


def _damage_first_part(fix) -> tuple[bytes, np.ndarray]:
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[0], parts[0] = fix(entries[0], parts[0])
    return _join(head, entries, parts), old


@needs_coder
def test_a_coded_part_whose_first_byte_is_not_0_is_refused_before_the_segment_is_written():
    bad, old = _damage_first_part(lambda e, p: (e, b"\x01" + p[1:]))
    _refused_at_apply(bad, old)


@needs_coder
def test_a_coded_part_that_ends_before_its_decisions_is_refused_before_the_segment_is_written():
    bad, old = _damage_first_part(lambda e, p: ([e[0], e[1] - 1], p[:-1]))
    _refused_at_apply(bad, old)


@needs_coder
def test_a_coded_part_with_bytes_after_its_decisions_is_refused_before_the_segment_is_written():
    bad, old = _damage_first_part(lambda e, p: ([e[0], e[1] + 1], p + b"\0"))
    _refused_at_apply(bad, old)


@needs_coder
@pytest.mark.parametrize("delta", [1, -1])
def test_a_part_that_decodes_another_count_of_changes_than_declared_is_refused(delta):
    bad, old = _damage_first_part(lambda e, p: ([e[0] + delta, e[1]], p))
    _refused_at_apply(bad, old)


@needs_coder
def test_a_damaged_later_segment_is_refused_before_that_segment_is_written():
    """Segments are independent: the failing one is not written (earlier ones may be)."""
    payload, old, _ = _valid()
    head, entries, parts = _split(payload)
    entries[2][0] -= 1
    bad = _join(head, entries, parts)
    region = old.copy()
    with pytest.raises(LocalTensorMismatchError, match="segment 2"):
        CODEC.apply(region, bad, 2, "t", 1 << 20)
    assert region[2 * 8192 :].tobytes() == old[2 * 8192 :].tobytes()


@needs_coder
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["flip", "base"]))
def test_a_damaged_part_or_base_is_refused_or_decoded_exactly_as_the_spec_reader_does(seed, width, damage):
    """Differential: random bytes of a coded part flipped (or local bytes that are not the base):
    the compiled decoder and the spec-only reader refuse the same payloads, a refusal leaves the
    region untouched, and what both accept decodes to the same bytes."""
    rng = np.random.default_rng(seed)
    old, new = _nudged(rng, width, int(rng.integers(1, 200)), float(rng.choice([0.05, 0.5, 1.0])))
    if (old == new).all():
        return
    payload = bytearray(RC.encode(old, new, width, 1, "t").payload)
    base = old.copy()
    if damage == "flip":
        at = HEADER.size + 8 + int(rng.integers(1, len(payload) - HEADER.size - 8))  # keep the first byte 0
        payload[at] ^= int(rng.integers(1, 256))
    else:
        base[int(rng.integers(0, base.size))] ^= int(rng.integers(1, 256))
    region = base.copy()
    try:
        CODEC.apply(region, bytes(payload), width, "t", 1 << 20)
        ours = region.tobytes()
    except LocalTensorMismatchError:
        assert region.tobytes() == base.tobytes()
        ours = None
    try:
        theirs = independent.apply_payload("sparse-v2", base.tobytes(), bytes(payload))
    except AssertionError:
        theirs = None
    assert ours == theirs


# --- the local bytes are not the base version ---------------------------------------------------


@needs_coder
def test_local_bytes_that_are_not_the_base_fail_before_the_segment_is_written():
    """fp32 byte 3 holds the exponent: the flipped element's key, so every later context,
    differs from the encoder's, and the part does not decode cleanly against it."""
    rng = np.random.default_rng(3)
    w, moved = _adam_like_weights(rng, 3000)
    old, new = w.view(np.uint8).copy(), moved.view(np.uint8).copy()
    payload = RC.encode(old, new, 4, 1, "t").payload
    damaged = old.copy()
    damaged[4 * 10 + 3] ^= 0x5A
    CODEC.check(payload, damaged.nbytes, 4, "t")
    region = damaged.copy()
    with pytest.raises(LocalTensorMismatchError, match="not the version the delta builds on"):
        CODEC.apply(region, payload, 4, "t", 1 << 20)
    assert region.tobytes() == damaged.tobytes()
    with pytest.raises(AssertionError):
        independent.apply_payload("sparse-v2", damaged.tobytes(), payload)


# --- chains -----------------------------------------------------------------------------------


def _versions(rng, n: int, count: int) -> list[np.ndarray]:
    versions = [(rng.standard_normal(n) * np.exp2(rng.integers(-12, 0, n))).astype(np.float32)]
    for _ in range(count - 1):
        versions.append(versions[-1] * (1 + np.float32(1e-3) * rng.standard_normal(n).astype(np.float32)))
    return [v.view(np.uint8).copy() for v in versions]


def _apply_chain(payloads, base: np.ndarray, hasher=None, seg_range=None) -> np.ndarray:
    structures = [CODEC.check_structure(p, "t") for p in payloads]
    region = base.copy()
    CODEC.apply_chain(region, payloads, structures, "t", 1 << 16, hasher, seg_range=seg_range)
    return region


@needs_coder
def test_a_bitstream_3_chain_applies_in_order_each_against_the_previous_bytes(rng):
    n = 3 * 4096 + 100
    raw = _versions(rng, n, 5)
    payloads = [RC.encode(a, b, 4, 1, "t").payload for a, b in zip(raw, raw[1:])]
    assert CODEC.chain_segment_count([CODEC.check_structure(p, "t") for p in payloads]) == 4
    h = xxhash.xxh3_128()
    assert _apply_chain(payloads, raw[0], h).tobytes() == raw[-1].tobytes()
    assert h.hexdigest() == xxhash.xxh3_128(raw[-1]).hexdigest()
    for a, b in ((0, 2), (2, 4)):  # segment ranges, as split workers apply them
        part = _apply_chain(payloads, raw[0], seg_range=(a, b))
        assert part[a * 4096 * 4 : b * 4096 * 4].tobytes() == raw[-1][a * 4096 * 4 : b * 4096 * 4].tobytes()


@needs_coder
def test_a_chain_mixing_bitstreams_2_and_3_applies_in_order(rng):
    n = 2 * 4096 + 300
    raw = _versions(rng, n, 5)
    codecs = [RC, V2, RC, V2]
    payloads = [c.encode(a, b, 4, 1, "t").payload for c, a, b in zip(codecs, raw, raw[1:])]
    assert [p[4] for p in payloads] == [3, 2, 3, 2]
    h = xxhash.xxh3_128()
    assert _apply_chain(payloads, raw[0], h).tobytes() == raw[-1].tobytes()
    assert h.hexdigest() == xxhash.xxh3_128(raw[-1]).hexdigest()
    part = _apply_chain(payloads, raw[0], seg_range=(1, 3))  # a worker's segments of the mixed chain
    assert part[4096 * 4 :].tobytes() == raw[-1][4096 * 4 :].tobytes()
    mixed_seg = [RC.encode(raw[0], raw[1], 4, 1, "t").payload, Sparse2Codec(8192, bitstream=3).encode(raw[1], raw[2], 4, 1, "t").payload]
    assert _apply_chain(mixed_seg, raw[0]).tobytes() == raw[2].tobytes()


@needs_coder
def test_the_density_of_a_bitstream_3_payload_comes_from_its_segment_table():
    payload, old, new = _valid()
    density = CODEC.density(payload, old.nbytes, 2, "t")
    changed = int(np.count_nonzero(old.view("<u2") != new.view("<u2")))
    assert density == (old.nbytes, old.size // 2, changed, None)


# --- without the compiled coder, and the knob ---------------------------------------------------


def _publish_two(tmp, rng) -> bytes:
    """A full version and one sparse-v2 delta; the delta's payload of tensor w."""
    from core_support import write_hf_checkpoint

    from weightsync import Publisher
    from weightsync.format.layout import version_dir
    from weightsync.format.safetensors_io import read_header

    t0 = {"w": (0.02 * rng.standard_normal(5000)).astype(np.float32)}
    write_hf_checkpoint(str(tmp / "seed"), t0)
    pub = Publisher(str(tmp / "src"), encoding="sparse-v2")
    pub.seed_snapshot(t0)
    t1 = {"w": t0["w"] + np.float32(1e-4) * (rng.random(5000) < 0.1)}
    assert pub.publish(1, t1).kind == "delta"
    pub.close()
    (shard,) = glob.glob(os.path.join(version_dir(str(tmp / "src"), 1), "delta-*.safetensors"))
    entry = read_header(shard).tensors["w"]
    with open(shard, "rb") as f:
        f.seek(entry.offset)
        return f.read(entry.nbytes)


@needs_coder
def test_the_publisher_writes_bitstream_3_by_default(fast_tmp_path, rng, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_SPARSE2_BITSTREAM", raising=False)
    assert writer_bitstream() == 3
    assert _publish_two(fast_tmp_path, rng)[4] == 3


def test_without_the_compiled_coder_the_publisher_writes_bitstream_2(fast_tmp_path, rng, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_SPARSE2_BITSTREAM", raising=False)
    monkeypatch.setattr(codec_sparse2, "_rc", None)
    assert writer_bitstream() == 2
    assert _publish_two(fast_tmp_path, rng)[4] == 2


def test_without_the_compiled_coder_a_bitstream_3_payload_is_a_typed_error_saying_how_to_fix_it(monkeypatch):
    payload = bytes.fromhex(GOLDEN_HEX)
    monkeypatch.setattr(codec_sparse2, "_rc", None)
    with pytest.raises(CoderUnavailableError, match="WEIGHTSYNC_SPARSE2_BITSTREAM=2") as caught:
        CODEC.check_structure(payload, "layers.0.w")
    assert "layers.0.w" in str(caught.value) and "pip install" in str(caught.value)
    with pytest.raises(CoderUnavailableError):
        CODEC.check(payload, 6, 2, "t")
    with pytest.raises(CoderUnavailableError):
        Sparse2Codec(bitstream=3)


@needs_coder
def test_a_pull_of_bitstream_3_without_the_compiled_coder_fails_typed_before_any_seed(fast_tmp_path, rng, monkeypatch):
    from weightsync import pull

    monkeypatch.delenv("WEIGHTSYNC_SPARSE2_BITSTREAM", raising=False)
    assert _publish_two(fast_tmp_path, rng)[4] == 3
    monkeypatch.setattr(codec_sparse2, "_rc", None)
    local = str(fast_tmp_path / "local")
    with pytest.raises(CoderUnavailableError, match="tensor w"):
        pull(local, str(fast_tmp_path / "seed"), str(fast_tmp_path / "src"), 1)
    seeded = os.path.exists(local) and any(f.endswith(".safetensors") for f in os.listdir(local))
    assert not seeded, "the seed ran before the unreadable payload was refused"


def test_the_bitstream_knob_2_makes_the_publisher_write_version_2(fast_tmp_path, rng, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "2")
    assert writer_bitstream() == 2
    assert _publish_two(fast_tmp_path, rng)[4] == 2


@pytest.mark.parametrize("value", ["7", "1", "three"])
def test_an_invalid_bitstream_knob_is_a_typed_error(value, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", value)
    with pytest.raises(InvalidKnobError, match="WEIGHTSYNC_SPARSE2_BITSTREAM"):
        writer_bitstream()
    with pytest.raises(InvalidKnobError):
        CODEC.encode(_u8(GOLDEN_OLD), _u8(GOLDEN_NEW), 2, 1, "t")


def test_a_fractional_bitstream_knob_is_a_typed_error(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "2.5")
    with pytest.raises(InvalidKnobError):
        writer_bitstream()


# --- publish and pull -------------------------------------------------------------------------
# A chain published and pulled in each bitstream across workers, and local damage under it:
# test_codec_sparse2.py (parametrized over bitstreams 2 and 3).


_FAILED_PULL_CHILD = """
import sys
import numpy as np
from core_support import publish_one_sparse2_delta
from weightsync import errors, pull
from weightsync.codecs import sparse_v2 as codec_sparse2

seed, source, local, shard, at = publish_one_sparse2_delta(sys.argv[1])
with open(shard, "r+b") as f:  # fewer changes declared than the part holds: fails at apply
    f.seek(at + codec_sparse2.HEADER.size)
    f.write(bytes([9]))
try:
    pull(local, seed, source, 2)
    sys.exit("the damaged chain pulled")
except errors.CorruptArtifactError as e:
    failure = e
print("refused", flush=True)
while failure is not None:  # what a test runner or an error reporter does: show the locals
    tb = failure.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, np.ndarray):
                repr(value)
        tb = tb.tb_next
    failure = failure.__cause__ or failure.__context__
print("shown", flush=True)
"""


@needs_coder
def test_a_failed_pull_leaves_no_array_over_an_unmapped_file_in_its_traceback(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests", "unit")])}
    child = subprocess.run([sys.executable, "-c", _FAILED_PULL_CHILD, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert "refused" in child.stdout, child.stderr[-2000:]
    assert child.returncode == 0 and "shown" in child.stdout, (child.returncode, child.stderr[-2000:])
