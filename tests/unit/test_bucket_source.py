"""Buckets as a source dir, against a real S3 server on loopback (SeaweedFS ``weed mini``):
publish to ``s3://bucket/prefix`` and pull from it, every version compared with its bytes."""

from __future__ import annotations

import json
import os

import obstore
import pytest

from weightsync import errors
from weightsync.storage.mirror import is_placeholder, mirror_dir
from weightsync.storage.source import BucketSource
from weightsync.storage.url import parse_bucket_url

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"


def keys(url: str, prefix: str = "") -> dict:
    return BucketSource(url).list(prefix)


def test_a_chain_published_to_a_bucket_pulls_to_the_published_bytes(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 4, full_at={1})
    for v in (1, 3, 4):
        bucket_run.assert_pulls(v)
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(2, local)
    r = bucket_run.assert_pulls(4, local)  # a chain on a local state: only the two deltas fetched
    assert r.action == "chain" and r.deltas_applied == 2


def test_the_bucket_has_the_directory_layout_with_content_named_shards(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    listing = keys(bucket_run.url)
    assert "weightsync-run.json" in listing
    for v in (1, 2):
        index = json.loads(BucketSource(bucket_run.url).read(f"weight_v{v:06d}/{INDEX}"))
        for fname in set(index["weight_map"].values()):
            assert f"weight_v{v:06d}/{fname}" in listing
            stem = fname.rsplit(".", 1)[0]
            assert len(stem.rsplit("-", 1)[1]) == 16  # the content hash suffix
    assert "weight_v000001/config.json" in listing


def test_a_missing_index_is_not_ready_and_leaves_no_trace(bucket_run):
    local = bucket_run.fresh_local()
    with pytest.raises(errors.SourceNotReadyError):
        from weightsync import pull
        pull(local, bucket_run.seed, bucket_run.url, 1)
    assert not os.path.exists(local)


def test_shards_uploaded_but_no_index_is_not_ready(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    src = BucketSource(bucket_run.url)
    src.delete([f"weight_v000002/{INDEX}"])  # as if the commit never happened
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    with pytest.raises(errors.SourceNotReadyError):
        bucket_run.assert_pulls(2, local)
    bucket_run.assert_pulls(1, local)  # the local state was not touched


def test_a_pull_fetches_only_what_its_plan_reads_and_empties_its_spool_after_the_apply(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    fetched = []
    from weightsync.puller.bucket import pull_from_bucket
    from weightsync.puller.pull import _check_local_dir, pull as run_pull

    pull_from_bucket(run_pull, _check_local_dir, local, bucket_run.seed, bucket_run.url, 3,
                     fetch_progress=lambda done, total: fetched.append(total))
    delta_nbytes = sum(o.size for k, o in keys(bucket_run.url).items()
                       if k.startswith(("weight_v000002/", "weight_v000003/")) and k.endswith(".safetensors"))
    assert set(fetched) == {delta_nbytes}  # the two deltas' shards, nothing of v1
    root = mirror_dir(local, parse_bucket_url(bucket_run.url))
    for v in (1, 2, 3):  # every shard is a placeholder again: the spool holds nothing after the apply
        d = os.path.join(root, f"weight_v{v:06d}")
        shards = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        assert shards and all(is_placeholder(os.path.join(d, f)) for f in shards)
    bucket_run.assert_pulls(3, local)


def test_wrong_credentials_are_a_typed_error_that_says_so(bucket_run, monkeypatch):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    local = bucket_run.fresh_local()
    with pytest.raises(errors.BucketCredentialsError) as e:
        bucket_run.assert_pulls(1, local)
    assert "credentials" in str(e.value) and e.value.http_status == 403
    with pytest.raises(errors.BucketCredentialsError):
        bucket_run.publisher()


def test_a_second_publisher_racing_a_commit_loses_loudly_and_the_winners_bytes_stay(bucket_run, monkeypatch, fast_tmp_path):
    a = bucket_run.publisher()
    bucket_run.publish_versions(a, 1, full_at={1})
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging-b"))
    b = bucket_run.publisher()
    assert b.run_id == a.run_id  # the run identity was created once; the second keeps it
    # b starts from the same base but publishes other bytes as v1: the index is a's. b's new
    # staging copy was filled from the bucket, so its own guard refuses before writing; a race
    # that neither copy saw ends at the conditional create (the racing test below).
    other = bucket_run.next_tensors(0.5)
    bucket_run.tensors.pop(), bucket_run.expected.pop()
    with pytest.raises((errors.BucketConflictError, errors.VersionConflictError)):
        b.publish(1, other, full=True)
    bucket_run.assert_pulls(1)


def test_a_lost_reply_to_the_index_create_is_recognised_as_ours(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    # Forget that v1 was uploaded: the next upload finds the index there, byte-equal to ours.
    pub.bucket.uploaded.clear()
    pub.bucket.upload_committed()
    bucket_run.publish_versions(pub, 1)
    bucket_run.assert_pulls(2)


def test_pruning_removes_the_index_first_then_the_shards(bucket_run, monkeypatch):
    from weightsync.storage import source as source_mod

    deletes: list[list[str]] = []
    delete = source_mod.BucketSource.delete

    def recorded(self, keys):
        keys = list(keys)
        deletes.append(keys)
        return delete(self, keys)

    monkeypatch.setattr(source_mod.BucketSource, "delete", recorded)
    pub = bucket_run.publisher(keep_versions=2, full_every=3)
    bucket_run.publish_versions(pub, 7, full_at={1})
    pruned_v1 = [i for i, ks in enumerate(deletes) if any(k.startswith("weight_v000001/") for k in ks)]
    assert pruned_v1 and deletes[pruned_v1[0]] == [f"weight_v000001/{INDEX}"]  # alone, and first
    assert any(k.endswith(".safetensors") for i in pruned_v1[1:] for k in deletes[i])  # then the shards, in bulk
    listing = keys(bucket_run.url)
    staged = {n for n in os.listdir(pub.source_dir) if n.startswith("weight_v")}
    in_bucket = {k.split("/")[0] for k in listing if k.startswith("weight_v")}
    assert in_bucket == staged and "weight_v000001" not in in_bucket
    bucket_run.assert_pulls(7)


def test_a_store_that_ignores_conditional_create_is_refused_at_start(bucket_run, monkeypatch):
    from weightsync.storage import source as source_mod

    def create_always(self, key, data):
        obstore.put(self.store, key, data)  # an unconditional PUT: what a store without If-None-Match does
        return True

    monkeypatch.setattr(source_mod.BucketSource, "create", create_always)
    with pytest.raises(errors.ConditionalWritesUnsupportedError):
        bucket_run.publisher()


def test_a_replay_after_local_damage_reaches_unfetched_shards_through_the_full_fetch_fallback(bucket_run):
    from core_support import flip_local_byte

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(2, local)  # the mirror now holds v1's shards as placeholders again
    flip_local_byte(local, "layers.0.w", 7)  # a bad disk: the chain's verification fails, the pull reseeds
    # The replay plans a seed from v1, whose shards are placeholders: the pull fails typed, every
    # shard up to v3 is fetched, and the pull runs again on a complete mirror.
    result = bucket_run.assert_pulls(3, local)
    assert result.action == "seed+chain"


def test_a_missing_client_is_a_typed_error_that_names_the_extra(bucket_run, monkeypatch):
    import sys

    from weightsync import pull

    monkeypatch.setitem(sys.modules, "obstore.store", None)  # as if obstore were not installed
    from weightsync.storage import client

    monkeypatch.setattr(client, "_stores", {})
    with pytest.raises(errors.BucketClientMissingError) as e:
        pull(bucket_run.fresh_local(), bucket_run.seed, bucket_run.url, 1)
    assert "weightsync[bucket]" in str(e.value)
    with pytest.raises(errors.BucketClientMissingError):
        bucket_run.publisher()


def test_a_seed_dir_changed_since_the_marker_still_pulls_the_published_bytes(bucket_run):
    from core_support import write_hf_checkpoint

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(2, local)
    # The same model written again (new inodes): its fingerprint moves, so the local state no
    # longer counts and the pull seeds, past what a plan on the old marker fetched.
    write_hf_checkpoint(bucket_run.seed, bucket_run.tensors[0])
    result = bucket_run.assert_pulls(3, local)
    assert result.action in ("seed", "seed+chain")


def test_the_command_line_pulls_from_a_bucket_and_inspects_it(bucket_run, capsys):
    from weightsync.cli import main

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    local = bucket_run.fresh_local()
    rc = main(["pull", local, "--seed-dir", bucket_run.seed, "--source-dir", bucket_run.url, "--version", "2", "--json"])
    assert rc == 0, capsys.readouterr()
    from core_support import assert_checkpoint_is

    assert_checkpoint_is(local, bucket_run.expected[2])
    capsys.readouterr()
    assert main(["inspect", bucket_run.url, "--json"]) == 0
    assert [s["version"] for s in json.loads(capsys.readouterr().out)] == [1, 2]


def test_two_publishers_racing_for_one_version_exactly_one_commits_and_its_bytes_are_served(bucket_run, monkeypatch, fast_tmp_path):
    import threading

    from core_support import assert_checkpoint_is, mutate, tensor_bytes
    from weightsync.storage import source as source_mod

    a = bucket_run.publisher()
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging-b"))
    b = bucket_run.publisher()
    tensors = {"a": mutate(bucket_run.tensors[0], bucket_run.rng, 0.3), "b": mutate(bucket_run.tensors[0], bucket_run.rng, 0.3)}
    create, gate = source_mod.BucketSource.create, threading.Barrier(2)

    def create_together(self, key, data):
        if key == f"weight_v000001/{INDEX}":
            try:
                gate.wait(10)  # both have uploaded their shards: the two index creates race
            except threading.BrokenBarrierError:
                pass  # the other one was fenced earlier, by the bucket's writer lease
        return create(self, key, data)

    monkeypatch.setattr(source_mod.BucketSource, "create", create_together)
    outcome: dict = {}

    def run(name, pub):
        try:
            pub.publish(1, tensors[name], full=True)
            outcome[name] = "committed"
        except (errors.BucketConflictError, errors.SupersededPublisherError) as e:
            outcome[name] = e  # lost the index create, or the writer lease (the later publisher took it)

    threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [n for n, o in outcome.items() if o == "committed"]
    assert len(winners) == 1 and len(outcome) == 2, outcome
    local = bucket_run.fresh_local()
    from weightsync import pull

    pull(local, bucket_run.seed, bucket_run.url, 1)
    assert_checkpoint_is(local, tensor_bytes(tensors[winners[0]]))


def test_a_restarted_publisher_with_its_staging_copy_goes_on_where_it_stopped(bucket_run):
    from weightsync import Publisher
    from weightsync.publisher.snapshot import as_raw

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    pub.close()
    again = Publisher(bucket_run.url, template_dir=bucket_run.seed, encoding="sparse-v1", workers=1)
    again.seed_snapshot({n: as_raw(a) for n, a in bucket_run.tensors[2].items()}, version=2)
    assert again.run_id == pub.run_id
    bucket_run.publish_versions(again, 1)
    bucket_run.assert_pulls(3)


def test_an_index_in_the_bucket_naming_a_shard_outside_its_version_is_refused_before_any_write(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    src = BucketSource(bucket_run.url)
    key = f"weight_v000002/{INDEX}"
    index = json.loads(src.read(f"weight_v000001/{INDEX}"))
    index["weight_map"] = {n: "../../../../../escaped.safetensors" for n in index["weight_map"]}
    assert src.create(key, json.dumps(index).encode())
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    with pytest.raises(errors.WeightSyncError) as e:
        bucket_run.assert_pulls(2, local)
    assert isinstance(e.value, errors.UnsafeNameError)
    assert not any("escaped" in f for _, _, files in os.walk(bucket_run.root) for f in files)
    bucket_run.assert_pulls(1, local)  # still the verified v1


def test_a_shard_replaced_in_the_bucket_after_its_commit_is_a_corrupt_artifact_never_a_success(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    src = BucketSource(bucket_run.url)
    shard = next(k for k in src.list("weight_v000002/") if k.endswith(".safetensors"))
    data = bytearray(src.read(shard))
    data[-3] ^= 0xFF  # a payload byte: the header still parses
    obstore.put(src.store, shard, bytes(data))
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    with pytest.raises(errors.CorruptArtifactError):
        from weightsync import pull

        pull(local, bucket_run.seed, bucket_run.url, 2)


def test_the_pre_read_hook_gets_the_url_and_runs_only_when_there_is_work(bucket_run):
    from weightsync import pull

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    calls = []
    local = bucket_run.fresh_local()
    r = pull(local, bucket_run.seed, bucket_run.url, 2, lambda src, v: calls.append((src, v)))
    assert r.hook_ran and calls == [(bucket_run.url, 2)]
    r = pull(local, bucket_run.seed, bucket_run.url, 2, lambda src, v: calls.append((src, v)))
    assert r.action == "noop" and not r.hook_ran and len(calls) == 1


@pytest.mark.parametrize("kinds", [("full", "delta"), ("full", "full")])
def test_two_ranks_sharing_a_staging_dir_publish_one_version_that_rank_0_uploads_and_commits(bucket_run, kinds):
    from weightsync import Publisher, pull

    from core_support import assert_checkpoint_is

    owners = {n: i % 2 for i, n in enumerate(sorted(bucket_run.tensors[0]))}
    pubs = []
    for r in (0, 1):  # one staging dir for both (WEIGHTSYNC_BUCKET_STAGING_DIR, as on one node)
        pub = Publisher(bucket_run.url, encoding="xor", rank=r, world_size=2, workers=1, template_dir=bucket_run.seed)
        pub.seed_snapshot({n: a for n, a in bucket_run.tensors[0].items() if owners[n] == r})
        pubs.append(pub)
    assert pubs[0].run_id == pubs[1].run_id
    for v, kind in enumerate(kinds, start=1):
        new = bucket_run.next_tensors()
        prepared = [pub.prepare(v, {n: a for n, a in new.items() if owners[n] == r}) for r, pub in enumerate(pubs)]
        manifests = [pub.write(p, kind) for pub, p in zip(pubs, prepared)]
        pubs[0].commit(v, kind, manifests)
        pubs[1].confirm(v)
        local = bucket_run.fresh_local()
        assert pull(local, bucket_run.seed, bucket_run.url, v).applied_version == v
        assert_checkpoint_is(local, bucket_run.expected[v])
    index = json.loads(BucketSource(bucket_run.url).read(f"weight_v000002/{INDEX}"))
    assert {f.split("-")[1] for f in index["weight_map"].values()} == {"r00000", "r00001"}


def test_after_a_deferred_pull_the_spool_is_emptied_once_the_flush_lets_go_of_the_lock(bucket_run):
    import time

    from weightsync import pull
    from weightsync.puller.pull import wait_until_durable

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    local = bucket_run.fresh_local()
    r = pull(local, bucket_run.seed, bucket_run.url, 2, durability="deferred")
    assert r.applied_version == 2
    assert wait_until_durable(local, 60)
    root = mirror_dir(local, parse_bucket_url(bucket_run.url))
    shards = [os.path.join(root, d, f) for d in ("weight_v000001", "weight_v000002")
              for f in os.listdir(os.path.join(root, d)) if f.endswith(".safetensors")]
    deadline = time.monotonic() + 30
    while not all(is_placeholder(p) for p in shards) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shards and all(is_placeholder(p) for p in shards)


def test_a_version_of_many_shards_uploads_them_in_parallel_and_pulls_to_the_published_bytes(bucket_run, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_FULL_SHARD_NBYTES", "4096")  # several shards per version
    monkeypatch.setenv("WEIGHTSYNC_DELTA_SHARD_NBYTES", "512")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_OBJECTS_IN_FLIGHT", "3")
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    assert sum(k.startswith("weight_v000001/") and k.endswith(".safetensors") for k in keys(bucket_run.url)) > 2
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    bucket_run.assert_pulls(3, local)


def test_a_seed_from_a_full_version_in_the_bucket_writes_each_shard_once_into_the_local_checkpoint(bucket_run, monkeypatch):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    from weightsync.puller import seed

    copied = []
    real_copy = seed.copy_file
    monkeypatch.setattr(seed, "copy_file", lambda src, dst, *a: copied.append(os.path.basename(dst)) or real_copy(src, dst, *a))
    local = bucket_run.fresh_local()
    r = bucket_run.assert_pulls(1, local)
    assert r.action == "seed" or r.seed_nbytes
    # the fetched shards became the local files (moved, not copied a second time); side files copy
    assert copied and not [n for n in copied if n.endswith(".safetensors")], copied
    root = mirror_dir(local, parse_bucket_url(bucket_run.url))
    shards = [f for f in os.listdir(os.path.join(root, "weight_v000001")) if f.endswith(".safetensors")]
    assert shards and all(is_placeholder(os.path.join(root, "weight_v000001", f)) for f in shards)
    bucket_run.assert_pulls(2, local)  # the chain goes on from the handed-over files


def test_a_seed_whose_handed_over_copy_is_damaged_reseeds_through_the_full_fetch_bit_exact(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    shard = next(f for f in os.listdir(local) if f.endswith(".safetensors"))
    with open(os.path.join(local, shard), "r+b") as f:  # the local copy damaged after the pull
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    bucket_run.assert_pulls(2, local)


def test_a_publisher_on_another_host_takes_the_bucket_lease_and_the_older_one_stops_before_writing(bucket_run, monkeypatch, fast_tmp_path):
    from weightsync.publisher.snapshot import as_raw

    a = bucket_run.publisher()
    bucket_run.publish_versions(a, 1, full_at={1})
    # a restarted trainer on another host: its own staging copy (restored from a's, as of v1),
    # and a's lease file is in a's staging dir only
    import shutil

    other = fast_tmp_path / "staging-other-host"
    shutil.copytree(a.source_dir, other / os.path.basename(a.source_dir))
    os.unlink(other / os.path.basename(a.source_dir) / "weightsync-writer.json")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(other))
    b = bucket_run.publisher()
    b.seed_snapshot({n: as_raw(t) for n, t in bucket_run.tensors[1].items()}, version=1)
    bucket_run.publish_versions(b, 1)
    lease = json.loads(BucketSource(bucket_run.url).read("weightsync-writer.json"))
    assert lease["token"] == b.guard.lease.token
    before = keys(bucket_run.url)
    # a's staging copy knows nothing of v2: only the bucket's lease can stop it
    with pytest.raises(errors.SupersededPublisherError):
        a.publish(2, bucket_run.next_tensors(0.3))
    bucket_run.tensors.pop(), bucket_run.expected.pop()
    assert keys(bucket_run.url) == before  # nothing of a's v2 reached the bucket
    bucket_run.assert_pulls(2)


def test_the_seed_record_reaches_the_bucket_before_v1_and_a_new_hosts_staging_copy_gets_it(bucket_run, monkeypatch, fast_tmp_path):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1)  # v1 a delta: the run file records the seed's digests first
    run = json.loads(BucketSource(bucket_run.url).read("weightsync-run.json"))
    assert run["run_id"] == pub.run_id and set(run["seed"]["digests"]) == set(bucket_run.tensors[0])
    with open(os.path.join(pub.source_dir, "weightsync-run.json"), "rb") as f:
        assert json.loads(f.read()) == run
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging-new-host"))
    other = bucket_run.publisher()
    from weightsync.format.seed_record import read_seed_record

    assert read_seed_record(other.source_dir) is not None and other.source_dir != pub.source_dir
    bucket_run.assert_pulls(1)


def test_a_pull_from_a_bucket_fingerprints_the_seed_dir_once(bucket_run, monkeypatch):
    # On tmpfs the fingerprint reads every byte of the seed: neither the fetch's planning (no
    # marker yet) nor the refresh hook computes it again.
    from weightsync.puller import identity

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    calls = []
    real = identity._fingerprint
    monkeypatch.setattr(identity, "_fingerprint", lambda d: calls.append(d) or real(d))
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    assert len(calls) == 1, calls
    calls.clear()
    bucket_run.assert_pulls(2, local)
    assert len(calls) == 1, calls


def test_the_run_file_gaining_its_seed_record_keeps_the_mirror_but_a_new_run_clears_it(bucket_run, caplog):
    import logging

    pub = bucket_run.publisher()
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(0, local)  # the mirror keeps the run file as created, without a seed record
    bucket_run.publish_versions(pub, 1)  # v1 a delta: the seed record is added to the bucket's run file
    with caplog.at_level(logging.INFO, logger="weightsync.storage.mirror"):
        bucket_run.assert_pulls(1, local)
    assert "clearing the mirror" not in caplog.text
    BucketSource(bucket_run.url).delete(["weightsync-run.json"])
    BucketSource(bucket_run.url).create("weightsync-run.json", b'{"run_id": "another", "created_unix_s": 1}')
    caplog.clear()
    from weightsync import pull

    with caplog.at_level(logging.INFO, logger="weightsync.storage.mirror"):
        try:
            pull(local, bucket_run.seed, bucket_run.url, 1)
        except errors.WeightSyncError:
            pass  # whatever the pull makes of the new run, the mirror of the old one is gone
    assert "clearing the mirror" in caplog.text


def test_a_publisher_on_a_new_host_continues_the_run_from_the_bucket_and_fences_the_first(bucket_run, monkeypatch, fast_tmp_path):
    from weightsync import Publisher
    from weightsync.publisher.snapshot import as_raw

    first = bucket_run.publisher()
    bucket_run.publish_versions(first, 3, full_at={1})
    # Another host: an empty staging copy. It is filled from the bucket, so the run goes on at v4.
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging-host-b"))
    second = Publisher(bucket_run.url, template_dir=bucket_run.seed, encoding="sparse-v1", workers=1)
    second.seed_snapshot({n: as_raw(a) for n, a in bucket_run.tensors[3].items()}, version=3)
    result = second.publish(4, bucket_run.next_tensors())
    assert result.version == 4 and result.kind == "delta"
    second.close()
    for v in (3, 4):
        bucket_run.assert_pulls(v)
    with pytest.raises(errors.WeightSyncError):
        first.publish(5, bucket_run.next_tensors())
    assert "weight_v000005/" + INDEX not in keys(bucket_run.url)
    first.close()


def test_an_error_from_a_bucket_pull_names_the_bucket_url_not_the_host_local_mirror(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    src = BucketSource(bucket_run.url)
    src.delete([f"weight_v000002/{INDEX}"])
    src.create(f"weight_v000002/{INDEX}", b'{"metadata": "v2", "weight_map": {}}')  # complete, malformed
    from weightsync import pull

    with pytest.raises(errors.MalformedHeaderError, match="metadata must be an object") as ei:
        pull(local, bucket_run.seed, bucket_run.url, 2)
    # The type and its data stay; every path in it is the bucket's.
    assert ei.value.path == f"{bucket_run.url}/weight_v000002/{INDEX}"
    assert str(ei.value).startswith(f"{bucket_run.url}/weight_v000002/{INDEX}: malformed file")
    assert ".weight_sync" not in str(ei.value) and ".weight_sync" not in ei.value.path
    bucket_run.assert_pulls(1, local)  # a load-time refusal: nothing local changed


def test_a_bucket_index_over_the_index_limit_is_refused_unread_as_the_directory_refuses_it(bucket_run, monkeypatch):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    src = BucketSource(bucket_run.url)
    key = f"weight_v000002/{INDEX}"
    raw = src.read(key)
    padded = raw + b" " * (4 * len(raw))  # still a valid index, five times its size
    src.delete([key])
    src.create(key, padded)
    limit = 2 * len(raw)
    assert len(src.read(f"weight_v000001/{INDEX}")) < limit < len(padded)
    monkeypatch.setenv("WEIGHTSYNC_MAX_INDEX_NBYTES", str(limit))
    reads = []
    real_read = BucketSource.read
    monkeypatch.setattr(BucketSource, "read", lambda self, k: reads.append(k) or real_read(self, k))
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    from weightsync import pull

    with pytest.raises(errors.MalformedHeaderError, match=rf"index is {len(padded)} bytes, over the {limit}-byte limit") as ei:
        pull(local, bucket_run.seed, bucket_run.url, 2)
    assert ei.value.path == f"{bucket_run.url}/{key}"
    assert key not in reads  # judged by its listed size: never downloaded
    bucket_run.assert_pulls(1, local)
    monkeypatch.setenv("WEIGHTSYNC_MAX_INDEX_NBYTES", str(2 * len(padded)))
    bucket_run.assert_pulls(2, local)  # a raised limit: the next pull reads it


def test_an_indexless_full_version_in_a_bucket_pulls_as_it_does_from_a_directory(bucket_run):
    from safetensors.numpy import save_file

    from weightsync import pull

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    single = os.path.join(bucket_run.root, "single.safetensors")
    save_file(bucket_run.next_tensors(), single)  # v2: one complete model.safetensors, no index
    src = BucketSource(bucket_run.url)
    src.put_file("weight_v000002/model.safetensors", single)
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    result = bucket_run.assert_pulls(2, local)
    assert result.action == "seed"
    assert not os.path.exists(os.path.join(mirror_dir(local, parse_bucket_url(bucket_run.url)), "weight_v000002", INDEX))
    # The mirror keeps its copy whole (the next pull's planner reads its header), never a placeholder.
    kept = os.path.join(mirror_dir(local, parse_bucket_url(bucket_run.url)), "weight_v000002", "model.safetensors")
    assert not is_placeholder(kept) and os.path.getsize(kept) == os.path.getsize(single)
    # A version prefix with nothing under it is still "not published" and leaves no trace.
    fresh = bucket_run.fresh_local()
    with pytest.raises(errors.VersionMissingError, match=rf"{bucket_run.url}/weight_v000003/"):
        pull(fresh, bucket_run.seed, bucket_run.url, 3)
    assert not os.path.exists(fresh)


def test_a_refused_publish_to_a_bucket_names_the_bucket_url_not_the_staging_copy(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    staging = pub.destination.dir
    with pytest.raises(errors.VersionNumberError) as e:
        pub.publish(5, bucket_run.next_tensors())
    text = str(e.value)
    assert bucket_run.url in text and staging not in text and "publish 2 next" in text
    pub.close()


def test_a_publisher_with_wrong_credentials_is_refused_at_its_first_write_naming_that_write(bucket_run, monkeypatch):
    import obstore

    obstore.put(BucketSource(bucket_run.url + "-other").store, "x", b"x")  # the bucket exists (weed makes it lazily)
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(errors.BucketCredentialsError) as e:
        bucket_run.publisher()
    # The refused write itself (the start-up probe's create), not a clean-up after it.
    assert e.value.operation.startswith("PUT") and "SignatureDoesNotMatch" in str(e.value), str(e.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert BucketSource(bucket_run.url).list() == {}  # nothing was written
