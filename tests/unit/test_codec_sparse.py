"""sparse-v1: exact bytes of a golden vector, round trips over widths/densities/bit patterns,
chunked and chained apply, and one test per way a payload can be malformed.

The bad payloads are assembled here from the spec (docs/FORMAT.md, "sparse-v1") by a small
independent writer, so a test can break exactly one rule while every other byte is valid.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from weightsync.codecs import sparse_v1 as codec_sparse
from weightsync.codecs.sparse_v1 import SparseCodec, apply_sparse_chain
from weightsync.codecs import get_codec
from weightsync.errors import PayloadBoundError

LE = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def setup_module():
    # These tests drive the multi-segment paths on tensors of a few thousand elements, with
    # segments far below the spec's floor (seg >= min(n, 2^16)); the floor has its own tests
    # in test_core_sparse_bounds.py.
    global _floor
    _floor = codec_sparse.MIN_SEG_ELEMENTS
    codec_sparse.MIN_SEG_ELEMENTS = 1


def teardown_module():
    codec_sparse.MIN_SEG_ELEMENTS = _floor

# old/new bf16 bits: +1 ulp, unchanged, -1 raw (a negative float growing), a sign flip of the
# smallest subnormal (raw difference 0x8000), +2 ulps
GOLDEN_OLD = [0x3F80, 0x3F80, 0xBF80, 0x0001, 0x1234]
GOLDEN_NEW = [0x3F81, 0x3F80, 0xBF7F, 0x8001, 0x1236]
GOLDEN_HEX = (
    "57535350" "01" "02" "00" "00"  # magic, version 1, width 2, transform 0, flags 0
    "0500000000000000" "00004000" "01000000"  # 5 elements, segments of 2^22, 1 segment
    "04000000" "02000000" "01" "000000"  # 4 changes, 2 large, gap width 1, reserved
    "0d000000" "0a000000" "0a000000" "0b000000" "0b000000"  # frame sizes: gap, signs, flags, 2 value planes
    "28b52ffd2004" "210000" "00010000"  # gaps 0,1,0,0 -> positions 0,2,3,4 (raw block)
    "28b52ffd2001" "090000" "06"  # sign bits (LSB first): +,-,-,+
    "28b52ffd2001" "090000" "0c"  # large flags: changes 2 and 3
    "28b52ffd2002" "110000" "fe00"  # (|d| - 2) low bytes: 0x7ffe, 0
    "28b52ffd2002" "110000" "7f00"  # high bytes
)


def _u8(values, width=2) -> np.ndarray:
    return np.array(values, dtype=LE[width]).view(np.uint8).copy()


def _frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)


def build_payload(width: int, n: int, seg: int, segments, *, transform: int = 0, tail: bytes = b"") -> bytes:
    """An independent writer: ``segments`` lists (gaps, signs, large flags, large values - 2)
    per segment, or None for a segment without changes; counts are taken from the lists."""
    head = b"WSSP" + bytes([1, width, transform, 0]) + struct.pack("<QII", n, seg, len(segments))
    table, frames = b"", b""
    for s in segments:
        if s is None:
            table += struct.pack("<IIB3x", 0, 0, 0)
            continue
        gaps, signs, flags, big = s
        count = len(gaps)
        gw = next(w for w in (1, 2, 4) if max(gaps) < 1 << (8 * w))
        g = np.array(gaps, dtype="<u4").view(np.uint8).reshape(count, 4)
        streams = [g[:, j].tobytes() for j in range(gw)]
        streams.append(np.packbits(np.array(signs, bool), bitorder="little").tobytes())
        streams.append(np.packbits(np.array(flags, bool), bitorder="little").tobytes())
        if big:
            b = np.array(big, dtype=LE[width]).view(np.uint8).reshape(len(big), width)
            streams += [b[:, j].tobytes() for j in range(width)]
        fr = [_frame(x) for x in streams]
        table += struct.pack("<IIB3x", count, len(big), gw) + struct.pack(f"<{len(fr)}I", *map(len, fr))
        frames += b"".join(fr)
    return head + table + frames + tail


CODEC = get_codec("sparse-v1")


def test_golden_vector_encodes_to_exact_bytes():
    old, new = _u8(GOLDEN_OLD), _u8(GOLDEN_NEW)
    enc = CODEC.encode(old, new, 2, 1, "t")
    assert enc.payload.hex() == GOLDEN_HEX
    assert (enc.changed_elements, enc.changed_bytes) == (4, 4)


def test_golden_vector_decodes_and_the_independent_writer_agrees():
    old, new = _u8(GOLDEN_OLD), _u8(GOLDEN_NEW)
    payload = bytes.fromhex(GOLDEN_HEX)
    CODEC.check(payload, old.nbytes, 2, "t")
    region = old.copy()
    CODEC.apply(region, payload, 2, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()
    mine = build_payload(2, 5, 1 << 22, [([0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [0x7FFE, 0])])
    assert mine == payload


def test_publisher_default_encoding_is_sparse_v1():
    from weightsync.publisher.publish import DEFAULT_ENCODING

    assert DEFAULT_ENCODING == "sparse-v1"


# --- round trips --------------------------------------------------------------------------


@st.composite
def pairs(draw):
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 600))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0]))
    kind = draw(st.sampled_from(["random", "ulp", "signflip", "nan"]))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy()
    o = old.view(LE[width])
    nw = new.view(LE[width])
    mask = rng.random(n) < density
    top = np.array(1 << (8 * width - 1), dtype=LE[width])[()]
    if kind == "random":
        nw[mask] = rng.integers(0, 256, (n, width), dtype=np.uint8).view(LE[width]).reshape(-1)[mask]
    elif kind == "ulp":
        step = rng.integers(-3, 4, n).astype(np.int64)
        nw[mask] = (o[mask].astype(np.int64) + step[mask]).astype(LE[width], casting="unsafe")
    elif kind == "signflip":
        nw[mask] = o[mask] ^ top
    else:  # all-ones exponent patterns (NaN / inf of every float width) against anything
        nw[mask] = ~np.zeros(1, LE[width])[0] ^ (o[mask] & 1)
    seg = draw(st.sampled_from([1, 3, 64, 1 << 22]))
    transform = draw(st.sampled_from([0, 1]))
    return width, old, new, seg, transform


@given(pairs())
def test_round_trip_is_exact_for_any_width_density_and_bits(case):
    width, old, new, seg, transform = case
    codec = SparseCodec()
    codec.seg_elements, codec.transform = seg, transform
    enc = codec.encode(old, new, width, 1, "t")
    changed_elements = int(np.count_nonzero(old.view(LE[width]) != new.view(LE[width])))
    if changed_elements == 0:
        assert enc is None
        return
    assert enc.changed_elements == changed_elements
    assert enc.changed_bytes == int(np.count_nonzero(old != new))
    codec.check(enc.payload, old.nbytes, width, "t")
    region = old.copy()
    codec.apply(region, enc.payload, width, "t", 1 << 20)
    assert region.tobytes() == new.tobytes()


def test_all_elements_changed_streams_in_batches_like_one_shot(rng):
    n = 20_000  # more changes than the smallest batch (4096): the streamed path runs
    old = rng.integers(0, 256, 2 * n, dtype=np.uint8)
    new = (old.view("<u2") + rng.integers(1, 5, n).astype("<u2")).view(np.uint8)
    codec = SparseCodec()
    codec.seg_elements = 7_000
    payload = codec.encode(old, new, 2, 1, "t").payload
    small, big = old.copy(), old.copy()
    codec.apply(small, payload, 2, "t", 1)  # chunk of 1 byte: batches of 4096 changes
    codec.apply(big, payload, 2, "t", 1 << 30)  # whole segments at once
    assert small.tobytes() == big.tobytes() == new.tobytes()


def test_a_chain_applies_in_order_and_hashes_the_final_bytes(rng):
    n = 10_000
    versions = [rng.integers(0, 256, 2 * n, dtype=np.uint8)]
    for _ in range(4):
        v = versions[-1].copy()
        idx = rng.choice(n, 500, replace=False)
        v.view("<u2")[idx] += np.uint16(1)
        versions.append(v)
    codec = SparseCodec()
    codec.seg_elements = 3_000
    payloads = [codec.encode(a, b, 2, 1, "t").payload for a, b in zip(versions, versions[1:])]
    region = versions[0].copy()
    h = xxhash.xxh3_128()
    apply_sparse_chain(region, payloads, "t", 4096, h)
    assert region.tobytes() == versions[-1].tobytes()
    assert h.hexdigest() == xxhash.xxh3_128(versions[-1]).hexdigest()


def test_unequal_segmenting_in_one_chain_still_applies_in_order(rng):
    a = rng.integers(0, 256, 4000, dtype=np.uint8)
    b = a.copy()
    b[::7] ^= 1
    c = b.copy()
    c[::5] ^= 2
    one, two = SparseCodec(), SparseCodec()
    one.seg_elements, two.seg_elements = 100, 333
    region = a.copy()
    h = xxhash.xxh3_128()
    apply_sparse_chain(region, [one.encode(a, b, 2, 1, "t").payload, two.encode(b, c, 2, 1, "t").payload], "t", 4096, h)
    assert region.tobytes() == c.tobytes() and h.hexdigest() == xxhash.xxh3_128(c).hexdigest()


# --- rejections ---------------------------------------------------------------------------


def _valid(n=8):
    return build_payload(2, n, 1 << 22, [([0, 2], [0, 1], [0, 1], [5])])


def _check(payload, nbytes=16):
    CODEC.check(payload, nbytes, 2, "t")


def _apply(payload, nbytes=16):
    region = np.zeros(nbytes, np.uint8)
    before = region.copy()
    with pytest.raises(PayloadBoundError) as e:
        CODEC.apply(region, payload, 2, "t", 1 << 20)
    return e.value, before, region


def test_the_valid_hand_built_payload_passes():
    _check(_valid())
    region = np.zeros(16, np.uint8)
    CODEC.apply(region, _valid(), 2, "t", 1 << 20)
    assert region.view("<u2").tolist() == [1, 0, 0, (-7) & 0xFFFF, 0, 0, 0, 0]


def test_truncated_stream_is_rejected_before_any_write():
    with pytest.raises(PayloadBoundError, match="past the|truncated"):
        _check(_valid()[:-1])


def test_trailing_bytes_are_rejected():
    with pytest.raises(PayloadBoundError, match="trailing"):
        _check(_valid() + b"\0")


def test_truncated_header_and_table_are_rejected():
    p = _valid()
    for cut in (3, 20, 30):
        with pytest.raises(PayloadBoundError):
            _check(p[:cut])


def test_out_of_range_position_is_rejected_and_nothing_is_written():
    payload = build_payload(2, 8, 1 << 22, [([3, 4], [0, 0], [0, 0], [])])  # positions 3 and 8 of 8
    _check(payload)  # sizes are all consistent: only the apply sees the positions
    err, before, region = _apply(payload)
    assert "past segment" in str(err)
    assert region.tobytes() == before.tobytes()


def test_position_past_its_segment_is_rejected_even_inside_the_tensor():
    payload = build_payload(2, 8, 4, [([4], [0], [0], []), None])  # segment 0 is [0, 4)
    _check(payload)
    err, _, _ = _apply(payload)
    assert "past segment" in str(err)


def test_count_mismatch_between_table_and_stream_is_rejected():
    good = _valid()
    bad = bytearray(good)
    struct.pack_into("<I", bad, 24, 3)  # table says 3 changes, the frames hold 2
    with pytest.raises(PayloadBoundError, match="declares 2 bytes, expected 3"):
        _check(bytes(bad))


def test_more_changes_than_elements_is_rejected():
    bad = bytearray(_valid())
    struct.pack_into("<I", bad, 24, 9)
    with pytest.raises(PayloadBoundError, match="claims 9 changes"):
        _check(bytes(bad))


def test_large_value_count_mismatch_is_rejected():
    payload = build_payload(2, 8, 1 << 22, [([0, 2], [0, 0], [1, 1], [5])])  # two flags, one value
    _check(payload)
    err, _, _ = _apply(payload)
    assert "large values" in str(err)
    fewer = build_payload(2, 8, 1 << 22, [([0, 2], [0, 0], [0, 0], [5])])  # one value, no flag
    _check(fewer)
    err, _, _ = _apply(fewer)
    assert "large values" in str(err)


def test_wrong_element_count_for_the_tensor_is_rejected():
    with pytest.raises(PayloadBoundError, match="tensor has 18"):
        _check(_valid(), nbytes=18)


def test_wrong_segment_count_is_rejected():
    bad = bytearray(_valid())
    struct.pack_into("<I", bad, 20, 2)
    with pytest.raises(PayloadBoundError, match="segments"):
        _check(bytes(bad))


@pytest.mark.parametrize(
    "offset, value, match",
    [(0, b"XSSP", "starts with"), (4, b"\x02", "version"), (5, b"\x03", "width"), (6, b"\x07", "transform"),
     (33, b"\x01", "reserved")],
)
def test_bad_header_fields_are_rejected(offset, value, match):
    bad = bytearray(_valid())
    bad[offset : offset + len(value)] = value
    with pytest.raises(PayloadBoundError, match=match):
        _check(bytes(bad))


def test_bad_gap_width_is_rejected():
    bad = bytearray(_valid())
    bad[32] = 3
    with pytest.raises(PayloadBoundError, match="gap width"):
        _check(bytes(bad))


def test_set_padding_bits_are_rejected():
    payload = build_payload(2, 8, 1 << 22, [([0, 2], [0, 0, 1], [0, 0], [])])  # a sign bit for a third change
    _check(payload)
    err, _, _ = _apply(payload)
    assert "past the last change" in str(err)


def test_corrupt_stream_bytes_raise_a_typed_error():
    good = _valid()
    bad = bytearray(good)
    bad[-1] ^= 0xFF  # the last value plane's raw byte: decodes, then the sum no longer holds
    region = np.zeros(16, np.uint8)
    CODEC.apply(region, bytes(bad), 2, "t", 1 << 20)  # a wrong value is the digest's job
    frame_start = len(good) - 10
    bad = bytearray(good)
    bad[frame_start : frame_start + 4] = b"\0\0\0\0"  # break a frame's magic
    with pytest.raises(PayloadBoundError):
        _check(bytes(bad))


def test_segment_table_larger_than_the_payload_is_rejected_without_looping():
    head = b"WSSP" + bytes([1, 1, 0, 0]) + struct.pack("<QII", 1 << 30, 1, 1 << 30)
    with pytest.raises(PayloadBoundError, match="runs past"):
        CODEC.check(head, 1 << 30, 1, "t")


def test_encoder_picks_the_smallest_gap_width():
    n = 70_000
    old = np.zeros(2 * n, np.uint8)
    new = old.copy()
    new[2 * (n - 1)] = 1  # one change 69_999 elements in: the gap needs 3 bytes -> width 4
    parsed = codec_sparse.parse(CODEC.encode(old, new, 2, 1, "t").payload, 2 * n, "t")
    assert parsed.gap_widths[0] == 4


# --- large tensors split across workers -----------------------------------------------------


@pytest.fixture
def split_everything(monkeypatch):
    """Small segments and no size floor, so a test-sized tensor is cut into parts."""
    from weightsync.puller import apply as apply_mod
    from weightsync.publisher import encode as encode_mod

    monkeypatch.setattr(codec_sparse.CODEC, "seg_elements", 1000)
    monkeypatch.setattr(apply_mod, "SPLIT_MIN_NBYTES", 0)
    monkeypatch.setattr(encode_mod, "SPLIT_MIN_NBYTES", 0)


def _published_chain(tmp, rng, versions: int):
    from core_support import mutate, random_tensors, write_hf_checkpoint

    from weightsync import Publisher

    v = random_tensors(rng, {"big": ("uint16", (40, 500)), "other": ("uint16", (7, 300)), "tiny": ("float32", (5,))})
    write_hf_checkpoint(str(tmp / "seed"), v)
    pub = Publisher(str(tmp / "src"), encoding="sparse-v1", workers=2)
    pub.seed_snapshot(v)
    history = [v]
    for i in range(1, versions + 1):
        v = mutate(v, rng, 0.02)
        assert pub.publish(i, v).kind == "delta"
        history.append(v)
    pub.close()
    return history


def test_a_large_tensor_split_across_workers_pulls_exactly(split_everything, fast_tmp_path, rng):
    from core_support import assert_checkpoint_is, tensor_bytes

    from weightsync.puller import apply as apply_mod
    from weightsync import pull

    history = _published_chain(fast_tmp_path, rng, 3)
    jobs_seen = []
    real_plan = apply_mod._split_plan
    apply_mod_plan = lambda jobs, workers: jobs_seen.append(real_plan(jobs, workers)) or jobs_seen[-1]  # noqa: E731
    try:
        apply_mod._split_plan = apply_mod_plan
        res = pull(str(fast_tmp_path / "local"), str(fast_tmp_path / "seed"), str(fast_tmp_path / "src"), 3, workers=3)
    finally:
        apply_mod._split_plan = real_plan
    assert res.applied_version == 3 and res.deltas_applied == 3
    assert_checkpoint_is(str(fast_tmp_path / "local"), tensor_bytes(history[3]))
    assert any(len(plan.get("big", [])) > 1 for plan in jobs_seen), jobs_seen  # it really was split


def test_a_split_tensor_that_does_not_verify_fails_loud(split_everything, fast_tmp_path, rng):
    from core_support import flip_local_byte

    from weightsync import errors, pull

    _published_chain(fast_tmp_path, rng, 2)
    local, seed, src = (str(fast_tmp_path / n) for n in ("local", "seed", "src"))
    pull(local, seed, src, 1, workers=3)
    flip_local_byte(local, "big", 20_001)  # local damage in a part: the digest after the parts catches it
    res = pull(local, seed, src, 2, workers=3)  # reseeds once and replays, strict
    assert res.applied_version == 2 and res.reseeded
    with pytest.raises(errors.CorruptArtifactError):
        for p in (fast_tmp_path / "src").glob("weight_v000002/*.safetensors"):
            data = bytearray(p.read_bytes())
            data[-5] ^= 0xFF  # damage a payload byte inside the last tensor's streams
            p.write_bytes(bytes(data))
        pull(str(fast_tmp_path / "local2"), seed, src, 2, workers=3)


def test_a_large_tensor_encoded_in_parts_gives_the_one_piece_payload(split_everything, fast_tmp_path, rng):
    from core_support import mutate, random_tensors

    from weightsync import Publisher

    v0 = random_tensors(rng, {"big": ("uint16", (40, 500)), "small": ("uint16", (3, 7)), "same": ("uint8", (9,))})
    v1 = mutate(v0, rng, 0.03, names=["big", "small"])
    pub = Publisher(str(fast_tmp_path / "src"), encoding="sparse-v1", workers=3)
    pub.seed_snapshot(v0)
    ranges = []
    real = codec_sparse.CODEC.encode_part

    def spy(old, new, itemsize, level, tensor, seg_range):
        ranges.append((tensor, seg_range))
        return real(old, new, itemsize, level, tensor, seg_range)

    codec_sparse.CODEC.encode_part = spy
    try:
        prepared = {t.name: t for t in pub.prepare(1, v1).tensors}
    finally:
        del codec_sparse.CODEC.encode_part
        pub.close()
    assert len([r for t, r in ranges if t == "big" and r is not None]) == 3  # 20 segments in 3 parts
    for name in ("big", "small"):
        old, new = v0[name].reshape(-1).view(np.uint8), v1[name].reshape(-1).view(np.uint8)
        one = CODEC.encode(old, new, 2, 1, name)
        assert prepared[name].payload == one.payload
        assert (prepared[name].changed_bytes, prepared[name].changed_elements) == (one.changed_bytes, one.changed_elements)
        assert prepared[name].digest == xxhash.xxh3_128(new).hexdigest()
    assert prepared["same"].payload is None


def test_broken_sparse_payload_is_refused_at_load_before_any_seed(tmp_path):
    """A structurally broken sparse-v1 payload fails while loading the chain: a seed+chain plan
    leaves the local checkpoint as it was (FORMAT.md Pulling step 4 comes before step 5)."""
    import os

    from weightsync import Publisher, errors, pull
    from weightsync.format.layout import version_dir
    from weightsync.format.safetensors_io import read_header

    from core_support import write_hf_checkpoint

    rng = np.random.default_rng(7)
    seed, source, local = (str(tmp_path / n) for n in ("seed", "src", "local"))
    t0 = {"w": rng.standard_normal(4096).astype(np.float32)}
    write_hf_checkpoint(seed, t0)
    pub = Publisher(source, encoding="sparse-v1")
    pub.seed_snapshot(t0)
    t1 = {"w": t0["w"] + np.float32(1e-3) * (rng.random(4096) < 0.1)}
    pub.publish(1, t1, full=True)
    t2 = {"w": t1["w"] + np.float32(1e-3) * (rng.random(4096) < 0.1)}
    pub.publish(2, t2, full=False)
    from core_support import shard_path

    shard = shard_path(version_dir(source, 2), "w")
    entry = read_header(shard).tensors["w"]
    with open(shard, "r+b") as f:  # break the segment table: a count past the tensor
        f.seek(entry.offset + 24)
        f.write((2**31).to_bytes(4, "little"))
    with pytest.raises(errors.PayloadBoundError, match=r"v2: tensor w"):
        pull(local, seed, source, 2)
    seeded = os.path.exists(local) and any(f.endswith(".safetensors") for f in os.listdir(local))
    assert not seeded, "the seed ran before the broken payload was refused"
