"""Bounded catch-up with side anchors, a planner that prices plans by bytes, bounded and cheap
pruning, and publish work per version (only changed tensors hashed, a known-full version not
encoded). Every pull is compared with the publisher's bytes through the safetensors package."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import weightsync.publisher.encode as encode_mod
import weightsync.format.manifest as manifest_mod
import weightsync.publisher.prune as prune_mod
from weightsync import Publisher, plan_pull, pull
from weightsync.codecs import get_codec
from weightsync.format.layout import list_anchors, list_versions

from core_support import assert_checkpoint_is, mutate, random_tensors, shard_path, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {"embed": ("float32", (64, 32)), "w1": ("float32", (32, 64)), "w2": ("float32", (32, 64)), "norm": ("float32", (64,))}


class Run:
    def __init__(self, root: str, rng, **kw):
        self.root, self.rng = root, rng
        self.seed, self.source = os.path.join(root, "seed"), os.path.join(root, "src")
        self.t = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.t[0])
        self.pub = Publisher(self.source, workers=1, **kw)
        self.pub.seed_snapshot(self.t[0])
        self.results = {}
        self.n_locals = 0

    def publish(self, n: int, density: float = 0.02):
        for _ in range(n):
            v = len(self.t)
            self.t.append(mutate(self.t[-1], self.rng, density))
            self.results[v] = self.pub.publish(v, self.t[v])

    @property
    def latest(self) -> int:
        return len(self.t) - 1

    def local(self) -> str:
        self.n_locals += 1
        return os.path.join(self.root, f"local{self.n_locals}")

    def checkpoint_nbytes(self) -> int:
        return os.path.getsize(os.path.join(self.seed, "model.safetensors"))

    def shard_nbytes(self, v: int) -> int:
        vdir = os.path.join(self.source, f"weight_v{v:06d}")
        with open(os.path.join(vdir, INDEX)) as f:
            files = set(json.load(f)["weight_map"].values())
        return sum(os.path.getsize(os.path.join(vdir, n)) for n in files)


@pytest.fixture
def run(fast_tmp_path, rng):
    r = Run(str(fast_tmp_path), rng)
    yield r
    r.pub.close()


def test_fresh_host_joining_late_reads_at_most_twice_the_checkpoint(run):
    run.publish(60)
    anchors = list_anchors(run.source)
    assert anchors, "the default settings write side anchors"
    for target in sorted({run.latest, run.latest - 3, anchors[-1], min(anchors[-1] + 1, run.latest)}):
        local = run.local()
        result = pull(local, run.seed, run.source, target)
        assert result.source_nbytes <= 2 * run.checkpoint_nbytes(), (target, result.reason)
        assert_checkpoint_is(local, tensor_bytes(run.t[target]))


def test_engine_one_version_behind_reads_only_the_delta_even_when_the_target_has_an_anchor(run):
    run.publish(60)
    a = list_anchors(run.source)[-1]
    local = run.local()
    pull(local, run.seed, run.source, a - 1)
    result = pull(local, run.seed, run.source, a)
    assert result.action == "chain" and result.deltas_applied == 1, result.reason
    assert result.source_nbytes == run.shard_nbytes(a)
    assert_checkpoint_is(local, tensor_bytes(run.t[a]))


def test_anchor_version_stays_a_delta_in_the_chain_for_upstream_readers(run):
    run.publish(60)
    for a in list_anchors(run.source):
        with open(os.path.join(run.source, f"weight_v{a:06d}", INDEX)) as f:
            meta = json.load(f)["metadata"]
        assert meta["delta_encoding"] == "sparse-v1" and meta["base_version"] == f"{a - 1:06d}"
        with open(os.path.join(run.source, f"anchor_v{a:06d}", INDEX)) as f:
            anchor_meta = json.load(f)["metadata"]
        assert anchor_meta["version"] == f"{a:06d}" and isinstance(anchor_meta["total_size"], int)
        assert run.results[a].kind == "delta" and "side anchor" in run.results[a].reason


def test_planner_takes_whichever_of_chain_and_anchor_reads_fewer_bytes(run):
    run.publish(60)
    while run.latest < list_anchors(run.source)[-1] + 3:
        run.publish(1)
    a = list_anchors(run.source)[-1]
    behind = run.local()
    pull(behind, run.seed, run.source, a - 2)  # a few versions behind the anchor: the chain is cheaper
    plan, _ = plan_pull(behind, run.seed, run.source, run.latest)
    chain_nbytes = sum(run.shard_nbytes(v) for v in range(a - 1, run.latest + 1))
    assert plan.action == "chain" and plan.read_nbytes == chain_nbytes, plan.reason
    fresh = run.local()  # nothing local: the anchor and the tail, not the chain from v0
    plan, _ = plan_pull(fresh, run.seed, run.source, run.latest)
    assert plan.seed is not None and plan.seed.kind == "anchor" and plan.seed.version == a, plan.reason
    for local in (behind, fresh):
        pull(local, run.seed, run.source, run.latest)
        assert_checkpoint_is(local, tensor_bytes(run.t[run.latest]))


@pytest.mark.parametrize("damage", ["no index", "index cut short", "shard missing"])
def test_incomplete_anchor_is_passed_over_for_the_chain(run, damage):
    run.publish(60)
    a = list_anchors(run.source)[-1]
    adir = os.path.join(run.source, f"anchor_v{a:06d}")
    if damage == "no index":
        os.unlink(os.path.join(adir, INDEX))
    elif damage == "index cut short":
        os.truncate(os.path.join(adir, INDEX), 10)
    else:
        os.unlink(shard_path(adir))
    local = run.local()
    result = pull(local, run.seed, run.source, run.latest)
    assert f"anchor_v{a:06d}" not in result.reason
    assert_checkpoint_is(local, tensor_bytes(run.t[run.latest]))


def test_default_pruning_bounds_the_source_dir_and_leaves_every_cheap_plan_intact(run):
    host = run.local()
    for _ in range(12):
        run.publish(10)
        pull(host, run.seed, run.source, run.latest)  # an engine keeping up, one pull per 10 versions
    versions, anchors = list_versions(run.source), list_anchors(run.source)
    assert versions[0] > 1 and len(anchors) <= 3, (versions, anchors)
    assert len(versions) <= 2 * 64 + 8
    assert_checkpoint_is(host, tensor_bytes(run.t[run.latest]))
    late = run.local()
    assert pull(late, run.seed, run.source, run.latest).source_nbytes <= 2 * run.checkpoint_nbytes()
    assert_checkpoint_is(late, tensor_bytes(run.t[run.latest]))


def test_commits_read_no_index_once_the_publisher_knows_the_source_dir(run, monkeypatch):
    run.publish(3)  # the first commit scanned the (empty) source dir
    reads = []
    real = manifest_mod.read_version_index
    monkeypatch.setattr(prune_mod, "read_version_index", lambda *a: reads.append(a) or real(*a))
    monkeypatch.setattr(prune_mod, "list_versions", lambda *a: reads.append(a) or [])
    run.publish(80)
    assert reads == [] and len(list_anchors(run.source)) >= 2 and list_versions(run.source)[0] > 1


def test_restarted_publisher_scans_once_and_goes_on_with_the_anchor_budget(fast_tmp_path, rng):
    root = str(fast_tmp_path)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    t = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, t[0])
    for v in range(1, 61):  # the trainer relaunched before every version
        t.append(mutate(t[-1], rng, 0.02))
        pub = Publisher(source, workers=1)
        pub.seed_snapshot(t[v - 1], version=v - 1)
        pub.publish(v, t[v])
        pub.close()
    anchors = list_anchors(source)
    assert len(anchors) >= 2
    local = os.path.join(root, "local")
    result = pull(local, seed, source, 60)
    assert result.source_nbytes <= 2 * os.path.getsize(os.path.join(seed, "model.safetensors"))
    assert_checkpoint_is(local, tensor_bytes(t[60]))


# --- publish work per version (point 14) -------------------------------------------------------


def test_only_changed_tensors_are_hashed(run, monkeypatch):
    hashed = []
    real = encode_mod.new_hasher

    class Counting:
        def __init__(self, name):
            self.h = real(name)

        def update(self, data):
            hashed.append(memoryview(data).nbytes)
            return self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(encode_mod, "new_hasher", Counting)
    v = run.latest + 1
    run.t.append(mutate(run.t[-1], run.rng, 0.05, names=["norm"]))
    run.pub.publish(v, run.t[v])  # every tensor passed, one changed
    assert hashed == [run.t[v]["norm"].nbytes]
    local = run.local()
    pull(local, run.seed, run.source, v)
    assert_checkpoint_is(local, tensor_bytes(run.t[v]))


def test_version_known_to_be_full_is_not_encoded(fast_tmp_path, rng, monkeypatch):
    root = str(fast_tmp_path)
    run = Run(root, rng, full_every=2)
    codec = get_codec("sparse-v1")
    encoded = []
    real_encode = codec.encode
    monkeypatch.setattr(codec, "encode", lambda *a: encoded.append(a[-1]) or real_encode(*a))
    run.publish(1)
    assert sorted(encoded) == sorted(SIZES)  # v1: a delta, every tensor encoded
    encoded.clear()
    run.publish(1)  # v2: full by schedule
    assert encoded == [] and run.results[2].kind == "full"
    run.t.append(mutate(run.t[-1], rng, 0.5))
    encoded.clear()
    run.pub.publish(3, run.t[3], full=True)  # full on request
    assert encoded == []
    run.publish(1)  # v4 is a delta again, diffing against v3's bytes
    for v in (2, 3, 4):
        local = run.local()
        pull(local, run.seed, run.source, v)
        assert_checkpoint_is(local, tensor_bytes(run.t[v]))
    run.pub.close()


def test_every_version_pruning_keeps_stays_pullable_by_a_fresh_host(fast_tmp_path, rng):
    """keep=2 after a full v3, a delta v4 and a full v5: v4 is kept, so its base v3 must stay
    (deleting it left v4 on disk yet unservable to a host that joins)."""
    sizes = {"embed": ("float32", (48, 16)), "norm": ("float32", (16,))}
    seed, src = str(fast_tmp_path / "seed"), str(fast_tmp_path / "src")
    tensors = [random_tensors(rng, sizes)]
    write_hf_checkpoint(seed, tensors[0])
    pub = Publisher(src, encoding="xor", workers=1, keep_versions=2, prune=True)
    pub.seed_snapshot(tensors[0], version=0)
    for v, full in ((1, False), (2, False), (3, True), (4, False), (5, True)):
        tensors.append(mutate(tensors[-1], rng, 0.05))
        assert pub.publish(v, tensors[-1], full=full).kind == ("full" if full else "delta")
    pub.close()
    kept = list_versions(src)
    assert 4 in kept and 5 in kept
    for v in kept:
        local = str(fast_tmp_path / f"fresh{v}")
        pull(local, seed, src, v)
        assert_checkpoint_is(local, tensor_bytes(tensors[v]))
    assert kept == [3, 4, 5], "v1 and v2 are below every kept version's anchor point and must go"


def _two_ranks_publish(source: str, t: list, owners: dict, versions: range, **kw) -> None:
    """Ranks 0 and 1 publish ``versions`` as deltas into one shared dir (the protocol of
    ``Publisher``: prepare, choose_kind on the totals, write, commit on rank 0, confirm)."""
    pubs = [Publisher(source, rank=r, world_size=2, workers=1, **kw) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot({n: a for n, a in t[versions[0] - 1].items() if owners[n] == r}, version=versions[0] - 1)
    for v in versions:
        prepared = [pub.prepare(v, {n: a for n, a in t[v].items() if owners[n] == r}) for r, pub in enumerate(pubs)]
        for pub in pubs:
            pub.choose_kind(v, 0, 1, requested="delta")
        manifests = [pub.write(p, "delta") for pub, p in zip(pubs, prepared)]
        pubs[0].commit(v, "delta", manifests)
        pubs[1].confirm(v)
    for pub in pubs:
        pub.close()


def test_a_restarted_rank_whose_copy_lacks_the_other_ranks_shards_takes_the_same_anchor_decision(fast_tmp_path, rng):
    """With a staging copy per node (WEIGHTSYNC_BUCKET_RANK_REPORTS=1) a rank's copy holds every
    index but only its own shards. A restarted publisher sizes the deltas since the last anchor
    point from the indexes' file_digests, so each rank's copy gives the same budget, and the
    ranks agree on whether the next version gets a side anchor (sized from disk, rank 1 saw
    about half the bytes and would have said no)."""
    root = str(fast_tmp_path)
    seed, complete = os.path.join(root, "seed"), os.path.join(root, "node0")
    t = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, t[0])
    for _ in range(3):
        t.append(mutate(t[-1], rng, 0.3))
    owners = {n: i % 2 for i, n in enumerate(sorted(SIZES))}
    _two_ranks_publish(complete, t, owners, range(1, 4), anchor_fraction=0, anchor_max_deltas=0)
    # Rank 1's node: the same indexes, its own shards only (shard names carry the rank).
    own = os.path.join(root, "node1")
    shutil.copytree(complete, own)
    removed = []
    for dirpath, _, files in os.walk(own):
        for f in files:
            if "-r00000-" in f and f.endswith(".safetensors"):
                os.unlink(os.path.join(dirpath, f))
                removed.append(f)
    assert removed and not list_anchors(complete)
    on_disk = 0
    for v in (1, 2, 3):
        vdir = os.path.join(complete, f"weight_v{v:06d}")
        with open(os.path.join(vdir, INDEX)) as f:
            on_disk += sum(os.path.getsize(os.path.join(vdir, n)) for n in set(json.load(f)["weight_map"].values()))
    budgets = {}
    for name, where in (("complete", complete), ("own", own)):
        retention = prune_mod.Retention(where, 0)
        retention.load(upto=3)
        budgets[name] = retention.since_anchor(3)
    assert budgets["complete"] == budgets["own"] == (on_disk, 3)
    # The decision itself, on restarted publishers: a side anchor is due once the deltas since the
    # last anchor point exceed 90% of the full size; the full size given here makes it due.
    decisions = []
    for rank, where in ((0, complete), (1, own)):
        pub = Publisher(where, rank=rank, world_size=2, workers=1, anchor_fraction=0.9, anchor_max_deltas=0)
        pub.seed_snapshot({n: a for n, a in t[3].items() if owners[n] == rank}, version=3)
        _, reason = pub.choose_kind(4, 0, on_disk, requested="delta")
        decisions.append(reason)
        pub.close()
    assert decisions[0] == decisions[1] and "side anchor: deltas since the last anchor reach" in decisions[0]


def test_a_restarted_publisher_sizes_a_version_whose_index_records_no_file_sizes_from_its_files(fast_tmp_path, rng):
    """An index without file_digests (an upstream writer's, an older publisher's): the anchor
    budget after a restart counts its files' sizes on disk, as before indexes recorded them."""
    r = Run(str(fast_tmp_path), rng, anchor_fraction=0, anchor_max_deltas=0)
    r.publish(3)
    assert all(res.kind == "delta" for res in r.results.values())
    r.pub.close()
    for v in (1, 2):
        ipath = os.path.join(r.source, f"weight_v{v:06d}", INDEX)
        with open(ipath) as f:
            obj = json.load(f)
        del obj["file_digests"]
        with open(ipath, "w") as f:
            json.dump(obj, f)
    retention = prune_mod.Retention(r.source, 0)
    retention.load(upto=3)
    assert retention.since_anchor(3) == (sum(r.shard_nbytes(v) for v in (1, 2, 3)), 3)
