"""Side anchors prove themselves (issue 18, points 1, 2, 5, 6): an anchor is bound to the exact
commit of its version (a commit id in both indexes) and carries each tensor's digest; a pull
seeds only from a bound anchor, checks every seeded tensor against those digests, and when an
anchor fails it plans again without anchors, so an anchor never fails a pull, never blames a
good version, and never serves unpublished bytes. A file pruned under a running pull is "not
ready, retry"; ``weightsync verify`` works on a pruned source dir through the anchors' digests.

Every case runs on real files written by our publisher and read back through the safetensors
package; the damage is done to those files on disk.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import xxhash

from weightsync import Publisher, plan_pull, pull
from weightsync.cli import main
from weightsync.errors import AnchorUnusableError, ChecksumMismatchError, SourceNotReadyError
from weightsync.format.layout import list_anchors, list_versions
from weightsync.publisher.prune import prune_versions
from weightsync.puller import pull as pull_mod

from core_support import (
    assert_checkpoint_is,
    flip_local_byte,
    marker_version,
    mutate,
    random_tensors,
    read_checkpoint_bytes,
    shard_path,
    tensor_bytes,
    tensor_location,
    write_hf_checkpoint,
)

INDEX = "model.safetensors.index.json"
SIZES = {"embed": ("float32", (64, 32)), "w1": ("float32", (32, 64)), "w2": ("float32", (32, 64)), "norm": ("float32", (64,))}


def vdir(source: str, v: int) -> str:
    return os.path.join(source, f"weight_v{v:06d}")


def adir(source: str, v: int) -> str:
    return os.path.join(source, f"anchor_v{v:06d}")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


class World:
    """Deltas v1..v4 with a side anchor at v3 (every third delta gets one); v4 changes only w1."""

    def __init__(self, root: str, rng):
        self.root, self.rng = root, rng
        self.seed, self.source = os.path.join(root, "seed"), os.path.join(root, "src")
        self.t = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.t[0])
        self.n = 0

    def publisher(self, version: int = 0) -> Publisher:
        pub = Publisher(self.source, workers=1, anchor_fraction=0, anchor_max_deltas=3)
        pub.seed_snapshot(self.t[version], version=version)
        return pub

    def publish_chain(self, upto: int = 4) -> None:
        pub = self.publisher()
        for v in range(1, upto + 1):
            self.t.append(mutate(self.t[-1], self.rng, 0.05, names=["w1"] if v == 4 else None))
            pub.publish(v, self.t[v])
        pub.close()

    def publish_every_tensor_changed(self, upto: int) -> None:
        """v1..``upto``, each changing every tensor (anchors at every third delta)."""
        pub = self.publisher()
        for v in range(1, upto + 1):
            self.t.append(mutate(self.t[-1], self.rng, 0.05))
            pub.publish(v, self.t[v])
        pub.close()

    def local(self) -> str:
        self.n += 1
        return os.path.join(self.root, f"local{self.n}")

    def pulls_exactly(self, local: str, target: int):
        result = pull(local, self.seed, self.source, target)
        assert_checkpoint_is(local, tensor_bytes(self.t[target]))
        assert marker_version(local) == target
        return result


@pytest.fixture
def world(fast_tmp_path, rng):
    return World(str(fast_tmp_path), rng)


def test_an_anchor_is_bound_to_its_version_by_one_commit_id_and_holds_every_tensors_digest(world):
    world.publish_chain()
    assert list_anchors(world.source) == [3]
    anchor = read_json(os.path.join(adir(world.source, 3), INDEX))
    version = read_json(os.path.join(vdir(world.source, 3), INDEX))
    commit = anchor["metadata"]["anchor_commit"]
    assert len(commit) == 32 and version["metadata"]["anchor_commit"] == commit
    # Derived from the version's digests (FORMAT.md): recomputed here from the spec's recipe.
    text = json.dumps(["000003", "xxh3-128", sorted(anchor["digests"].items())], separators=(",", ":"))
    assert commit == xxhash.xxh3_128_hexdigest(text.encode())
    # The version stays an upstream delta; the other deltas carry no commit id (nothing to bind).
    assert version["metadata"]["delta_encoding"] == "sparse-v1" and version["metadata"]["base_version"] == "000002"
    for v in (1, 2, 4):
        assert "anchor_commit" not in read_json(os.path.join(vdir(world.source, v), INDEX))["metadata"]
    # The digests are xxh3-128 of each tensor's bytes at v3, computed here independently.
    assert anchor["metadata"]["checksum_format"] == "xxh3-128"
    want = {n: xxhash.xxh3_128_hexdigest(b) for n, b in tensor_bytes(world.t[3]).items()}
    assert anchor["digests"] == want


def _leave_an_orphaned_anchor_of_v3(world) -> tuple[Publisher, str]:
    """v1, v2 committed; v3 written with its anchor, and the publisher died after the anchor's
    index landed and before v3's did. The trainer removed the unfinished weight_v000003/."""
    pub = world.publisher()
    for v in (1, 2):
        world.t.append(mutate(world.t[-1], world.rng, 0.05))
        pub.publish(v, world.t[v])
    stale = mutate(world.t[2], world.rng, 0.05)
    pub.publish(3, stale)
    pub.close()
    os.unlink(os.path.join(vdir(world.source, 3), INDEX))  # the crash: v3's index never landed
    assert os.path.exists(os.path.join(adir(world.source, 3), INDEX))
    shutil.rmtree(vdir(world.source, 3))  # the trainer's clean-up of the unfinished version
    saved = os.path.join(world.root, "orphan")
    shutil.copytree(adir(world.source, 3), saved)
    return world.publisher(2), saved


@pytest.mark.parametrize("host", ["fresh", "at v2"])
def test_a_stale_anchor_is_never_served_for_a_republished_version(world, host):
    pub, _ = _leave_an_orphaned_anchor_of_v3(world)
    world.t.append(mutate(world.t[2], world.rng, 0.2))  # the restarted trainer's v3: other bytes
    result = pub.publish(3, world.t[3], full=True)
    pub.close()
    assert result.kind == "full"
    assert list_anchors(world.source) == []  # the publisher removed the earlier attempt's anchor
    local = world.local()
    if host == "at v2":
        world.pulls_exactly(local, 2)
    world.pulls_exactly(local, 3)


@pytest.mark.parametrize("host", ["fresh", "at v2"])
@pytest.mark.parametrize("republished_as", ["full", "delta with its own anchor"])
def test_an_orphaned_anchor_left_beside_a_republished_version_is_never_seeded_from(world, host, republished_as):
    # Whatever leaves the orphan there (a publisher of an older release, a filesystem showing
    # stale files, a copy restored by hand): a reader must not take it for the published v3.
    pub, saved = _leave_an_orphaned_anchor_of_v3(world)
    world.t.append(mutate(world.t[2], world.rng, 0.05))
    pub.publish(3, world.t[3], full=republished_as == "full")
    pub.close()
    if republished_as == "full":
        shutil.copytree(saved, adir(world.source, 3))
    else:
        assert list_anchors(world.source) == [3]  # the new anchor, with a new commit id
        shutil.copyfile(os.path.join(saved, INDEX), os.path.join(adir(world.source, 3), INDEX))
        for name in os.listdir(saved):
            shutil.copyfile(os.path.join(saved, name), os.path.join(adir(world.source, 3), name))
    local = world.local()
    if host == "at v2":
        world.pulls_exactly(local, 2)
    plan, _ = plan_pull(local, world.seed, world.source, 3)
    assert plan.seed is None or plan.seed.kind != "anchor", plan.reason
    world.pulls_exactly(local, 3)
    # And pruning deletes it: no pull can ever use it.
    prune_versions(world.source, keep=8)
    assert list_anchors(world.source) == []


def _cut_shard(world, name: str = "", nbytes: int = 1000) -> None:
    shard = shard_path(adir(world.source, 3))
    os.truncate(shard, os.path.getsize(shard) - nbytes)


def _flip_anchor_byte(world, name: str) -> None:
    flip_local_byte(adir(world.source, 3), name, 5)


DAMAGE = {
    "shard cut short by 1000 bytes": lambda w: _cut_shard(w),
    "a byte flipped in a tensor v4 changes": lambda w: _flip_anchor_byte(w, "w1"),
    "a byte flipped in a tensor v4 leaves alone": lambda w: _flip_anchor_byte(w, "w2"),
    "its shard replaced by an empty file": lambda w: _cut_shard(w, nbytes=os.path.getsize(
        shard_path(adir(w.source, 3)))),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("target", [3, 4])
def test_a_damaged_anchor_never_fails_a_pull_and_never_blames_a_good_version(world, damage, target):
    world.publish_chain()
    plan, _ = plan_pull(world.local(), world.seed, world.source, target)
    assert plan.seed is not None and plan.seed.kind == "anchor", plan.reason  # the anchor is the cheapest way
    DAMAGE[damage](world)
    for _ in range(2):  # every pull, not only the first, succeeds with the published bytes
        local = world.local()
        result = world.pulls_exactly(local, target)
        assert "anchor_v000003 failed its check" in result.reason and result.action == "seed+chain", result.reason


@pytest.mark.parametrize("field", ["a digest", "the commit id", "the digests dropped"])
def test_an_anchor_whose_index_binding_is_damaged_is_passed_over_at_plan_time(world, field):
    world.publish_chain()
    path = os.path.join(adir(world.source, 3), INDEX)
    index = read_json(path)
    if field == "a digest":
        index["digests"]["norm"] = "0" * 32  # the commit id, recomputed from the digests, no longer fits
    elif field == "the commit id":
        index["metadata"]["anchor_commit"] = "0" * 32
    else:
        del index["digests"]
    write_json(path, index)
    local = world.local()
    plan, _ = plan_pull(local, world.seed, world.source, 4)
    assert plan.seed is not None and plan.seed.kind == "seed_dir", plan.reason
    world.pulls_exactly(local, 4)


def test_a_host_at_an_earlier_version_chains_past_a_damaged_anchor_without_reading_it(world):
    world.publish_chain()
    local = world.local()
    world.pulls_exactly(local, 2)
    _flip_anchor_byte(world, "w2")
    result = world.pulls_exactly(local, 4)
    assert result.action == "chain" and result.deltas_applied == 2, result.reason


def test_a_damaged_anchor_with_the_chain_below_it_pruned_is_a_typed_error_that_blames_the_anchor(world):
    world.publish_chain()
    _flip_anchor_byte(world, "w2")
    shutil.rmtree(vdir(world.source, 1))  # the chain below the anchor is gone
    local = world.local()
    with pytest.raises(AnchorUnusableError) as ei:
        pull(local, world.seed, world.source, 4)
    e = ei.value
    assert e.anchor_version == 3 and e.needed_version == 1 and e.target_version == 4
    assert "w2" in e.detail and e.http_status == 422 and e.error_type == "corrupt_artifact"
    assert marker_version(local) is None  # never a marker over the unverified copy


def test_a_damaged_newest_anchor_falls_back_to_the_older_anchor_pruning_kept(world):
    world.publish_every_tensor_changed(upto=7)
    assert list_anchors(world.source) == [3, 6]
    assert prune_versions(world.source, keep=0) == [1, 2]  # the second-newest anchor point is v3
    flip_local_byte(adir(world.source, 6), "embed", 7)
    local = world.local()
    result = world.pulls_exactly(local, 7)
    assert "seed from side anchor anchor_v000003" in result.reason and result.deltas_applied == 4, result.reason
    assert "anchor_v000006 failed its check" in result.reason
    flip_local_byte(adir(world.source, 3), "embed", 7)  # now no way is left
    with pytest.raises(AnchorUnusableError) as ei:
        pull(world.local(), world.seed, world.source, 7)
    assert ei.value.anchor_version == 3 and ei.value.needed_version == 2


def test_an_anchor_of_an_older_publisher_without_a_commit_id_is_not_used_and_the_chain_serves(world):
    world.publish_chain()
    for path, drop in ((os.path.join(adir(world.source, 3), INDEX), ("anchor_commit", "checksum_format")),
                       (os.path.join(vdir(world.source, 3), INDEX), ("anchor_commit",))):
        index = read_json(path)
        for key in drop:
            del index["metadata"][key]
        index.pop("digests", None)
        write_json(path, index)
    local = world.local()
    result = world.pulls_exactly(local, 4)
    assert "anchor" not in result.reason and result.deltas_applied == 4, result.reason
    # Pruned below it (by an older release's pruning): the error names the unbound anchor.
    _remove_like_prune(vdir(world.source, 1))
    with pytest.raises(AnchorUnusableError) as ei:
        pull(world.local(), world.seed, world.source, 4)
    assert ei.value.anchor_version == 3 and "legacy" in ei.value.detail and ei.value.needed_version == 1


def test_a_full_version_after_an_anchor_whose_layout_record_was_damaged_publishes_and_pulls(world):
    """A byte of the anchor's index that changes its layout record (a shape digit) makes the
    record and the shard headers disagree: the publisher takes no layout from it, so the next
    full version, of the model's real layout, is not refused as a layout change (a hypothesis
    run of the anchor-damage test found the refusal). The pull refuses the damaged anchor."""
    world.publish_chain()
    path = os.path.join(adir(world.source, 3), INDEX)
    index = read_json(path)
    name, (dtype, shape) = sorted(index["layout"].items())[0]
    index["layout"][name] = [dtype, [shape[0] + 10, *shape[1:]]]
    write_json(path, index)
    for v in (1, 2):
        _remove_like_prune(vdir(world.source, v))
    local = world.local()
    with pytest.raises(AnchorUnusableError):
        pull(local, world.seed, world.source, 3)
    pub = world.publisher(4)
    world.t.append(mutate(world.t[4], world.rng, 0.05))
    pub.publish(5, world.t[5], full=True)
    pub.close()
    world.pulls_exactly(local, 5)


def test_an_anchor_index_damaged_into_what_reads_as_incomplete_json_is_damage_not_a_publish_in_flight(world):
    """A changed byte can make a complete index read as a prefix of JSON (the metadata's closing
    brace turned into a space leaves the outer object open at the end). An anchor's index is
    committed before its version's, so while the version is committed naming the anchor's commit
    id, that is damage: with the chain below pruned the pull blames the anchor, not "retry later"
    (a hypothesis run of the anchor-damage test found ChainBrokenError here)."""
    world.publish_chain()
    path = os.path.join(adir(world.source, 3), INDEX)
    with open(path, "rb") as f:
        raw = f.read()
    at = raw.index(b"}")  # the metadata object's closing brace
    with open(path, "wb") as f:
        f.write(raw[:at] + b" " + raw[at + 1:])
    for v in (1, 2):
        _remove_like_prune(vdir(world.source, v))
    with pytest.raises(AnchorUnusableError) as ei:
        pull(world.local(), world.seed, world.source, 4)
    assert ei.value.anchor_version == 3 and "incomplete JSON" in ei.value.detail


# --- point 5: a file pruned under a running pull ------------------------------------------------


def _remove_like_prune(directory: str) -> None:
    os.unlink(os.path.join(directory, INDEX))
    shutil.rmtree(directory)


@pytest.mark.parametrize("what", ["side anchor", "full version", "delta payload"])
def test_a_file_pruned_between_plan_and_read_is_source_not_ready_and_a_retry_recovers(world, monkeypatch, what):
    if what == "full version":
        pub = world.publisher()
        world.t.append(mutate(world.t[0], world.rng, 0.05))
        pub.publish(1, world.t[1], full=True)
        world.t.append(mutate(world.t[1], world.rng, 0.05))
        pub.publish(2, world.t[2])
        pub.close()
        target, victim = 2, vdir(world.source, 1)
    else:
        world.publish_chain()
        target = 4
        victim = adir(world.source, 3) if what == "side anchor" else vdir(world.source, 4)
    saved = os.path.join(world.root, "saved")
    shutil.copytree(victim, saved)
    real_plan = pull_mod.plan_pull
    calls = []

    def plan_then_prune(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        if not calls:
            _remove_like_prune(victim)
        calls.append(plan)
        return plan

    monkeypatch.setattr(pull_mod, "plan_pull", plan_then_prune)
    local = world.local()
    with pytest.raises(SourceNotReadyError) as ei:
        pull(local, world.seed, world.source, target)
    assert type(ei.value) is SourceNotReadyError and ei.value.retryable
    assert marker_version(local) is None
    monkeypatch.undo()
    if what != "side anchor":  # the anchor was optional; the pruned version is needed again
        shutil.copytree(saved, victim)
    world.pulls_exactly(local, target)


# --- point 6: verify after pruning -------------------------------------------------------------


def test_verify_works_after_default_pruning_against_the_anchors_digests(fast_tmp_path, rng, capsys):
    root = str(fast_tmp_path)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, t[0])
    pub = Publisher(source, workers=1)  # the defaults: side anchors and pruning
    pub.seed_snapshot(t[0])
    for v in range(1, 81):
        t.append(mutate(t[-1], rng, 0.02))
        pub.publish(v, t[v])
    pub.close()
    assert list_versions(source)[0] > 1 and list_anchors(source), "default pruning ran"
    pull(local, seed, source, 80)
    argv = ["--json", "verify", local, "--source-dir", source, "--version", "80", "--seed-dir", seed]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == len(SIZES) and report["mismatched"] == [] and report["unchecked"] == []
    flip_local_byte(local, "w2", 3)
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert [m[0] for m in report["mismatched"]] == ["w2"]


def test_verify_of_a_pruned_version_says_which_version_is_missing(fast_tmp_path, rng, capsys):
    root = str(fast_tmp_path)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, t[0])
    pub = Publisher(source, workers=1, anchor_fraction=0, anchor_max_deltas=0)
    pub.seed_snapshot(t[0])
    for v in (1, 2):
        t.append(mutate(t[-1], rng, 0.02))
        pub.publish(v, t[v])
    pub.close()
    pull(local, seed, source, 2)
    shutil.rmtree(vdir(source, 1))
    code = main(["--json", "verify", local, "--source-dir", source, "--version", "2", "--seed-dir", seed])
    out = capsys.readouterr()
    assert code != 0 and "version 1" in out.out + out.err


# --- pruning keeps the binding ----------------------------------------------------------------


def test_pruning_counts_only_bound_anchors_and_deletes_an_orphaned_one(world):
    world.publish_every_tensor_changed(upto=7)
    assert list_anchors(world.source) == [3, 6]
    path = os.path.join(vdir(world.source, 6), INDEX)
    index = read_json(path)
    index["metadata"]["anchor_commit"] = "f" * 32  # v6 committed by another attempt than its anchor's
    write_json(path, index)
    assert prune_versions(world.source, keep=0) == []  # one bound anchor point: nothing below it goes
    assert list_anchors(world.source) == [3] and list_versions(world.source) == list(range(1, 8))
    local = world.local()
    world.pulls_exactly(local, 7)


def test_a_seeded_copy_reads_back_as_the_published_version_through_safetensors(world):
    world.publish_chain()
    local = world.local()
    result = world.pulls_exactly(local, 3)
    assert result.action == "seed" and "anchor_v000003" in result.reason
    assert read_checkpoint_bytes(local) == tensor_bytes(world.t[3])
    assert tensor_location(local, "w1")[2] == world.t[3]["w1"].nbytes


def test_two_ranks_write_one_bound_anchor_whose_digests_are_the_union(world):
    import pickle

    owners = {n: i % 2 for i, n in enumerate(sorted(SIZES))}

    def part(tensors, r):
        return {n: t for n, t in tensors.items() if owners[n] == r}

    pubs = [Publisher(world.source, rank=r, world_size=2, workers=1, anchor_fraction=0, anchor_max_deltas=1)
            for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot(part(world.t[0], r))
    world.t.append(mutate(world.t[0], world.rng, 0.05, names=["w1"]))  # rank 1's tensors stay the same
    prepared = [pub.prepare(1, part(world.t[1], r)) for r, pub in enumerate(pubs)]
    totals = sum(p.delta_nbytes for p in prepared), sum(p.full_nbytes for p in prepared)
    kinds = {pub.choose_kind(1, *totals) for pub in pubs}
    assert len(kinds) == 1 and next(iter(kinds))[0] == "delta"  # every rank decides the anchor alike
    manifests = [pickle.loads(pickle.dumps(pub.write(p, "delta"))) for pub, p in zip(pubs, prepared)]
    assert all(m.anchor_digests for m in manifests)
    pubs[0].commit(1, "delta", manifests)
    pubs[1].confirm(1)
    for pub in pubs:
        pub.close()
    anchor = read_json(os.path.join(adir(world.source, 1), INDEX))
    assert anchor["digests"] == {n: xxhash.xxh3_128_hexdigest(b) for n, b in tensor_bytes(world.t[1]).items()}
    local = world.local()
    result = world.pulls_exactly(local, 1)
    assert result.action == "seed" and "anchor_v000001" in result.reason, result.reason


# --- any one byte of an anchor ------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    data=st.data(),
    in_index=st.booleans(),
    mask=st.integers(1, 255),
    target=st.sampled_from([3, 4]),
    start=st.sampled_from([None, 1, 2]),
    pruned=st.booleans(),
)
def test_any_one_byte_of_an_anchor_damaged_still_pulls_exactly_the_published_bytes(
    fast_tmp_path, data, in_index, mask, target, start, pruned
):
    """Whatever byte of the anchor changes, a pull either holds exactly the target's bytes or,
    only when the chain below the anchor is gone, fails with AnchorUnusableError, leaves no
    marker, and a republished full version then pulls."""
    import tempfile

    import numpy as np

    root = tempfile.mkdtemp(dir=str(fast_tmp_path))
    world = World(root, np.random.default_rng(len(os.listdir(str(fast_tmp_path)))))
    world.publish_chain()
    path = os.path.join(adir(world.source, 3), INDEX) if in_index else shard_path(adir(world.source, 3))
    pos = data.draw(st.integers(0, os.path.getsize(path) - 1), label="offset")
    local = world.local()
    if start is not None:
        world.pulls_exactly(local, start)
    if pruned:
        for v in (1, 2):
            _remove_like_prune(vdir(world.source, v))
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ mask]))
    try:
        world.pulls_exactly(local, target)  # a success holds exactly v{target}'s bytes
    except AnchorUnusableError as e:
        assert pruned and e.anchor_version == 3, e
        held = marker_version(local)  # none, or an honest one (a plan that failed changes nothing)
        if held is not None:
            assert held == start
            assert_checkpoint_is(local, tensor_bytes(world.t[held]))
        pub = world.publisher(4)
        world.t.append(mutate(world.t[4], world.rng, 0.05))
        pub.publish(5, world.t[5], full=True)
        pub.close()
        world.pulls_exactly(local, 5)
    shutil.rmtree(root)


# --- a full version of ours carries its digests too ---------------------------------------------


def test_a_flipped_byte_in_a_full_version_fails_the_seed_naming_it_and_never_serves(world):
    pub = world.publisher()
    world.t.append(mutate(world.t[0], world.rng, 0.05))
    pub.publish(1, world.t[1], full=True)
    world.t.append(mutate(world.t[1], world.rng, 0.05))
    pub.publish(2, world.t[2])
    pub.close()
    index = read_json(os.path.join(vdir(world.source, 1), INDEX))
    assert index["digests"] == {n: xxhash.xxh3_128_hexdigest(b) for n, b in tensor_bytes(world.t[1]).items()}
    assert index["metadata"]["checksum_format"] == "xxh3-128"
    path, off, _ = tensor_location(vdir(world.source, 1), "w2")
    with open(path, "r+b") as f:
        f.seek(off + 11)
        b = f.read(1)[0]
        f.seek(off + 11)
        f.write(bytes([b ^ 0x10]))
    for target in (1, 2):
        local = world.local()
        with pytest.raises(ChecksumMismatchError) as ei:
            pull(local, world.seed, world.source, target)
        assert ei.value.version == 1 and [m[0] for m in ei.value.mismatches] == ["w2"]
        assert marker_version(local) is None
    with open(path, "r+b") as f:  # repaired: the same pull succeeds
        f.seek(off + 11)
        f.write(bytes([b]))
    world.pulls_exactly(world.local(), 2)


def test_verify_checks_against_a_full_versions_digests_without_reading_its_bytes(world, capsys):
    pub = world.publisher()
    world.t.append(mutate(world.t[0], world.rng, 0.05))
    pub.publish(1, world.t[1], full=True)
    world.t.append(mutate(world.t[1], world.rng, 0.05, names=["w1"]))
    pub.publish(2, world.t[2])
    pub.close()
    local = world.local()
    world.pulls_exactly(local, 2)
    for name in os.listdir(vdir(world.source, 1)):  # its bytes gone: only its index is read
        if name != INDEX:
            os.unlink(os.path.join(vdir(world.source, 1), name))
    argv = ["--json", "verify", local, "--source-dir", world.source, "--version", "2"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == len(SIZES) and report["unchecked"] == []
