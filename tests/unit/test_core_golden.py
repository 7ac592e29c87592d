"""Golden byte vectors: the exact bytes of each upstream encoding, digest and delta shard header.

If one of these changes, the wire format changed: upstream readers (slime, miles, sglang-miles)
would no longer read our versions, or we theirs. Update a vector only together with FORMAT.md.
"""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
import zstandard

from weightsync import Publisher, pull
from weightsync.format.checksum import digest
from weightsync.codecs import get_codec

from core_support import assert_checkpoint_is, marker_version, shard_path, write_hf_checkpoint

OLD = bytes(range(8))
NEW = bytes([0x00, 0x01, 0xFF, 0x03, 0x04, 0x05, 0x06, 0x80])

# Decompressed payloads, as FORMAT.md defines them.
XOR_DELTA = bytes([0x00, 0x00, 0xFD, 0x00, 0x00, 0x00, 0x00, 0x87])  # OLD ^ NEW
OVERWRITE_DELTA = (
    b"\x02\x00\x00\x00"  # u32 count = 2
    b"\x02\x00\x00\x00" b"\x07\x00\x00\x00"  # positions 2, 7 (u32 LE, ascending)
    b"\xff\x80"  # the new bytes at those positions
)

# Digests of NEW (the tensor's complete new bytes) in each checksum format.
DIGESTS_OF_NEW = {
    "xxh3-128": "1ecb7e11b621ec40bd143f1af28fbc67",
    "blake3": "f4e15c02b2f7219d90c71f29351aa2bb575c488e8946082a6edb760b8df526de",
    "adler32": "06c30193",
}
# Published reference vectors of each algorithm, so the table above is not merely self-consistent.
REFERENCE_DIGESTS = [
    ("xxh3-128", b"", "99aa06d3014798d86001c324468d497f"),
    ("blake3", b"", "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"),
    ("adler32", b"", "00000001"),
    ("adler32", b"Wikipedia", "11e60398"),
]

# One xor delta shard for tensor "w" (8 bytes OLD -> NEW), xxh3-128: u64 LE header length,
# JSON header (metadata first, compact separators), padded with spaces to a multiple of 8.
GOLDEN_XOR_SHARD_HEADER = (
    b"p\x00\x00\x00\x00\x00\x00\x00"
    b'{"__metadata__":{"w":"1ecb7e11b621ec40bd143f1af28fbc67"},'
    b'"w":{"dtype":"U8","shape":[17],"data_offsets":[0,17]}} '
)
# The same payload built by hand: magic, frame header (single segment, 1-byte content size 8),
# one last raw block of 8 bytes. Any zstd decoder reads it; ours must too.
HAND_XOR_FRAME = b"\x28\xb5\x2f\xfd" + b"\x20\x08" + b"\x41\x00\x00" + XOR_DELTA
HAND_OVERWRITE_FRAME = b"\x28\xb5\x2f\xfd" + b"\x20\x0e" + b"\x71\x00\x00" + OVERWRITE_DELTA


def u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).copy()


def decompress(frame: bytes) -> bytes:
    params = zstandard.get_frame_parameters(frame)
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=params.content_size)


@pytest.mark.parametrize("encoding, golden", [("xor", XOR_DELTA), ("overwrite", OVERWRITE_DELTA)])
def test_encoder_emits_the_golden_decompressed_delta(encoding, golden):
    encoded = get_codec(encoding).encode(u8(OLD), u8(NEW), 1, 1, "w")
    assert zstandard.get_frame_parameters(encoded.payload).content_size == len(golden)
    assert decompress(encoded.payload) == golden
    assert encoded.changed_bytes == 2


@pytest.mark.parametrize("encoding, frame", [("xor", HAND_XOR_FRAME), ("overwrite", HAND_OVERWRITE_FRAME)])
def test_hand_built_frame_applies_to_the_golden_new_bytes(encoding, frame):
    codec = get_codec(encoding)
    codec.check(frame, len(OLD), 1, "w")
    region = u8(OLD)
    codec.apply(region, frame, 1, "w", 1 << 20)
    assert region.tobytes() == NEW


def test_hand_built_frames_are_what_a_reference_decoder_reads():
    assert decompress(HAND_XOR_FRAME) == XOR_DELTA
    assert decompress(HAND_OVERWRITE_FRAME) == OVERWRITE_DELTA


@pytest.mark.parametrize("checksum", sorted(DIGESTS_OF_NEW))
def test_digest_of_the_new_bytes_matches_the_golden_hex(checksum):
    assert digest(checksum, NEW) == DIGESTS_OF_NEW[checksum]


@pytest.mark.parametrize("checksum, data, hexdigest", REFERENCE_DIGESTS)
def test_digest_matches_published_reference_vectors(checksum, data, hexdigest):
    assert digest(checksum, data) == hexdigest


def test_chunked_digest_equals_one_shot():
    from weightsync.format.checksum import new_hasher

    data = bytes(range(256)) * 97
    for checksum in DIGESTS_OF_NEW:
        h = new_hasher(checksum)
        for i in range(0, len(data), 1000):
            h.update(data[i : i + 1000])
        assert h.hexdigest() == digest(checksum, data), checksum


def _publish_golden(tmp_path, encoding: str, checksum: str = "xxh3-128") -> str:
    source = str(tmp_path / f"src-{encoding}-{checksum}")
    # The upstream spelling of a plain delta: no side anchor (a version that has one also names
    # its anchor's commit id in its metadata; test_core_anchor_binding pins that).
    pub = Publisher(source, encoding=encoding, checksum=checksum, workers=1, anchor_fraction=0, anchor_max_deltas=0)
    pub.seed_snapshot({"w": u8(OLD), "still": np.zeros(3, np.float32)})
    pub.publish(1, {"w": u8(NEW)}, full=False)
    pub.close()
    return os.path.join(source, "weight_v000001")


def test_xor_delta_shard_header_is_golden(tmp_path):
    vdir = _publish_golden(tmp_path, "xor")
    with open(shard_path(vdir, "w"), "rb") as f:
        raw = f.read()
    assert raw[: len(GOLDEN_XOR_SHARD_HEADER)] == GOLDEN_XOR_SHARD_HEADER
    assert decompress(raw[len(GOLDEN_XOR_SHARD_HEADER) :]) == XOR_DELTA


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("checksum", sorted(DIGESTS_OF_NEW))
def test_delta_index_and_shard_metadata_spell_the_upstream_fields(tmp_path, encoding, checksum):
    vdir = _publish_golden(tmp_path, encoding, checksum)
    with open(os.path.join(vdir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    # Ours beside the upstream fields (FORMAT.md: upstream readers ignore the key): each payload
    # file's size and xxh3-128, for readers behind a cache.
    files = index.pop("file_digests")
    assert set(files) == set(index["weight_map"].values())
    assert index == {
        "metadata": {
            "version": "000001",
            "base_version": "000000",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": checksum,
        },
        "weight_map": {"w": index["weight_map"]["w"]},  # shard names are free (ours end in a content hash)
    }
    assert re.fullmatch(r"delta-r00000-00001-[0-9a-f]{16}\.safetensors", index["weight_map"]["w"])
    with open(shard_path(vdir, "w"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        payload = f.read()
    assert n % 8 == 0
    assert header["__metadata__"] == {"w": DIGESTS_OF_NEW[checksum]}
    assert header["w"] == {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}
    assert decompress(payload) == (XOR_DELTA if encoding == "xor" else OVERWRITE_DELTA)


@pytest.mark.parametrize("encoding, frame", [("xor", HAND_XOR_FRAME), ("overwrite", HAND_OVERWRITE_FRAME)])
@pytest.mark.parametrize("checksum", sorted(DIGESTS_OF_NEW))
def test_pull_applies_a_hand_written_golden_version(tmp_path, encoding, frame, checksum):
    from safetensors.numpy import save_file

    seed, source, local = (str(tmp_path / n) for n in ("seed", "src", "local"))
    write_hf_checkpoint(seed, {"w": u8(OLD), "other": np.arange(4, dtype=np.int32)})
    vdir = os.path.join(source, "weight_v000001")
    os.makedirs(vdir)
    save_file({"w": u8(frame)}, os.path.join(vdir, "d.safetensors"), metadata={"w": DIGESTS_OF_NEW[checksum]})
    meta = {"version": "1", "base_version": "0", "delta_encoding": encoding, "checksum_format": checksum}
    with open(os.path.join(vdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": meta, "weight_map": {"w": "d.safetensors"}}, f)
    result = pull(local, seed, source, 1)
    assert result.applied_version == 1 and not result.reseeded
    assert_checkpoint_is(local, {"w": NEW, "other": np.arange(4, dtype=np.int32).tobytes()})
    assert marker_version(local) == 1
