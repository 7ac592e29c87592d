"""One contract for a version whose publish failed (the core's part).

After a failed publish of vN, vN is finished with the bytes staged for it (or, when its index
already landed and only a later step failed, recognised as published), then newer weights follow
as vN+1, a delta from vN. An unfinished vN can instead be discarded explicitly: its files go and
the next version is full. Real files, the real ``pull`` reading every version back; the faults
(ENOSPC on an index write, a pruning failure, an index write that lands and then reports an
error) are injected at exactly one call because a test cannot cause them on a real disk.
"""

from __future__ import annotations

import errno
import os

import pytest

import weightsync.publisher.publish as publish_mod
from weightsync import Publisher, errors, pull

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {"embed": ("float32", (64, 16)), "layers.0.w": ("float32", (32, 32)), "norm": ("float32", (16,))}


@pytest.fixture
def world(fast_tmp_path, rng):
    root = str(fast_tmp_path)
    t = [random_tensors(rng, SIZES)]
    for _ in range(4):
        t.append(mutate(t[-1], rng, 0.03))
    seed = os.path.join(root, "seed")
    write_hf_checkpoint(seed, t[0])
    return {"root": root, "seed": seed, "source": os.path.join(root, "src"), "t": t}


def _publisher(world, **kw) -> Publisher:
    pub = Publisher(world["source"], encoding="sparse-v1", workers=1, **kw)
    pub.seed_snapshot(world["t"][0])
    return pub


def _fail_index_write(monkeypatch, version: int, times: int, *, after_landing: bool = False) -> dict:
    """ENOSPC on ``version``'s index write, ``times`` times (after_landing: the index is written,
    then the call reports the failure, as a failed directory fsync would)."""
    real = publish_mod.write_bytes
    left = {"n": times}

    def failing(path, data, **kw):
        if left["n"] > 0 and path.endswith(os.path.join(f"weight_v{version:06d}", INDEX)):
            left["n"] -= 1
            if after_landing:
                real(path, data, **kw)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, data, **kw)

    monkeypatch.setattr(publish_mod, "write_bytes", failing)
    return left


def _v1_whose_index_landed_before_its_write_failed(world, monkeypatch):
    """A publisher whose publish of v1 raised after v1's index landed (v1 left pending)."""
    pub = _publisher(world)
    _fail_index_write(monkeypatch, 1, times=1, after_landing=True)
    with pytest.raises(OSError):
        pub.publish(1, world["t"][1])
    return pub


def _assert_serves(world, version: int, expected) -> str:
    local = os.path.join(world["root"], "local")
    result = pull(local, world["seed"], world["source"], version)
    assert result.applied_version == version
    assert_checkpoint_is(local, tensor_bytes(expected))
    return result.action


def test_a_version_whose_index_write_failed_is_finished_with_its_staged_bytes_then_newer_weights_follow(world, monkeypatch):
    t = world["t"]
    pub = _publisher(world)
    pub.publish(1, t[1])
    _fail_index_write(monkeypatch, 2, times=10)
    for _ in range(3):  # every attempt of the caller fails; the disk has not recovered
        with pytest.raises(OSError, match="No space left"):
            pub.publish(2, t[2])
    assert pub.pending_version == 2 and pub.version == 1
    # Newer weights under the pending number are refused (typed, naming the pending version)...
    with pytest.raises(errors.PendingVersionError, match=r"v2 was already written by this rank with other bytes") as info:
        pub.publish(2, t[3])
    assert info.value.pending_version == 2
    with pytest.raises(errors.PendingVersionError, match=r"cannot prepare v3"):
        pub.publish(3, t[3])
    monkeypatch.undo()  # the disk recovered
    finished = pub.finish_pending()
    assert (finished.version, finished.kind) == (2, "delta") and "finishing v2" in finished.reason
    assert pub.pending_version is None and pub.version == 2
    newer = pub.publish(3, t[3])
    assert newer.kind == "delta"
    assert _assert_serves(world, 2, t[2]) == "seed+chain"
    assert _assert_serves(world, 3, t[3]) == "chain"
    pub.close()


def test_a_retry_after_the_index_landed_and_pruning_failed_is_already_published_never_out_of_order(world, monkeypatch):
    t = world["t"]
    pub = _publisher(world)
    pub.publish(1, t[1])
    real_prune, calls = pub.retention.prune, []

    def prune_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error while pruning")
        return real_prune()

    pub.retention.prune = prune_failing_once
    with pytest.raises(OSError, match="while pruning"):
        pub.publish(2, t[2])
    assert pub.version == 2 and pub.pending_version is None  # the index landed: v2 is published
    with open(os.path.join(world["source"], "weight_v000002", INDEX), "rb") as f:
        index_before = f.read()
    again = pub.publish(2, t[2])  # the caller's retry, same bytes: recognised, pruning redone
    assert again.version == 2 and len(calls) == 2
    with open(os.path.join(world["source"], "weight_v000002", INDEX), "rb") as f:
        assert f.read() == index_before  # never written again
    with pytest.raises(errors.VersionAlreadyPublishedError, match=r"version 2 is already published .*with other bytes") as info:
        pub.publish(2, t[3])
    assert info.value.version == 2
    assert pub.finish_pending() is None  # nothing pending
    assert pub.publish(3, t[3]).kind == "delta"
    assert _assert_serves(world, 2, t[2]) == "seed+chain"
    assert _assert_serves(world, 3, t[3]) == "chain"
    pub.close()


def test_a_prepare_of_a_version_already_on_disk_is_already_published_not_out_of_order(world):
    t = world["t"]
    pub = _publisher(world)
    pub.publish(1, t[1])
    pub.publish(2, t[2])
    for v in (1, 2):
        with pytest.raises(errors.VersionAlreadyPublishedError, match=rf"version {v} is already published"):
            pub.prepare(v, t[v])
    pub.close()


def test_an_index_that_landed_before_its_write_reported_a_failure_is_recognised_as_published(world, monkeypatch):
    t = world["t"]
    pub = _v1_whose_index_landed_before_its_write_failed(world, monkeypatch)
    assert pub.pending_version == 1
    ipath = os.path.join(world["source"], "weight_v000001", INDEX)
    stat_before = os.stat(ipath)
    finished = pub.finish_pending()
    assert finished.version == 1 and "already committed on disk" in finished.reason
    assert pub.version == 1 and pub.pending_version is None
    assert os.stat(ipath).st_ino == stat_before.st_ino  # counted, not rewritten
    assert pub.publish(2, t[2]).kind == "delta"
    assert _assert_serves(world, 2, t[2]) == "seed+chain"
    pub.close()


def test_a_discarded_pending_version_leaves_no_files_and_the_next_version_is_full(world, monkeypatch):
    t = world["t"]
    pub = _publisher(world, anchor_max_deltas=1)  # an anchor is due with every delta: its files go too
    pub.publish(1, t[1])
    _fail_index_write(monkeypatch, 2, times=1)
    with pytest.raises(OSError):
        pub.publish(2, t[2])
    assert os.path.isdir(os.path.join(world["source"], "anchor_v000002"))
    assert pub.discard_pending() == 2
    assert not os.path.exists(os.path.join(world["source"], "weight_v000002"))
    assert not os.path.exists(os.path.join(world["source"], "anchor_v000002"))
    assert pub.pending_version is None and pub.version == 1
    assert pub.discard_pending() is None
    # v2 is published afresh with the newer weights: full, since the snapshot holds the discarded bytes.
    result = pub.publish(2, t[3])
    assert result.kind == "full" and "discarded" in result.reason
    assert pub.publish(3, t[4]).kind == "delta"
    assert _assert_serves(world, 2, t[3]) == "seed"
    assert _assert_serves(world, 3, t[4]) == "chain"
    pub.close()


def test_a_pending_version_whose_index_landed_cannot_be_discarded(world, monkeypatch):
    pub = _v1_whose_index_landed_before_its_write_failed(world, monkeypatch)
    with pytest.raises(errors.VersionAlreadyPublishedError, match=r"cannot be discarded"):
        pub.discard_pending()
    assert os.path.isfile(os.path.join(world["source"], "weight_v000001", INDEX))
    pub.close()
