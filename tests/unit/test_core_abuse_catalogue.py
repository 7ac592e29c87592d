"""The abuse catalogue of docs/FORMAT.md, one test per row: each case built for real on disk.

Every test asserts the error type and the key words of its message, and what the failure left
behind locally: a load-time refusal leaves the local checkpoint and its marker untouched; an
apply-time failure leaves no marker (so the next pull reseeds) or a marker naming exactly the
bytes of its version.

Each row that takes the ``world`` fixture runs twice: on the source dir (``[dir]``), and on a
bucket (``[bucket]``: a real S3 server on loopback) holding the same files under the same keys,
with the same assertions. The bucket world publishes and damages its source dir exactly as the
directory world does; ``World.pull`` uploads the dir's state to the bucket (new and changed
files put, removed ones deleted) just before each pull, so every row's damage reaches the bucket
through that one place (a bucket copied from disk pulls the same: docs/BUCKETS.md). A row that
cannot apply to a bucket is listed in ``NOT_ON_A_BUCKET`` with its reason; a bucket variant that
fails for a product reason is listed in ``BUCKET_XFAIL`` (strict) until it is fixed; and
``test_every_row_runs_on_a_bucket_or_says_why_not`` keeps a new row from skipping the bucket
silently.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import zstandard

from weightsync import Publisher, errors, pull
from weightsync.format.checksum import digest
from weightsync.codecs import OverwriteCodec

from core_support import (
    assert_checkpoint_is,
    marker_version,
    mutate,
    random_tensors,
    read_checkpoint_bytes,
    shard_path,
    tensor_bytes,
    write_hf_checkpoint,
)
from bucket_support import s3_env, s3_server_fixture, upload_dir_state  # noqa: F401 (fixtures)

INDEX = "model.safetensors.index.json"
SIZES = {"a": ("float32", (64,)), "b": ("int16", (8, 4)), "c": ("uint8", (1,))}

# Rows that do not run on a bucket, and why (each reason one line). A key is a row's name (no
# bucket variant is made), or its name and some of its parameters, "name[param=value]" (that
# case's bucket variant is skipped, with the reason).
NOT_ON_A_BUCKET = {
    "test_indexless_dir_that_is_not_one_complete_model_safetensors_is_not_ready[shape=empty_dir]":
        "a bucket has no empty dirs: an empty prefix is no version at all (VersionMissingError)",
    "test_shard_symlink_resolving_outside_the_version_dir_is_refused":
        "a bucket holds no symlinks",
    "test_shard_gone_or_replaced_between_load_and_apply_is_not_ready_and_leaves_no_marker":
        "the fault is the filesystem between load and apply; a bucket pull applies from its host-local mirror",
    "test_publishing_over_an_existing_version_is_refused":
        "the directory publisher's refusal; a bucket's is BucketConflictError (test_bucket_source.py)",
    "test_overwrite_refuses_a_tensor_over_4_gib": "an encoder's refusal: no source, no pull",
    "test_every_error_has_a_stable_type_status_and_stdlib_parent": "the error table: no source, no pull",
    "test_path_not_allowed_names_the_path_and_the_roots": "an error's message: no source, no pull",
    "test_local_tensor_mismatch_and_local_state_errors_say_what_to_do": "an error's message: no source, no pull",
}

# Bucket variants that fail for a product reason (storage/mirror.py, puller/bucket.py): strict, so
# a fix shows up as an XPASS to move the row off this list. Keys as in NOT_ON_A_BUCKET. Empty:
# every bucket variant passes.
BUCKET_XFAIL: dict[str, str] = {}


class World:
    """A seed dir, a source dir with v1 (xor delta) and v2 (overwrite delta), and a local
    checkpoint pulled to v2. ``expected[v]`` holds the exact bytes of every version."""

    def __init__(self, root: str, rng: np.random.Generator, bucket_url: "str | None" = None):
        self.root = root
        # The bucket variant: pulls read this URL, which holds the source dir's files (see pull).
        self.bucket_url = bucket_url
        self._uploaded: dict[str, str] = {}
        self.seed, self.source, self.local = (os.path.join(root, n) for n in ("seed", "src", "local"))
        self.rng = rng
        t0 = random_tensors(rng, SIZES)
        write_hf_checkpoint(self.seed, t0)
        self.tensors = {0: t0}
        self.expected = {0: tensor_bytes(t0)}
        self.publish(1, "xor", names=["a", "b"])
        self.publish(2, "overwrite", names=["a", "c"])
        self.pull(2)

    def publish(self, version: int, encoding: str, names=None, full: bool = False, checksum: str = "xxh3-128"):
        prev = self.tensors[version - 1]
        new = mutate(prev, self.rng, 0.1, names=names)
        # No side anchors: these cases pin plans and local files of a plain chain from the seed dir.
        pub = Publisher(self.source, encoding=encoding, checksum=checksum, workers=1, anchor_fraction=0, anchor_max_deltas=0)
        pub.seed_snapshot(prev, version=version - 1)
        pub.publish(version, new, full=full)
        pub.close()
        self.tensors[version] = new
        self.expected[version] = tensor_bytes(new)

    def vdir(self, version: int) -> str:
        return os.path.join(self.source, f"weight_v{version:06d}")

    def pull_source(self) -> str:
        """What a pull reads: the source dir, or (bucket variant) the bucket URL, once the bucket
        holds exactly what the source dir holds now (the row's damage included)."""
        if self.bucket_url is None:
            return self.source
        from weightsync.storage.source import BucketSource

        upload_dir_state(BucketSource(self.bucket_url), self.source, self._uploaded)
        return self.bucket_url

    def pull(self, target: int, **kw):
        return pull(self.local, self.seed, self.pull_source(), target, **kw)

    def assert_at(self, version: int) -> None:
        assert marker_version(self.local) == version
        assert_checkpoint_is(self.local, self.expected[version])

    def assert_marker_truthful(self) -> None:
        v = marker_version(self.local)
        if v is not None:
            assert_checkpoint_is(self.local, self.expected[v])

    # --- hand-written versions ------------------------------------------------------------

    def payload(self, name: str, encoding: str, base: int = 2) -> tuple[bytes, bytes]:
        """(a valid payload changing ``name`` from version ``base``, the new bytes)."""
        old = np.frombuffer(self.expected[base][name], np.uint8)
        new = old.copy()
        new[: max(1, new.size // 3)] ^= 0x3C
        enc = {"xor": _xor_payload, "overwrite": _overwrite_payload}[encoding](old, new)
        return enc, new.tobytes()

    def write_version(self, version: int, shards: dict[str, bytes], weight_map: dict, meta: dict | None = None) -> str:
        vdir = self.vdir(version)
        os.makedirs(vdir, exist_ok=True)
        for fname, raw in shards.items():
            with open(os.path.join(vdir, fname), "wb") as f:
                f.write(raw)
        index = {
            "metadata": meta
            if meta is not None
            else {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": "xor",
                  "compression_format": "zstd", "checksum_format": "xxh3-128"},
            "weight_map": weight_map,
        }
        with open(os.path.join(vdir, INDEX), "w") as f:
            json.dump(index, f)
        return vdir

    def write_delta(self, version: int, payloads: dict[str, bytes], digests: dict[str, str], encoding: str = "xor",
                    checksum: str = "xxh3-128", **shard_kw) -> str:
        raw = delta_shard(payloads, digests, **shard_kw)
        meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": encoding,
                "compression_format": "zstd", "checksum_format": checksum}
        return self.write_version(version, {"d.safetensors": raw}, {n: "d.safetensors" for n in payloads}, meta)


def _xor_payload(old: np.ndarray, new: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=1).compress(np.bitwise_xor(old, new).tobytes())


def _overwrite_payload(old: np.ndarray, new: np.ndarray) -> bytes:
    pos = np.flatnonzero(old != new).astype("<u4")
    body = struct.pack("<I", pos.size) + pos.tobytes() + new[pos].tobytes()
    return zstandard.ZstdCompressor(level=1).compress(body)


def overwrite_body_payload(count: int, positions, values: bytes) -> bytes:
    body = struct.pack("<I", count) + np.asarray(positions, "<u4").tobytes() + values
    return zstandard.ZstdCompressor(level=1).compress(body)


def delta_shard(
    payloads: dict[str, bytes],
    digests: dict[str, str],
    *,
    dtype: str = "U8",
    shape_of=lambda n: [n],
    edit_header=None,
    length_prefix: int | None = None,
) -> bytes:
    """A safetensors delta shard written by hand, with hooks to break it."""
    header: dict = {"__metadata__": dict(digests)}
    data = b""
    for name, p in payloads.items():
        header[name] = {"dtype": dtype, "shape": shape_of(len(p)), "data_offsets": [len(data), len(data) + len(p)]}
        data += p
    if edit_header is not None:
        edit_header(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if length_prefix is None else length_prefix
    return struct.pack("<Q", n) + raw + data


s3 = s3_server_fixture()  # one server for the module, started by the first bucket variant

def _listed(table: dict, item) -> "str | None":
    """The reason ``table`` gives for this test item's case, if any: by its name, or by its name
    and parameters ("name[p=v,q=w]")."""
    name = item.originalname
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key, reason in table.items():
        row, _, rest = key.partition("[")
        if row != name:
            continue
        wanted = [kv.split("=", 1) for kv in rest.rstrip("]").split(",") if kv]
        if all(k in params and str(params[k]) == v for k, v in wanted):
            return reason
    return None


def _takes_world(fn) -> bool:
    import inspect

    return "world" in inspect.signature(fn).parameters


def pytest_generate_tests(metafunc):
    """Every row that takes ``world`` gets a directory and a bucket variant, unless listed."""
    if "world" not in metafunc.fixturenames:
        return
    kinds = ["dir"] if metafunc.function.__name__ in NOT_ON_A_BUCKET else ["dir", "bucket"]  # whole rows only
    metafunc.parametrize("world", kinds, indirect=True)


@pytest.fixture
def world(request, fast_tmp_path, rng) -> World:
    url = None
    if request.param == "bucket":
        skip = _listed(NOT_ON_A_BUCKET, request.node)
        if skip is not None:
            pytest.skip(f"not on a bucket: {skip}")
        xfail = _listed(BUCKET_XFAIL, request.node)
        if xfail is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=xfail))
        s3 = request.getfixturevalue("s3_env")
        url = s3.url(f"abuse/{uuid.uuid4().hex[:12]}")
    return World(str(fast_tmp_path), rng, bucket_url=url)


def test_every_row_runs_on_a_bucket_or_says_why_not():
    """A new row runs on a bucket unless it is listed with a reason: the lists cannot go stale."""
    rows = {n: f for n, f in globals().items() if n.startswith("test_") and callable(f)}
    rows.pop("test_every_row_runs_on_a_bucket_or_says_why_not")
    on_bucket = {n for n, f in rows.items() if _takes_world(f) and n not in NOT_ON_A_BUCKET}
    for table_name, table in (("NOT_ON_A_BUCKET", NOT_ON_A_BUCKET), ("BUCKET_XFAIL", BUCKET_XFAIL)):
        for key, reason in table.items():
            row, _, params = key.partition("[")
            assert row in rows, f"{table_name} names {row}, which is not a row of this module"
            assert reason.strip() and "\n" not in reason, f"{table_name}: {key}: give a one-line reason"
            if params or table is BUCKET_XFAIL:
                assert row in on_bucket, f"{table_name}: {key}: the row does not run on a bucket at all"
            for kv in filter(None, params.rstrip("]").split(",")):
                name = kv.partition("=")[0]
                marks = getattr(rows[row], "pytestmark", [])
                assert any(name in m.args[0].replace(" ", "").split(",") for m in marks if m.name == "parametrize"), (
                    f"{table_name}: {key}: {row} has no parameter {name!r}"
                )
    for name in rows:
        assert name in on_bucket or name in NOT_ON_A_BUCKET, (
            f"{name} neither takes the world fixture (so runs on a bucket) nor is in NOT_ON_A_BUCKET with a reason"
        )


def good_delta(world: World, version: int = 3, encoding: str = "xor", name: str = "a") -> tuple[bytes, str]:
    payload, new = world.payload(name, encoding)
    return payload, digest("xxh3-128", new)


# --- the source is not ready: retryable, nothing local touched --------------------------------


def test_missing_version_dir_is_not_ready_and_leaves_local_state(world):
    with pytest.raises(errors.VersionMissingError, match=r"version 5 is not published: .*weight_v000005(/model\.safetensors\.index\.json)? does not exist") as ei:
        world.pull(5)
    assert ei.value.retryable and ei.value.http_status == 404 and ei.value.error_type == "source_not_ready"
    world.assert_at(2)


def test_version_without_index_is_still_publishing(world):
    payload, dg = good_delta(world)
    vdir = world.write_delta(3, {"a": payload}, {"a": dg})
    os.unlink(os.path.join(vdir, INDEX))
    with pytest.raises(errors.IndexMissingError, match=r"version 3 .* has no model.safetensors.index.json yet .*retry later"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "shape, words",
    [
        ("truncated", r"model.safetensors is not complete"),
        ("trailing", r"bytes past its last tensor"),
        ("two_files", r"found \['extra.safetensors', 'model.safetensors'\]"),
        ("empty_dir", r"found \[\]"),
    ],
)
def test_indexless_dir_that_is_not_one_complete_model_safetensors_is_not_ready(world, shape, words):
    from safetensors.numpy import save_file

    vdir = world.vdir(3)
    os.makedirs(vdir)
    if shape != "empty_dir":
        save_file({n: v for n, v in world.tensors[2].items()}, os.path.join(vdir, "model.safetensors"))
    path = os.path.join(vdir, "model.safetensors")
    if shape == "truncated":
        os.truncate(path, os.path.getsize(path) - 5)
    elif shape == "trailing":
        with open(path, "ab") as f:
            f.write(b"\0" * 3)
    elif shape == "two_files":
        save_file({"x": np.zeros(2, np.uint8)}, os.path.join(vdir, "extra.safetensors"))
    with pytest.raises(errors.IndexMissingError, match=words):
        world.pull(3)
    world.assert_at(2)


def test_pruned_version_in_the_chain_breaks_it(world):
    world.publish(3, "xor", names=["b"])
    world.publish(4, "xor", names=["a"])
    import shutil

    shutil.rmtree(world.vdir(3))
    with pytest.raises(errors.ChainBrokenError, match=r"reaching version 4 needs version 3, which is not at .*pruned") as ei:
        world.pull(4)
    assert ei.value.needed_version == 3 and ei.value.retryable
    world.assert_at(2)


def test_version_whose_index_a_pruner_removed_first_is_not_ready_for_a_fresh_host(world):
    """Pruning deletes a version's index before its shards (docs/BUCKETS.md): between the two, a
    fresh host's chain through that version is not ready; a host already past it pulls on."""
    world.publish(3, "xor", names=["b"])
    os.unlink(os.path.join(world.vdir(1), INDEX))  # its shard is still there
    fresh = os.path.join(world.root, "fresh")
    with pytest.raises(errors.SourceNotReadyError, match=r"version 1\b.*(not at|no model.safetensors.index.json)") as ei:
        pull(fresh, world.seed, world.pull_source(), 3)
    assert ei.value.retryable
    assert marker_version(fresh) is None
    world.assert_at(2)
    assert world.pull(3).action == "chain"  # the local state at v2 needs only v3
    world.assert_at(3)


def test_delta_shard_named_by_the_index_but_missing_is_not_ready(world):
    world.publish(3, "xor", names=["a"])
    shard = shard_path(world.vdir(3))
    os.unlink(shard)
    with pytest.raises(errors.SourceNotReadyError, match=rf"v3: the index names shard {os.path.basename(shard)}, which is not in"):
        world.pull(3)
    world.assert_at(2)


def test_full_version_shard_named_by_the_index_but_missing_is_not_ready(world):
    world.publish(3, "xor", full=True)
    shard = shard_path(world.vdir(3))
    os.unlink(shard)
    with pytest.raises(errors.SourceNotReadyError, match=rf"full version v3 names shard {os.path.basename(shard)}, which is not in"):
        world.pull(3)
    world.assert_at(2)


# --- the index ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, words",
    [
        (b"{not json", r"index is not valid JSON"),
        (b"\xff\xfe", r"index is not valid JSON"),
        (b"[1, 2]", r"index is not a JSON object"),
        (b'{"metadata": {}, "weight_map": ["a"]}', r"weight_map must be an object"),
        (b'{"metadata": "v3", "weight_map": {}}', r"metadata must be an object"),
        (b'{"weight_map": 3}', r"weight_map must be an object"),
        (b'{"metadata": {}}', r"weight_map must be an object"),
    ],
)
def test_index_that_is_not_a_json_object_of_the_right_shape_is_malformed(world, content, words):
    os.makedirs(world.vdir(3))
    with open(os.path.join(world.vdir(3), INDEX), "wb") as f:
        f.write(content)
    with pytest.raises(errors.MalformedHeaderError, match=words) as ei:
        world.pull(3)
    assert ei.value.http_status == 422 and ei.value.error_type == "corrupt_artifact"
    world.assert_at(2)


def test_index_over_64_mib_is_refused_before_parsing(world):
    os.makedirs(world.vdir(3))
    with open(os.path.join(world.vdir(3), INDEX), "wb") as f:
        f.write(b'{"metadata": {}, "weight_map": {}}')
        f.write(b" " * (64 << 20))  # still valid JSON: only the size is wrong
    with pytest.raises(errors.MalformedHeaderError, match=r"index is \d+ bytes, over the 67108864-byte limit"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "field, value, error, words",
    [
        ("version", "three", errors.MalformedHeaderError, r"metadata version must be an integer string, got 'three'"),
        ("version", "-3", errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("version", -3, errors.MalformedHeaderError, r"metadata version must be >= 0, got -3"),
        ("version", 3.0, errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("version", True, errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("version", None, errors.MalformedHeaderError, r"metadata version must be an integer string, got None"),
        ("version", "\u00b3", errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("version", "++3", errors.MalformedHeaderError, r"metadata version must be an integer string, got '\+\+3'"),
        ("version", "+-3", errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("version", "0_3", errors.MalformedHeaderError, r"metadata version must be an integer string"),
        ("base_version", "++2", errors.MalformedHeaderError, r"metadata base_version must be an integer string"),
        ("base_version", "x", errors.MalformedHeaderError, r"metadata base_version must be an integer string"),
        ("version", "000004", errors.CorruptArtifactError, r"declares version 4 but lives in the dir of version 3"),
        ("base_version", "000001", errors.CorruptArtifactError, r"base_version must be version - 1 = 2, got 1"),
    ],
)
def test_bad_version_fields_in_a_delta_index_are_refused(world, field, value, error, words):
    payload, dg = good_delta(world)
    vdir = world.write_delta(3, {"a": payload}, {"a": dg})
    with open(os.path.join(vdir, INDEX)) as f:
        index = json.load(f)
    index["metadata"][field] = value
    with open(os.path.join(vdir, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(error, match=words):
        world.pull(3)
    world.assert_at(2)


def test_full_version_index_declaring_another_version_is_refused(world):
    world.publish(3, "xor", full=True)
    ipath = os.path.join(world.vdir(3), INDEX)
    with open(ipath) as f:
        index = json.load(f)
    index["metadata"]["version"] = "7"
    with open(ipath, "w") as f:
        json.dump(index, f)
    with pytest.raises(errors.CorruptArtifactError, match=r"declares version 7 but lives in the dir of version 3"):
        world.pull(3)
    world.assert_at(2)


def test_integer_and_unpadded_versions_in_an_index_are_accepted(world):
    payload, dg = good_delta(world)
    world.write_delta(3, {"a": payload}, {"a": dg})
    ipath = os.path.join(world.vdir(3), INDEX)
    with open(ipath) as f:
        index = json.load(f)
    index["metadata"].update(version=3, base_version="2")
    del index["metadata"]["compression_format"], index["metadata"]["checksum_format"]  # defaults: zstd, xxh3-128
    with open(ipath, "w") as f:
        json.dump(index, f)
    assert world.pull(3).applied_version == 3
    assert read_checkpoint_bytes(world.local)["a"] == world.payload("a", "xor")[1]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("delta_encoding", "bsdiff", r"unsupported delta_encoding 'bsdiff'; this reader supports \[.*'overwrite'.*'xor'.*\]"),
        ("compression_format", "lz4", r"unsupported compression_format 'lz4'; this reader supports \['zstd'\]"),
        ("checksum_format", "md5", r"unsupported checksum_format 'md5'; this reader supports \['adler32', 'blake3', 'xxh3-128'\]"),
    ],
)
def test_unknown_encoding_compression_or_checksum_is_unsupported_naming_what_is(world, field, value, words):
    payload, dg = good_delta(world)
    vdir = world.write_delta(3, {"a": payload}, {"a": dg})
    with open(os.path.join(vdir, INDEX)) as f:
        index = json.load(f)
    index["metadata"][field] = value
    with open(os.path.join(vdir, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(errors.UnsupportedFormatError, match=words) as ei:
        world.pull(3)
    assert ei.value.error_type == "unsupported_format" and ei.value.http_status == 422
    world.assert_at(2)


@pytest.mark.parametrize(
    "name",
    ["../weight_v000001/delta-r00000-00001.safetensors", "sub/d.safetensors", "/etc/passwd", "d\x00.safetensors",
     "d\n.safetensors", "..", ".", "", "a\\b.safetensors", 7],
)
def test_shard_name_escaping_the_version_dir_is_refused_before_opening(world, name):
    payload, dg = good_delta(world)
    world.write_version(3, {"d.safetensors": delta_shard({"a": payload}, {"a": dg})}, {"a": name})
    with pytest.raises(errors.UnsafeNameError, match=r"weight_map\['a'\].* names .*which escapes its directory.*Refusing to touch it"):
        world.pull(3)
    world.assert_at(2)


def test_shard_symlink_resolving_outside_the_version_dir_is_refused(world):
    payload, dg = good_delta(world)
    outside = os.path.join(world.root, "elsewhere.safetensors")
    with open(outside, "wb") as f:
        f.write(delta_shard({"a": payload}, {"a": dg}))
    world.write_version(3, {}, {"a": "d.safetensors"})
    os.symlink(outside, os.path.join(world.vdir(3), "d.safetensors"))
    with pytest.raises(errors.UnsafeNameError, match=r"outside"):
        world.pull(3)
    world.assert_at(2)


# --- delta shards: headers ------------------------------------------------------------------------


def test_huge_safetensors_header_length_is_refused(world):
    payload, dg = good_delta(world)
    world.write_delta(3, {"a": payload}, {"a": dg}, length_prefix=200 << 20)
    with pytest.raises(errors.MalformedHeaderError, match=r"header length 209715200 exceeds the limit 104857600"):
        world.pull(3)
    world.assert_at(2)


def test_header_length_past_the_end_of_a_truncated_shard_is_malformed(world):
    world.publish(3, "xor", names=["a"])
    shard = shard_path(world.vdir(3))
    os.truncate(shard, 40)  # cut inside the JSON header
    with pytest.raises(errors.MalformedHeaderError, match=r"runs past the end of the 40-byte file \(truncated\?\)"):
        world.pull(3)
    world.assert_at(2)


def test_shard_truncated_inside_its_data_area_is_malformed(world):
    world.publish(3, "xor", names=["a"])
    shard = shard_path(world.vdir(3))
    os.truncate(shard, os.path.getsize(shard) - 1)
    with pytest.raises(errors.MalformedHeaderError, match=r"outside the \d+-byte data area \(truncated\?\)"):
        world.pull(3)
    world.assert_at(2)


def test_tensor_offsets_past_the_data_area_are_malformed(world):
    payload, dg = good_delta(world)

    def past_end(h):
        h["a"]["data_offsets"] = [0, len(payload) + 64]
        h["a"]["shape"] = [len(payload) + 64]

    world.write_delta(3, {"a": payload}, {"a": dg}, edit_header=past_end)
    with pytest.raises(errors.MalformedHeaderError, match=r"tensor 'a' spans \[0, \d+\) outside the \d+-byte data area"):
        world.pull(3)
    world.assert_at(2)


def test_overlapping_tensors_in_a_shard_are_malformed(world):
    pa, da = good_delta(world, name="a")
    pb, db = good_delta(world, name="b")

    def overlap(h):
        b0, b1 = h["b"]["data_offsets"]
        h["b"]["data_offsets"] = [b0 - 4, b1 - 4]

    world.write_delta(3, {"a": pa, "b": pb}, {"a": da, "b": db}, edit_header=overlap)
    with pytest.raises(errors.MalformedHeaderError, match=r"tensors 'a' and 'b' overlap"):
        world.pull(3)
    world.assert_at(2)


def test_empty_tensor_between_two_overlapping_ones_does_not_hide_the_overlap(world):
    pa, da = good_delta(world, name="a")
    pb, db = good_delta(world, name="b")

    def overlap_behind_an_empty_tensor(h):
        b0, b1 = h["b"]["data_offsets"]
        h["b"]["data_offsets"] = [b0 - 4, b1 - 4]  # 4 bytes inside a
        h["z"] = {"dtype": "U8", "shape": [0], "data_offsets": [b0 - 4, b0 - 4]}  # sorts between a and b

    world.write_delta(3, {"a": pa, "b": pb}, {"a": da, "b": db}, edit_header=overlap_behind_an_empty_tensor)
    with pytest.raises(errors.MalformedHeaderError, match=r"tensors 'a' and 'b' overlap"):
        world.pull(3)
    world.assert_at(2)


def test_sparse_segments_below_the_spec_minimum_are_refused_at_load(world):
    """64 one-element segments over a 64-element tensor: valid under the old "seg >= 1", and
    what made a 12 MiB payload cost seconds per parse. The floor is seg >= min(n, 2^16)."""
    n, seg = 64, 1
    payload = b"WSSP" + bytes([1, 4, 0, 0]) + struct.pack("<QII", n, seg, n // seg) + b"\0" * 12 * (n // seg)  # no changes
    unchanged = world.expected[2]["a"]
    world.write_delta(3, {"a": payload}, {"a": digest("xxh3-128", unchanged)}, encoding="sparse-v1")
    with pytest.raises(errors.PayloadBoundError, match=r"v3: tensor a: .*segment size 1 is below the spec's minimum"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_shard_gone_or_replaced_between_load_and_apply_is_not_ready_and_leaves_no_marker(world, monkeypatch, how):
    """The loaded chain holds no open shard; the apply reopens each one and checks it is still
    the file it checked. (The wrapper only places the real deletion between the two steps.)"""
    from weightsync.puller import pull as pull_mod

    world.publish(3, "xor")
    shard = next(os.path.join(world.vdir(3), n) for n in os.listdir(world.vdir(3)) if n.endswith(".safetensors"))
    check = pull_mod.check_against_local

    def then_lose_the_shard(*args, **kwargs):
        check(*args, **kwargs)
        raw = open(shard, "rb").read()
        os.unlink(shard)
        if how == "replaced":
            with open(shard, "wb") as f:
                f.write(raw + b"\0" * 8)

    monkeypatch.setattr(pull_mod, "check_against_local", then_lose_the_shard)
    with pytest.raises(errors.SourceNotReadyError, match="disappeared while the pull was applying|changed since the pull checked"):
        world.pull(3)
    assert marker_version(world.local) is None  # cleared before the first write: the next pull reseeds


def test_byte_length_not_dtype_times_shape_is_malformed(world):
    payload, dg = good_delta(world)
    world.write_delta(3, {"a": payload}, {"a": dg}, shape_of=lambda n: [n - 1])
    with pytest.raises(errors.MalformedHeaderError, match=r"tensor 'a' holds \d+ bytes, but U8 x \[\d+\] needs \d+"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "dtype, shape_of",
    [("F32", lambda n: [n // 4]), ("U8", lambda n: [1, n]), ("I8", lambda n: [n])],
)
def test_delta_tensor_that_is_not_one_dimensional_u8_is_malformed(world, dtype, shape_of):
    payload, dg = good_delta(world)
    payload += b"\0" * (-len(payload) % 4)  # keep dtype x shape consistent so only dtype/rank is wrong
    world.write_delta(3, {"a": payload}, {"a": dg}, dtype=dtype, shape_of=shape_of)
    with pytest.raises(errors.MalformedHeaderError, match=r"delta tensor 'a' must be 1-D U8, got"):
        world.pull(3)
    world.assert_at(2)


def test_shard_holding_other_tensors_than_the_index_maps_to_it_is_a_mismatch(world):
    pa, da = good_delta(world, name="a")
    pb, db = good_delta(world, name="b")
    raw = delta_shard({"a": pa, "b": pb}, {"a": da, "b": db})
    world.write_version(3, {"d.safetensors": raw}, {"a": "d.safetensors", "c": "d.safetensors"})
    with pytest.raises(errors.ShardMismatchError, match=r"does not hold what the index maps to it: missing \['c'\], unexpected \['b'\]"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "bad_digest, words",
    [
        (None, r"no well-formed xxh3-128 digest for 'a' \(got None\)"),
        ("ABCDEF0123456789ABCDEF0123456789", r"no well-formed xxh3-128 digest"),  # upper case
        ("06c30193", r"no well-formed xxh3-128 digest"),  # an adler32 digest in an xxh3 version
        ("g" * 32, r"no well-formed xxh3-128 digest"),
    ],
)
def test_missing_or_ill_formed_digest_is_malformed(world, bad_digest, words):
    payload, _ = good_delta(world)
    world.write_delta(3, {"a": payload}, {} if bad_digest is None else {"a": bad_digest})
    with pytest.raises(errors.MalformedHeaderError, match=words):
        world.pull(3)
    world.assert_at(2)


# --- payloads ------------------------------------------------------------------------------------


def _frame_without_content_size(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data)


@pytest.mark.parametrize(
    "break_payload, words",
    [
        (lambda p, raw: b"NOTZSTD!" + p, r"payload is not a zstd frame"),
        (lambda p, raw: _frame_without_content_size(raw), r"does not declare its content size"),
        (lambda p, raw: p + b"\x00\x01", r"2 trailing bytes after the zstd frame"),
        (lambda p, raw: p + p, r"trailing bytes after the zstd frame"),
        (lambda p, raw: p[:-3], r"zstd frame truncated"),
    ],
)
def test_payload_that_is_not_exactly_one_sized_zstd_frame_is_out_of_bounds(world, break_payload, words):
    payload, new = world.payload("a", "xor")
    raw = np.bitwise_xor(np.frombuffer(world.expected[2]["a"], np.uint8), np.frombuffer(new, np.uint8)).tobytes()
    world.write_delta(3, {"a": break_payload(payload, raw)}, {"a": digest("xxh3-128", new)})
    with pytest.raises(errors.PayloadBoundError, match=r"v3: tensor a: delta payload out of bounds: .*" + words):
        world.pull(3)
    world.assert_at(2)


def test_decompression_bomb_declaring_more_than_the_tensor_is_refused_unread(world):
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    world.write_delta(3, {"a": bomb}, {"a": "0" * 32})
    with pytest.raises(errors.PayloadBoundError, match=r"zstd frame declares 67108864 bytes, expected 256"):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "payload_of, words",
    [
        # 300 positions cannot fit a 256-byte tensor.
        (lambda: overwrite_body_payload(300, range(300), bytes(300)), r"overwrite of 300 positions into a 256-byte tensor"),
        (lambda: zstandard.ZstdCompressor().compress(b"\x01\x00\x00\x00\x05\x00\x00\x00"), r"is not 4 \+ 5 x count"),
        (lambda: zstandard.ZstdCompressor().compress(b"\x01\x00"), r"is not 4 \+ 5 x count"),
    ],
)
def test_overwrite_payload_of_impossible_size_is_refused_before_writing(world, payload_of, words):
    world.write_delta(3, {"a": payload_of()}, {"a": "0" * 32}, encoding="overwrite")
    with pytest.raises(errors.PayloadBoundError, match=words):
        world.pull(3)
    world.assert_at(2)


@pytest.mark.parametrize(
    "positions, words",
    [
        ([3, 256], r"overwrite position 256 is past the 256-byte tensor"),
        ([7, 5], r"overwrite positions are not strictly ascending"),
        ([4, 4], r"overwrite positions are not strictly ascending"),
    ],
)
def test_overwrite_position_out_of_range_fails_at_apply_and_the_next_pull_reseeds(world, positions, words):
    world.publish(3, "xor", names=["b"])
    bad = overwrite_body_payload(2, positions, b"\x01\x02")
    world.write_delta(4, {"a": bad}, {"a": "0" * 32}, encoding="overwrite")
    with pytest.raises(errors.PayloadBoundError, match=words):
        world.pull(4)
    assert marker_version(world.local) is None  # cleared before the first in-place write
    result = world.pull(3)
    assert "seed" in result.action
    world.assert_at(3)


def test_corrupt_zstd_data_inside_a_well_formed_frame_fails_at_apply(world):
    # A frame whose header and block sizes are valid but whose one compressed block is garbage.
    garbage = bytes([0xB7, 0x13, 0x0F, 0xFF, 0x2A, 0x81, 0x00, 0x5C, 0x33, 0xE1, 0x07, 0x9D])
    # Frame header: single segment, 2-byte content size field (stores size - 256 = 0).
    # Block header: last block, type 2 (compressed), size len(garbage).
    frame = b"\x28\xb5\x2f\xfd" + b"\x60" + struct.pack("<H", 256 - 256) + struct.pack("<I", len(garbage) << 3 | 0b101)[:3] + garbage
    assert zstandard.get_frame_parameters(frame).content_size == 256
    world.write_delta(3, {"a": frame}, {"a": "0" * 32})
    with pytest.raises(errors.PayloadBoundError, match=r"tensor a: delta payload out of bounds: .*(corrupt|ended)"):
        world.pull(3)
    world.assert_marker_truthful()
    assert world.pull(2).applied_version == 2
    world.assert_at(2)


# --- local state ------------------------------------------------------------------------------------


def test_delta_for_a_tensor_the_model_does_not_have_fails_after_one_reseed(world):
    payload, dg = good_delta(world)
    world.write_delta(3, {"ghost": payload}, {"ghost": dg})
    with pytest.raises(errors.CorruptArtifactError, match=r"after a fresh seed from .*still do not fit the checkpoint.*ghost") as ei:
        world.pull(3)
    assert isinstance(ei.value.__cause__, errors.LocalTensorMismatchError)
    assert "no such tensor" in str(ei.value.__cause__)
    world.assert_marker_truthful()


def test_delta_sized_for_another_model_is_a_corrupt_artifact(world):
    old = np.frombuffer(world.expected[2]["a"] * 2, np.uint8)  # as if "a" had 512 bytes
    new = old.copy()
    new[0] ^= 1
    world.write_delta(3, {"a": _xor_payload(old, new)}, {"a": digest("xxh3-128", new.tobytes())})
    with pytest.raises(errors.PayloadBoundError, match=r"v3: tensor a: .*zstd frame declares 512 bytes, expected 256"):
        world.pull(3)
    world.assert_at(2)  # the local tensor has the seed's length: the artifact is bad, nothing written


def test_local_tensor_of_another_length_is_reseeded_not_blamed_on_the_artifact(world):
    """A local file swapped for another model's (marker intact): the artifact is fine, so one
    reseed and replay must succeed (catalogue: LocalTensorMismatchError -> reseed once)."""
    from safetensors.numpy import save_file

    world.publish(3, "xor", names=["a"])
    wrong = dict(world.tensors[2])
    wrong["a"] = np.zeros(32, np.float32)  # half the length
    save_file(wrong, os.path.join(world.local, "model.safetensors"), metadata={"format": "pt"})
    result = world.pull(3)
    # The file's size differs from the one the marker recorded: the plan reseeds up front
    # (before the first delta would have failed on it and the pull reseeded once).
    assert result.reseeded or "the marker recorded" in result.reason
    world.assert_at(3)


def test_wrong_digest_fails_after_one_reseed_naming_version_tensor_and_digests(world):
    world.publish(3, "xor", names=["a", "b"])
    payload, new = world.payload("a", "xor", base=3)
    wrong = "0123456789abcdef0123456789abcdef"
    world.write_delta(4, {"a": payload}, {"a": wrong})
    actual = digest("xxh3-128", new)
    with pytest.raises(
        errors.ChecksumMismatchError,
        match=rf"version 4: 1 tensor\(s\) failed xxh3-128 verification after a fresh seed: a: expected {wrong}, got {actual}",
    ) as ei:
        world.pull(4)
    assert ei.value.version == 4 and ei.value.mismatches == [("a", wrong, actual)]
    world.assert_marker_truthful()


def test_local_byte_corrupted_between_pulls_is_healed_by_one_reseed(world):
    from core_support import flip_local_byte

    world.publish(3, "overwrite", names=["a"])
    # A byte the v3 overwrite does not touch (an overwritten one would be healed by the delta
    # itself), found from the bytes rather than assumed: the tensors depend on the test's rng.
    old, new = (np.frombuffer(world.expected[v]["a"], np.uint8) for v in (2, 3))
    flip_local_byte(world.local, "a", int(np.flatnonzero(old == new)[-1]))
    result = world.pull(3)
    world.assert_at(3)
    assert result.reseeded


@pytest.mark.parametrize(
    "marker, words",
    [
        (None, r"no applied-version marker"),
        (b"{garbage", r"no applied-version marker"),
        (b'{"version": "abc"}', r"no applied-version marker"),
        (b'{"version": "000002", "source_dir": "/some/other/run"}', r"another source dir"),
    ],
)
def test_missing_unreadable_or_foreign_marker_means_seed(world, marker, words):
    world.publish(3, "xor", names=["a"])
    state = os.path.join(world.local, ".weight_sync", "state.json")
    os.unlink(state)
    if marker is not None:
        with open(state, "wb") as f:
            f.write(marker)
    result = world.pull(3)
    assert result.action == "seed+chain"
    assert result.reason.startswith("seed from the engine's own model") and re.search(words, result.reason)
    world.assert_at(3)


def test_foreign_marker_is_not_a_backward_pull(world):
    state = os.path.join(world.local, ".weight_sync", "state.json")
    with open(state, "w") as f:
        json.dump({"version": "000009", "source_dir": "/some/other/run"}, f)
    assert world.pull(1).applied_version == 1
    world.assert_at(1)


# --- requests -------------------------------------------------------------------------------------


def test_target_below_the_applied_version_is_a_backward_pull(world):
    with pytest.raises(
        errors.BackwardPullError,
        match=r"cannot pull backwards: the local checkpoint is at version 2, the request asks for 1.*pull version 0",
    ) as ei:
        world.pull(1)
    assert ei.value.http_status == 400 and ei.value.error_type == "bad_request"
    world.assert_at(2)


@pytest.mark.parametrize("target", [-1, 1.5, "3", True, None])
def test_negative_or_non_integer_target_is_a_bad_request(world, target):
    with pytest.raises(errors.InvalidRequestError, match=r"target_version must be an integer >= 0, got"):
        world.pull(target)
    world.assert_at(2)


def test_seed_dir_equal_to_the_local_checkpoint_dir_is_a_bad_request(world):
    with pytest.raises(errors.InvalidRequestError, match=r"seed dir .* is the local checkpoint dir itself"):
        pull(world.local, world.local, world.pull_source(), 1)
    link = os.path.join(world.root, "local-link")
    os.symlink(world.local, link)
    with pytest.raises(errors.InvalidRequestError, match=r"is the local checkpoint dir itself"):
        pull(world.local, link, world.pull_source(), 1)
    world.assert_at(2)


def test_pull_waits_for_the_host_lock_then_times_out(world):
    os.makedirs(os.path.join(world.local, ".weight_sync"), exist_ok=True)
    fd = os.open(os.path.join(world.local, ".weight_sync", "lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another pull on this host holds it
        with pytest.raises(errors.LockTimeoutError, match=r"another pull held .*lock for more than 0 s") as ei:
            world.pull(0, lock_timeout_s=0.2)
        assert ei.value.http_status == 409 and ei.value.error_type == "conflict" and ei.value.retryable
    finally:
        os.close(fd)
    world.assert_at(2)
    assert world.pull(0).applied_version == 0  # released: the next pull proceeds


# --- publishing -----------------------------------------------------------------------------------


def test_publishing_over_an_existing_version_is_refused(world):
    pub = Publisher(world.source, encoding="xor", workers=1)
    pub.seed_snapshot(world.tensors[1], version=1)
    # Other bytes under a committed number are a conflict (an identical retry is "already published").
    with pytest.raises(errors.VersionConflictError, match=r"version 2 is already published in .*versions are immutable"):
        pub.publish(2, world.tensors[1])
    pub.close()
    world.pull(0)
    assert world.pull(2).applied_version == 2
    world.assert_at(2)


def test_overwrite_refuses_a_tensor_over_4_gib():
    big = np.broadcast_to(np.zeros(1, np.uint8), (1 << 32,))  # 4 GiB view of one byte: no memory
    with pytest.raises(errors.OverwriteTooLargeError, match=r"tensor w has 4294967296 bytes.*cannot address past 4 GiB.*'xor'"):
        OverwriteCodec().encode(big, big, 1, 1, "w")


def test_blake3_without_its_package_names_the_install_hint(world):
    world.publish(3, "xor", names=["a"], checksum="blake3")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["blake3"] = None  # the package is not installed
        from weightsync import Publisher, errors, pull
        try:
            Publisher({world.source + "-other"!r}, checksum="blake3")
        except errors.ChecksumUnavailableError as e:
            print("PUBLISH", type(e).__name__, e)
        try:
            pull({world.local!r}, {world.seed!r}, {world.pull_source()!r}, 3)
        except errors.ChecksumUnavailableError as e:
            print("PULL", type(e).__name__, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert "PUBLISH ChecksumUnavailableError checksum 'blake3' needs the optional package 'blake3': pip install blake3" in out.stdout
    assert "PULL ChecksumUnavailableError checksum 'blake3' needs the optional package 'blake3': pip install blake3" in out.stdout
    # Validate before mutating: the pull refused before clearing the marker of v2.
    world.assert_at(2)


# --- the error hierarchy itself -----------------------------------------------------------------


def test_every_error_has_a_stable_type_status_and_stdlib_parent():
    table = errors.error_types()
    assert table["bad_request"] == 400
    assert table["forbidden"] == 403
    assert table["source_not_ready"] == 404
    assert table["conflict"] == 409
    assert table["corrupt_artifact"] == 422
    assert table["unsupported_format"] == 422
    assert table["local_state_corrupt"] == 500
    assert table["publish_error"] == 400
    assert issubclass(errors.SourceNotReadyError, FileNotFoundError)
    assert issubclass(errors.CorruptArtifactError, ValueError)
    assert issubclass(errors.InvalidRequestError, ValueError)
    assert issubclass(errors.LockTimeoutError, TimeoutError) and issubclass(errors.LockTimeoutError, errors.ConflictError)
    assert issubclass(errors.PathNotAllowedError, PermissionError)
    assert issubclass(errors.LocalStateError, RuntimeError)
    assert issubclass(errors.ChecksumUnavailableError, ImportError)
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.WeightSyncError)


def test_path_not_allowed_names_the_path_and_the_roots():
    e = errors.PathNotAllowedError("/etc", ["/data", "/scratch"], "not below a root")
    assert e.http_status == 403 and e.error_type == "forbidden"
    assert "path '/etc' is outside the allowed roots ['/data', '/scratch'] (not below a root)" in str(e)


def test_local_tensor_mismatch_and_local_state_errors_say_what_to_do():
    e = errors.LocalTensorMismatchError("w", "512 bytes locally, 256 in the delta")
    assert isinstance(e, errors.LocalStateError) and e.http_status == 500 and e.error_type == "local_state_corrupt"
    assert "local checkpoint cannot take the delta for w: 512 bytes locally" in str(e)


def test_bad_payload_frame_is_refused_before_seeding(world):
    """Catalogue: a payload that is not one sized zstd frame is caught at *load*, i.e. before
    the seed of a seed+chain plan changes the local checkpoint."""
    world.publish(3, "xor", full=True)
    payload, new = world.payload("a", "xor", base=3)
    world.write_delta(4, {"a": b"NOTZSTD!" + payload}, {"a": digest("xxh3-128", new)})
    with pytest.raises(errors.PayloadBoundError, match=r"v4: tensor a: .*payload is not a zstd frame"):
        world.pull(4)
    world.assert_at(2)
