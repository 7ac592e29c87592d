"""Rows of the abuse catalogue (test_core_abuse_catalogue.py) that apply to a bucket, on the real
S3 server: the published objects altered in the bucket between pulls. Each pull either fails
with the same typed error a directory gives, before the local state moves, or succeeds with the
exact bytes; never a success over damaged bytes."""

from __future__ import annotations

import json
import struct

import obstore
import pytest

from core_support import assert_checkpoint_is, marker_version
from weightsync import errors, pull
from weightsync.storage.source import BucketSource

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"


@pytest.fixture
def world(bucket_run):
    """v1 full and v2 a delta in the bucket; a local dir at v1."""
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    bucket_run.local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, bucket_run.local)
    bucket_run.src = BucketSource(bucket_run.url)
    return bucket_run


def shard_of(world, version: int) -> str:
    return next(k for k in world.src.list(f"weight_v{version:06d}/") if k.endswith(".safetensors"))


def replace(world, key: str, data: bytes) -> None:
    obstore.put(world.src.store, key, data)


def pull_v2(world):
    return pull(world.local, world.seed, world.url, 2)


def assert_untouched(world) -> None:
    assert marker_version(world.local) == 1
    assert_checkpoint_is(world.local, world.expected[1])


def test_a_delta_shard_named_by_the_index_but_missing_from_the_bucket_is_not_ready(world):
    world.src.delete([shard_of(world, 2)])
    with pytest.raises(errors.SourceNotReadyError):
        pull_v2(world)
    assert_untouched(world)


@pytest.mark.parametrize("content", [b"not json", b"[]", b'{"weight_map": 3}', b'{"metadata": {}}'])
def test_an_index_in_the_bucket_that_is_not_a_json_object_of_the_right_shape_is_malformed(world, content):
    key = f"weight_v000002/{INDEX}"
    replace(world, key, content)
    with pytest.raises(errors.CorruptArtifactError):
        pull_v2(world)
    assert_untouched(world)


def test_a_huge_safetensors_header_length_in_the_bucket_is_refused(world):
    key = shard_of(world, 2)
    data = world.src.read(key)
    replace(world, key, struct.pack("<Q", 1 << 60) + data[8:])
    with pytest.raises(errors.CorruptArtifactError):
        pull_v2(world)
    assert_untouched(world)


def test_a_delta_shard_cut_short_in_the_bucket_is_malformed_never_applied(world):
    key = shard_of(world, 2)
    data = world.src.read(key)
    replace(world, key, data[: len(data) - 7])
    with pytest.raises(errors.CorruptArtifactError):
        pull_v2(world)
    assert_untouched(world)


def test_a_pruned_version_in_the_chain_breaks_it(world):
    local = world.fresh_local()
    world.src.delete([f"weight_v000001/{INDEX}"])  # the full version a fresh host's chain starts from, pruned
    with pytest.raises(errors.SourceNotReadyError):
        pull(local, world.seed, world.url, 2)
    pull_v2(world)  # a host already at v1 needs only the delta
    assert_checkpoint_is(world.local, world.expected[2])
