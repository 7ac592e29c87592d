"""Property tests of the codecs and the safetensors header: round trips for any bytes.

The fast profile runs a few dozen examples each; ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough``
runs many more.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zstandard
from hypothesis import assume, given
from hypothesis import strategies as st

from weightsync.format.checksum import digest, new_hasher
from weightsync.codecs import OverwriteCodec, XorCodec, apply_xor_chain, count_changed, get_codec
from weightsync.errors import PayloadBoundError
from weightsync.format.safetensors_io import DTYPE_NBYTES, build_header, parse_header, read_header

UPSTREAM = ["xor", "overwrite"]


@st.composite
def old_new(draw, max_size: int = 3000):
    """(old, new): equal-length byte arrays; new differs from old at a drawn density."""
    size = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 8]), st.integers(0, max_size)))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 1e-3, 0.01, 0.1, 0.5, 1.0]))
    rng = np.random.default_rng(seed)
    old = np.frombuffer(rng.bytes(size), np.uint8).copy()
    new = old.copy()
    if size:
        mask = rng.random(size) < density
        new[mask] ^= rng.integers(1, 256, size=int(mask.sum()), dtype=np.uint8)
    return old, new


def encode(encoding: str, old: np.ndarray, new: np.ndarray, itemsize: int = 1):
    return get_codec(encoding).encode(old, new, itemsize, 1, "t")


def apply(encoding: str, region: np.ndarray, payload, chunk: int = 1 << 20, codec=None) -> np.ndarray:
    codec = codec or get_codec(encoding)
    codec.check(payload, region.nbytes, 1, "t")
    codec.apply(region, payload, 1, "t", chunk)
    return region


@pytest.mark.parametrize("encoding", UPSTREAM)
@given(pair=old_new())
def test_apply_of_encode_reproduces_the_new_bytes(encoding, pair):
    old, new = pair
    enc = encode(encoding, old, new)
    if np.array_equal(old, new):
        assert enc is None  # nothing changed: nothing to ship
        return
    assert enc is not None
    assert enc.changed_bytes == int(np.count_nonzero(old != new))
    out = apply(encoding, old.copy(), enc.payload)
    assert out.tobytes() == new.tobytes()


@given(pair=old_new())
def test_xor_payload_is_an_involution(pair):
    old, new = pair
    enc = encode("xor", old, new)
    assume(enc is not None)
    region = old.copy()
    apply("xor", region, enc.payload)
    apply("xor", region, enc.payload)
    assert region.tobytes() == old.tobytes()


@given(pair=old_new())
def test_overwrite_payload_is_idempotent(pair):
    old, new = pair
    enc = encode("overwrite", old, new)
    assume(enc is not None)
    region = old.copy()
    apply("overwrite", region, enc.payload)
    apply("overwrite", region, enc.payload)
    assert region.tobytes() == new.tobytes()


@given(pair=old_new(), chunk=st.integers(1, 4000))
def test_chunked_xor_apply_equals_one_shot(pair, chunk):
    old, new = pair
    enc = encode("xor", old, new)
    assume(enc is not None)
    chunked = apply("xor", old.copy(), enc.payload, chunk=chunk)
    one_shot = old.copy()
    one_shot ^= np.frombuffer(zstandard.ZstdDecompressor().decompress(enc.payload), np.uint8)
    assert chunked.tobytes() == one_shot.tobytes() == new.tobytes()


@given(pair=old_new(), chunk=st.integers(1, 400))
def test_streamed_overwrite_apply_equals_one_shot(pair, chunk):
    old, new = pair
    enc = encode("overwrite", old, new)
    assume(enc is not None)
    streaming = OverwriteCodec()
    streaming.one_shot_nbytes = 0  # force the bounded-memory path (two readers, chunked)
    streamed = apply("overwrite", old.copy(), enc.payload, chunk=chunk, codec=streaming)
    one_shot = apply("overwrite", old.copy(), enc.payload, chunk=chunk)
    assert streamed.tobytes() == one_shot.tobytes() == new.tobytes()


@given(
    size=st.integers(0, 2000),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    chunk=st.integers(1, 2500),
    checksum=st.sampled_from(["xxh3-128", "blake3", "adler32"]),
)
def test_folded_xor_chain_equals_applying_versions_one_by_one(size, steps, seed, chunk, checksum):
    rng = np.random.default_rng(seed)
    versions = [np.frombuffer(rng.bytes(size), np.uint8).copy()]
    payloads = []
    for _ in range(steps):
        nxt = versions[-1].copy()
        if size:
            nxt[rng.integers(0, size, size=max(1, size // 10))] ^= 0xA5
        # An unchanged step still ships a frame here, so the fold sees every shape of chain.
        payloads.append(zstandard.ZstdCompressor(level=1).compress(np.bitwise_xor(versions[-1], nxt).tobytes()))
        versions.append(nxt)
    region = versions[0].copy()
    hasher = new_hasher(checksum)
    apply_xor_chain(region, payloads, "t", chunk, hasher)
    assert region.tobytes() == versions[-1].tobytes()
    assert hasher.hexdigest() == digest(checksum, versions[-1].tobytes())


@pytest.mark.parametrize("encoding", UPSTREAM)
@given(pair=old_new(max_size=500), data=st.data())
def test_check_refuses_a_payload_for_a_tensor_of_another_length(encoding, pair, data):
    old, new = pair
    enc = encode(encoding, old, new)
    assume(enc is not None)
    codec = get_codec(encoding)
    codec.check(enc.payload, old.nbytes, 1, "t")
    if encoding == "xor":
        wrong = data.draw(st.integers(0, 600).filter(lambda n: n != old.nbytes))
        with pytest.raises(PayloadBoundError, match="declares"):
            codec.check(enc.payload, wrong, 1, "t")
    else:
        # Fewer bytes than changed positions: the count alone proves the payload cannot fit.
        wrong = data.draw(st.integers(0, enc.changed_bytes - 1))
        with pytest.raises(PayloadBoundError, match="positions into a"):
            codec.check(enc.payload, wrong, 1, "t")


@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
    encoding=st.sampled_from(UPSTREAM),
)
def test_changed_elements_counts_elements_with_any_changed_byte(itemsize, n, seed, encoding):
    rng = np.random.default_rng(seed)
    old = np.frombuffer(rng.bytes(n * itemsize), np.uint8).copy()
    new = old.copy()
    if n:
        flips = rng.integers(0, n * itemsize, size=rng.integers(1, 2 * n + 1))
        new[flips] ^= 0x01
    changed_elems = int(np.count_nonzero((old != new).reshape(n, itemsize).any(axis=1))) if n else 0
    assert count_changed(old, new, itemsize)[1] == changed_elems
    enc = encode(encoding, old, new, itemsize)
    assert (enc is None) == (changed_elems == 0)
    if enc is not None:
        assert enc.changed_elements == changed_elems


# --- the safetensors header -----------------------------------------------------------------

names = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters='"\\'), min_size=1, max_size=12)


@st.composite
def header_entries(draw):
    entry_names = draw(st.lists(names.filter(lambda s: s != "__metadata__"), unique=True, max_size=6))
    out = []
    for name in entry_names:
        dtype = draw(st.sampled_from(sorted(DTYPE_NBYTES)))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        out.append((name, dtype, shape, int(np.prod(shape, dtype=np.int64)) * DTYPE_NBYTES[dtype]))
    meta = draw(st.none() | st.dictionaries(names, st.text(max_size=20), max_size=3))
    return out, meta


@given(spec=header_entries())
def test_built_header_parses_back_to_the_same_entries(spec):
    entries, meta = spec
    head, offsets = build_header(entries, meta)
    assert len(head) % 8 == 0
    data_nbytes = sum(e[3] for e in entries)
    hdr = parse_header("mem", head[8:], len(head) + data_nbytes)
    assert set(hdr.tensors) == {e[0] for e in entries}
    for (name, dtype, shape, nbytes), off in zip(entries, offsets):
        t = hdr.tensors[name]
        assert (t.dtype, t.shape, t.nbytes, t.offset) == (dtype, shape, nbytes, len(head) + off)
    assert hdr.metadata == (meta or {})


_NP_DTYPES = {"U8": np.uint8, "I16": np.int16, "F32": np.float32, "I64": np.int64, "F16": np.float16}


@given(
    shapes=st.dictionaries(
        st.text("abcdefgh._", min_size=1, max_size=8),
        st.tuples(st.sampled_from(sorted(_NP_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
        max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_files_we_write_are_read_by_the_safetensors_package_and_back(tmp_path_factory, shapes, seed):
    from safetensors import safe_open

    from weightsync.fsio import write_file
    from weightsync.format.safetensors_io import iter_file_chunks

    rng = np.random.default_rng(seed)
    arrays = {}
    for name, (dtype, shape) in shapes.items():
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP_DTYPES[dtype]).itemsize
        arrays[name] = np.frombuffer(rng.bytes(n), _NP_DTYPES[dtype]).reshape(shape)
    path = os.path.join(str(tmp_path_factory.mktemp("st")), "x.safetensors")
    write_file(path, iter_file_chunks([(n, d, tuple(s), arrays[n]) for n, (d, s) in shapes.items()], {"k": "v"}))
    with safe_open(path, framework="numpy") as f:
        assert set(f.keys()) == set(arrays)
        assert f.metadata() == {"k": "v"}
        for name in f.keys():
            assert f.get_tensor(name).tobytes() == arrays[name].tobytes()
    hdr = read_header(path)
    with open(path, "rb") as f:
        raw = f.read()
    for name, t in hdr.tensors.items():
        assert raw[t.offset : t.offset + t.nbytes] == arrays[name].tobytes()
    assert json.loads(raw[8 : hdr.data_offset])["__metadata__"] == {"k": "v"}
