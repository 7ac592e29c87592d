"""Pull behaviour beyond the abuse catalogue: plans, the hook, the marker, torn applies,
deferred durability, request validation."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from weightsync import Publisher, applied_version, errors, plan_pull, pull
from weightsync.puller.pull import wait_until_durable

from core_support import (
    assert_checkpoint_is,
    flip_local_byte,
    marker_version,
    mutate,
    random_tensors,
    read_checkpoint_bytes,
    tensor_bytes,
    write_hf_checkpoint,
)

SIZES = {"w1": ("float32", (64, 64)), "w2": ("float32", (64, 64)), "b": ("int16", (9,))}


@pytest.fixture
def chain(fast_tmp_path, rng):
    """v1 xor, v2 overwrite, v3 full, v4 xor, v5 xor."""
    root = str(fast_tmp_path)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    t = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, t, shards=2)
    expected = [tensor_bytes(t)]
    for v, (enc, full) in enumerate([("xor", False), ("overwrite", False), ("xor", True), ("xor", False), ("xor", False)], 1):
        new = mutate(t, rng, 0.05)
        pub = Publisher(source, encoding=enc, workers=1)
        pub.seed_snapshot(t, version=v - 1)
        pub.publish(v, new, full=full)
        pub.close()
        t = new
        expected.append(tensor_bytes(new))
    return {"root": root, "seed": seed, "source": source, "local": os.path.join(root, "local"), "expected": expected}


def do_pull(c, target, **kw):
    return pull(c["local"], c["seed"], c["source"], target, **kw)


@pytest.mark.parametrize(
    "start, target, action, deltas",
    [
        (None, 0, "seed", []),
        (None, 2, "seed+chain", [1, 2]),
        (None, 3, "seed", []),  # the full version itself
        (None, 5, "seed+chain", [4, 5]),  # seeds from the anchor, not from v0
        (1, 2, "chain", [2]),
        (1, 5, "seed+chain", [4, 5]),  # a full version between: seed from it
        (3, 5, "chain", [4, 5]),
        (5, 5, "noop", []),
        (0, 2, "chain", [1, 2]),  # at v0 (the seed dir): chain from there
        (4, 0, "seed", []),  # reset
    ],
)
def test_plan_picks_the_cheapest_way_to_the_target(chain, start, target, action, deltas):
    if start is not None:
        do_pull(chain, start)
    plan, _ = plan_pull(chain["local"], chain["seed"], chain["source"], target)
    assert (plan.action, plan.deltas) == (action, deltas), plan.reason
    result = do_pull(chain, target)
    assert result.action == action and result.deltas_applied == len(deltas)
    assert_checkpoint_is(chain["local"], chain["expected"][target])


def test_marker_spells_a_padded_version_and_the_real_source_dir(chain):
    link = os.path.join(chain["root"], "src-link")
    os.symlink(chain["source"], link)
    pull(chain["local"], chain["seed"], link, 2)
    with open(os.path.join(chain["local"], ".weight_sync", "state.json")) as f:
        marker = json.load(f)
    with open(os.path.join(chain["source"], "weightsync-run.json")) as f:
        run_id = json.load(f)["run_id"]
    seed = marker.pop("seed")
    sizes = marker.pop("files")  # each local weight file's size, which a no-op checks
    assert sizes == {n: os.path.getsize(os.path.join(chain["local"], n)) for n in sizes} and len(sizes) == 2
    assert marker == {"version": "000002", "source_dir": os.path.realpath(chain["source"]), "run": run_id}
    assert len(seed) == 32 and int(seed, 16) >= 0  # the seed dir's fingerprint (xxh3-128 hex)
    assert applied_version(chain["local"]) == 2
    # The same source through another spelling is the same source: no reseed.
    assert do_pull(chain, 4).action == "seed+chain"  # v3 is full
    assert applied_version(chain["local"]) == 4


def test_torn_apply_reseeds_instead_of_repatching(chain):
    """A crash mid-apply leaves half-patched bytes and no marker; applying the xor again over
    them would corrupt them further, so the next pull must start from a seed."""
    do_pull(chain, 1)
    os.unlink(os.path.join(chain["local"], ".weight_sync", "state.json"))  # what apply does first
    flip_local_byte(chain["local"], "w1", 0)  # ... then some bytes changed before the crash
    result = do_pull(chain, 2)
    assert result.action == "seed+chain" and result.deltas_applied == 2
    assert_checkpoint_is(chain["local"], chain["expected"][2])


def test_missing_source_version_fails_fast_without_reseed(chain):
    do_pull(chain, 2)
    before = os.stat(os.path.join(chain["local"], "model-00001-of-00002.safetensors")).st_mtime_ns
    with pytest.raises(errors.VersionMissingError):
        do_pull(chain, 9)
    assert os.stat(os.path.join(chain["local"], "model-00001-of-00002.safetensors")).st_mtime_ns == before
    assert marker_version(chain["local"]) == 2


def test_reset_to_version_zero_restores_the_seed_dir_exactly(chain):
    do_pull(chain, 5)  # local now holds the full version's shard files
    result = do_pull(chain, 0)
    assert result.action == "seed"
    assert sorted(f for f in os.listdir(chain["local"]) if f.endswith(".safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert read_checkpoint_bytes(chain["local"]) == chain["expected"][0]
    assert marker_version(chain["local"]) == 0


def test_hook_runs_once_inside_the_lock_only_when_there_is_work(chain):
    calls = []

    def hook(source_dir, target):
        # Inside the lock: a second puller cannot take it now.
        with pytest.raises(errors.LockTimeoutError):
            pull(chain["local"], chain["seed"], chain["source"], target, lock_timeout_s=0)
        calls.append((source_dir, target))

    assert do_pull(chain, 2, pre_read_hook=hook).hook_ran
    assert not do_pull(chain, 2, pre_read_hook=hook).hook_ran  # noop
    assert not do_pull(chain, 0, pre_read_hook=hook).hook_ran  # reset reads no source
    assert calls == [(chain["source"], 2)]


def test_hook_by_import_path(chain, monkeypatch, fast_tmp_path):
    log = str(fast_tmp_path / "hook.log")
    monkeypatch.setenv("WS_HOOK_LOG", log)
    assert do_pull(chain, 1, pre_read_hook="core_fault_child.record_hook").hook_ran
    with open(log) as f:
        assert f.read().split()[1] == "1"


@pytest.mark.parametrize(
    "hook, words",
    [
        ("no_dots", r"pre-read hook 'no_dots' is not an import path like 'package.module.function'"),
        ("no_such_module_xyz.fn", r"pre-read hook 'no_such_module_xyz.fn' cannot be imported"),
        ("core_support.no_such_function", r"pre-read hook 'core_support.no_such_function' cannot be imported"),
    ],
)
def test_bad_hook_is_a_bad_request_before_anything_happens(chain, hook, words):
    with pytest.raises(errors.InvalidRequestError, match=words):
        do_pull(chain, 1, pre_read_hook=hook)
    assert not os.path.exists(chain["local"])


def test_hook_failure_propagates_and_leaves_the_local_checkpoint(chain):
    do_pull(chain, 1)

    def failing_hook(source_dir, target):
        raise RuntimeError("refresh of the shared filesystem failed")

    with pytest.raises(RuntimeError, match="refresh of the shared filesystem failed"):
        do_pull(chain, 2, pre_read_hook=failing_hook)
    assert marker_version(chain["local"]) == 1
    assert_checkpoint_is(chain["local"], chain["expected"][1])
    assert do_pull(chain, 2).applied_version == 2  # the lock was released


@pytest.mark.parametrize(
    "args, words",
    [
        (dict(local_checkpoint_dir=""), r"local_checkpoint_dir must be a non-empty path"),
        (dict(seed_dir=None), r"seed_dir must be a non-empty path"),
        (dict(source_dir="SAME_AS_LOCAL"), r"source_dir and local_checkpoint_dir must be different directories"),
        (dict(durability="eventually"), r"durability must be 'sync' or 'deferred', got 'eventually'"),
    ],
)
def test_malformed_requests_are_refused_before_taking_the_lock(chain, args, words):
    call = dict(local_checkpoint_dir=chain["local"], seed_dir=chain["seed"], source_dir=chain["source"], target_version=1)
    call.update(args)
    if call["source_dir"] == "SAME_AS_LOCAL":
        call["source_dir"] = call["local_checkpoint_dir"]
    with pytest.raises(errors.InvalidRequestError, match=words):
        pull(**call)


def test_seed_dir_that_does_not_exist_is_a_bad_request(chain):
    with pytest.raises(errors.InvalidRequestError, match=r"seed dir .*nowhere.* is not a directory"):
        pull(chain["local"], os.path.join(chain["root"], "nowhere"), chain["source"], 2)
    assert marker_version(chain["local"]) is None


def test_deferred_durability_returns_verified_bytes_and_writes_the_marker_after_the_flush(chain):
    do_pull(chain, 3)
    result = do_pull(chain, 5, durability="deferred")
    assert result.applied_version == 5
    # The bytes are already the verified v5 (an engine may reload now) ...
    assert_checkpoint_is(chain["local"], chain["expected"][5])
    # ... and the marker follows once the flush is done.
    assert wait_until_durable(chain["local"], timeout_s=60)
    assert marker_version(chain["local"]) == 5
    assert do_pull(chain, 5).action == "noop"


def test_pull_after_a_deferred_pull_waits_for_its_flush(chain):
    do_pull(chain, 3)
    do_pull(chain, 4, durability="deferred")
    result = do_pull(chain, 5)  # takes the lock only after the flush released it
    assert result.action == "chain" and result.deltas_applied == 1
    assert marker_version(chain["local"]) == 5
    assert_checkpoint_is(chain["local"], chain["expected"][5])


def test_folded_xor_chain_reads_and_verifies_each_tensor_once(chain):
    do_pull(chain, 3)
    result = do_pull(chain, 5)
    assert result.deltas_applied == 2 and not result.reseeded
    assert_checkpoint_is(chain["local"], chain["expected"][5])


def test_progress_callback_counts_every_tensor(chain):
    seen = []
    do_pull(chain, 3)
    do_pull(chain, 5, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)


def test_many_workers_and_tiny_chunks_give_the_same_bytes(chain, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_CHUNK_NBYTES", "1000")
    result = do_pull(chain, 2, workers=8)
    assert result.deltas_applied == 2
    assert_checkpoint_is(chain["local"], chain["expected"][2])


def test_concurrent_pulls_of_two_hosts_do_not_interfere(chain):
    locals_ = [os.path.join(chain["root"], f"host{i}") for i in range(3)]
    errors_seen = []

    def host(local, target):
        try:
            pull(local, chain["seed"], chain["source"], target)
        except BaseException as e:
            errors_seen.append(e)

    threads = [threading.Thread(target=host, args=(loc, t)) for loc, t in zip(locals_, (2, 5, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors_seen
    for loc, target in zip(locals_, (2, 5, 4)):
        assert_checkpoint_is(loc, chain["expected"][target])
