"""A run published to a bucket keeps ``file_digests`` under the bucket's names of its files
(the content-suffixed keys its ``weight_map`` names), so an HTTP cache in front of the bucket's
contents is checked file by file and used, not passed over for the origin (issue 29.2)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.fleet.origin import OriginServer
from core_support import assert_checkpoint_is
from weightsync import pull
from weightsync.format.file_digests import FILE_DIGESTS_KEY
from weightsync.storage.http import ORIGIN_ENV
from weightsync.storage.source import BucketSource

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"


def _download(url: str, into: str) -> None:
    src = BucketSource(url)
    for key in src.list():
        path = os.path.join(into, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(src.read(key))


@pytest.fixture
def servers(fast_tmp_path):
    made = []

    def serve(root: str) -> OriginServer:
        s = OriginServer(root, ("127.0.0.1", 0))
        s.start_in_thread()
        made.append(s)
        return s

    yield serve
    for s in made:
        s.shutdown()
        s.server_close()


def test_a_bucket_index_names_each_file_digest_under_the_bucket_key_of_that_file(bucket_run, servers, monkeypatch, fast_tmp_path):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    src = BucketSource(bucket_run.url)
    listing = src.list()
    for v in (1, 2):
        index = json.loads(src.read(f"weight_v{v:06d}/{INDEX}"))
        files = index[FILE_DIGESTS_KEY]
        assert set(files) == set(index["weight_map"].values())
        for name, entry in files.items():
            assert listing[f"weight_v{v:06d}/{name}"].size == entry["nbytes"]
    # The bucket's contents behind an origin and a cache (a copy): every shard comes from the cache.
    origin_root, cache_root = str(fast_tmp_path / "origin"), str(fast_tmp_path / "cache")
    _download(bucket_run.url, os.path.join(origin_root, "run"))
    _download(bucket_run.url, os.path.join(cache_root, "run"))
    origin, cache = servers(origin_root), servers(cache_root)
    monkeypatch.setenv(ORIGIN_ENV, origin.base_url)
    local = bucket_run.fresh_local()
    assert pull(local, bucket_run.seed, f"{cache.base_url}/run", 2).applied_version == 2
    assert_checkpoint_is(local, bucket_run.expected[2])
    assert not [p for m, p, _ in origin.served if m == "GET" and p.endswith(".safetensors")]
    assert [p for m, p, _ in cache.served if m == "GET" and p.endswith(".safetensors")]
