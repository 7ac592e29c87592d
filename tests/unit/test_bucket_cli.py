"""Every CLI command takes a bucket URL where it takes a source dir: the real ``weightsync``
command, run as a process, against a real S3 server on loopback (SeaweedFS ``weed mini``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core_support import assert_checkpoint_is
from weightsync import Publisher
from weightsync.publisher.prune import prune_source
from weightsync.storage.source import BucketSource

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"
WEIGHTSYNC = os.path.join(os.path.dirname(sys.executable), "weightsync")


def weightsync(*argv: str) -> tuple[int, dict, str]:
    """The installed command, in a process of its own (the environment carries the credentials)."""
    cmd = [WEIGHTSYNC] if os.path.exists(WEIGHTSYNC) else [sys.executable, "-m", "weightsync.cli"]
    p = subprocess.run(cmd + ["--json", *argv], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else {}
    except ValueError:
        out = {"raw": p.stdout}
    return p.returncode, out, p.stderr


def dirs_in(url: str) -> set[str]:
    return {k.split("/")[0] for k in BucketSource(url).list() if "/" in k}


def publish_both(run, directory: str, n: int) -> None:
    """The same versions to the bucket and to a directory, by publishers that never prune, with
    side anchors every two deltas: what retention judges the same on both."""
    kw = dict(encoding="sparse-v1", workers=1, anchor_max_deltas=2, prune=False, template_dir=run.seed)
    pubs = [Publisher(run.url, **kw), Publisher(directory, **kw)]
    for p in pubs:
        p.seed_snapshot(run.tensors[0])
    for _ in range(n):
        v = len(run.tensors)
        t = run.next_tensors()
        for p in pubs:
            p.publish(v, t, full=True if v == 1 else None)
    for p in pubs:
        p.close()


def test_inspect_on_a_bucket_url_gives_the_versions_table_of_the_bucket(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    rc, out, err = weightsync("inspect", bucket_run.url)
    assert rc == 0, err
    assert [(s["version"], s["kind"], s["status"]) for s in out] == [(1, "full", "published"), (2, "delta", "published"),
                                                                      (3, "delta", "published")]
    listing = BucketSource(bucket_run.url).list()
    for s in out:
        index = json.loads(BucketSource(bucket_run.url).read(f"weight_v{s['version']:06d}/{INDEX}"))
        assert s["tensors"] == len(index["weight_map"])
        # the stored bytes are the bucket's objects' sizes (no shard fetched for the table)
        assert s["wire_nbytes"] == sum(listing[f"weight_v{s['version']:06d}/{f}"].size for f in set(index["weight_map"].values()))


def test_inspect_of_one_bucket_version_lists_its_tensors_from_the_shard_headers_and_measures_density(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    rc, out, err = weightsync("inspect", bucket_run.url, "--version", "2", "--tensors")
    assert rc == 0, err
    index = json.loads(BucketSource(bucket_run.url).read(f"weight_v000002/{INDEX}"))
    assert {t["name"]: t["shard"] for t in out["tensor_details"]} == index["weight_map"]
    assert all(t["payload_nbytes"] > 0 for t in out["tensor_details"])
    rc, out, err = weightsync("inspect", bucket_run.url, "--version", "2", "--density", "--seed-dir", bucket_run.seed)
    assert rc == 0, err
    t1, t2 = bucket_run.tensors[1], bucket_run.tensors[2]
    changed = sum(int((t2[n].view(f"u{t2[n].itemsize}") != t1[n].view(f"u{t1[n].itemsize}")).sum()) for n in t2)
    assert out["changed_elements"] == changed  # the payloads were read: exactly the changed elements


def test_inspect_of_a_version_not_in_the_bucket_is_not_ready_and_names_the_url(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    rc, out, _ = weightsync("inspect", bucket_run.url, "--version", "5")
    assert rc == 3 and out["success"] is False
    assert f"{bucket_run.url}/weight_v000005" in out["message"] and "weightsync-view" not in out["message"]


def test_verify_against_a_bucket_passes_a_pulled_checkpoint_and_names_a_damaged_tensor(bucket_run):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 3, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(3, local)
    args = ("verify", local, "--source-dir", bucket_run.url, "--version", "3", "--seed-dir", bucket_run.seed)
    rc, out, err = weightsync(*args)
    assert rc == 0, (out, err)
    assert out["checked"] == len(bucket_run.tensors[3]) and out["mismatched"] == []
    # one byte of one tensor's payload changed locally: verify names it (exit 1)
    from weightsync.format.manifest import checkpoint_weight_files
    from weightsync.format.safetensors_io import local_tensor_table

    table = local_tensor_table(local, checkpoint_weight_files(local))
    path, entry = table["layers.0.w"]
    with open(path, "r+b") as f:
        f.seek(entry.offset + 3)
        b = f.read(1)
        f.seek(entry.offset + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, out, err = weightsync(*args)
    assert rc == 1, err
    assert [m[0] for m in out["mismatched"]] == ["layers.0.w"]


def test_prune_on_a_bucket_deletes_what_the_publishers_retention_deletes_on_a_directory(bucket_run, fast_tmp_path):
    directory = str(fast_tmp_path / "dir-source")
    publish_both(bucket_run, directory, 7)
    before = dirs_in(bucket_run.url)
    want = prune_source(directory, keep=2, dry_run=True).pruned
    assert want  # the sequence leaves something to prune
    rc, out, err = weightsync("prune", bucket_run.url, "--keep", "2", "--dry-run")
    assert rc == 0, err
    assert out["pruned"] == want and out["dry_run"] is True
    assert dirs_in(bucket_run.url) == before  # a dry run deletes nothing
    rc, out, err = weightsync("prune", bucket_run.url, "--keep", "2")
    assert rc == 0, err
    assert out["pruned"] == want
    prune_source(directory, keep=2)
    # the same dirs stay (versions, and side anchors bound to kept versions)
    assert dirs_in(bucket_run.url) == {d for d in os.listdir(directory) if d.startswith(("weight_v", "anchor_v"))}
    for v in range(max(want) + 1, len(bucket_run.tensors)):
        bucket_run.assert_pulls(v)  # what is kept pulls from a fresh host


def test_prune_on_a_bucket_deletes_each_index_before_the_rest_of_its_dir(bucket_run, fast_tmp_path, monkeypatch):
    from weightsync.publisher.prune import prune_bucket

    directory = str(fast_tmp_path / "dir-source")
    publish_both(bucket_run, directory, 5)
    deleted: list[list[str]] = []
    real = BucketSource.delete

    def recording(self, keys):
        keys = list(keys)
        deleted.append(keys)
        return real(self, keys)

    monkeypatch.setattr(BucketSource, "delete", recording)
    report = prune_bucket(bucket_run.url, keep=1)
    assert report.pruned
    seen_index: set[str] = set()
    for batch in deleted:
        for k in batch:
            d = k.split("/")[0]
            if k.endswith(INDEX):
                assert len(batch) == 1  # an index alone, before its dir's other keys
                seen_index.add(d)
            else:
                assert d in seen_index, f"{k} deleted before its dir's index"


def test_prune_on_a_bucket_keeps_a_version_whose_index_is_unreadable_and_says_so(bucket_run, fast_tmp_path):
    import obstore

    directory = str(fast_tmp_path / "dir-source")
    publish_both(bucket_run, directory, 7)
    src = BucketSource(bucket_run.url)
    want = prune_source(directory, keep=2, dry_run=True).pruned
    victim = want[-1]
    obstore.put(src.store, f"weight_v{victim:06d}/{INDEX}", b"{not json")
    rc, out, err = weightsync("prune", bucket_run.url, "--keep", "2")
    assert rc == 0, err
    assert victim not in out["pruned"] and str(victim) in out["unreadable"]
    assert bucket_run.url in out["unreadable"][str(victim)]  # the bucket's key, not the view's temp path
    assert f"weight_v{victim:06d}" in dirs_in(bucket_run.url)


def test_a_bucket_url_in_every_command_is_parsed_strictly(s3_env):
    rc, out, _ = weightsync("inspect", "s3://Bad_Bucket/x?endpoint=http://evil")
    assert rc == 2 and out["error_type"] != "internal"


def test_an_empty_bucket_prefix_reads_as_an_empty_source_dir(s3_env, fast_tmp_path):
    empty = fast_tmp_path / "empty-source"
    empty.mkdir()
    for argv in (["inspect"], ["prune", "--keep", "1"]):
        on_dir = weightsync(argv[0], str(empty), *argv[1:])
        on_bucket = weightsync(argv[0], s3_env.url("runs/nothing-here"), *argv[1:])
        assert on_bucket[:2] == on_dir[:2]
