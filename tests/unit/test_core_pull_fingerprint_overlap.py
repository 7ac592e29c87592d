"""A pull with a pre-read hook (a pull through a mirror: a bucket's or an HTTP source's fetch runs
in the hook) computes a seed fingerprint that hashes every byte (a seed on tmpfs) while the hook
runs, not before it; the fingerprint still decides everything it decided before: an unusable seed
is refused before anything is written, a changed seed is never a no-op."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.fsio import find_memory_filesystem
from weightsync.puller import identity

from core_support import SINGLE, assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

SIZES = {"a": ("float32", (128, 128)), "b": ("float32", (64,)), "c": ("int16", (24,))}


class World:
    def __init__(self, root: str, shards: int = 1):
        rng = np.random.default_rng(11)
        self.seed, self.source, self.local = (os.path.join(root, n) for n in ("seed", "src", "local"))
        self.t = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.t[0], shards=shards)
        pub = Publisher(self.source, encoding="xor", workers=1)
        pub.seed_snapshot(self.t[0], version=0)
        for v in (1, 2):
            self.t.append(mutate(self.t[-1], rng, 0.05))
            pub.publish(v, self.t[v])
        pub.close()
        self.hook_calls = 0

    def hook(self, _source: str, _version: int) -> None:
        self.hook_calls += 1

    def pull(self, target: int, hook=None):
        return pull(self.local, self.seed, self.source, target, pre_read_hook=hook or self.hook)


@pytest.fixture
def world(fast_tmp_path) -> World:
    w = World(str(fast_tmp_path))
    if find_memory_filesystem(w.seed) is None:
        pytest.skip("the seed dir is not on a memory filesystem here (the fingerprint samples: nothing to overlap)")
    return w


def test_a_hooked_pull_fingerprints_a_tmpfs_seed_while_its_hook_runs(world, monkeypatch):
    hook_started = threading.Event()
    seen: list[bool] = []
    real = identity.seed_fingerprint

    def fingerprint_after_the_hook_started(seed_dir: str) -> str:
        # Computed before the hook (the old order), this waits out its timeout and records False.
        seen.append(hook_started.wait(timeout=10))
        return real(seed_dir)

    def hook(_source: str, _version: int) -> None:
        hook_started.set()

    monkeypatch.setattr(identity, "seed_fingerprint", fingerprint_after_the_hook_started)
    result = world.pull(2, hook)
    assert seen == [True], "the seed fingerprint was computed before the hook ran, not while it ran"
    assert result.applied_version == 2
    assert_checkpoint_is(world.local, tensor_bytes(world.t[2]))


def test_a_hooked_pull_of_the_applied_version_with_the_seed_unchanged_is_a_no_op(world):
    assert world.pull(1).applied_version == 1
    calls = world.hook_calls
    result = world.pull(1)
    assert result.action == "noop", result.reason
    assert world.hook_calls == calls  # a no-op reads nothing from the source


def test_a_hooked_pull_of_the_applied_version_after_the_seed_was_replaced_is_not_a_no_op(world):
    assert world.pull(1).applied_version == 1
    path = os.path.join(world.seed, SINGLE)
    shutil.copyfile(path, path + ".tmp")
    os.replace(path + ".tmp", path)  # the same bytes under a new inode: another seed for all we know
    result = world.pull(1)
    assert result.action != "noop", result.reason
    assert marker_version(world.local) == 1
    assert_checkpoint_is(world.local, tensor_bytes(world.t[1]))


def test_a_seed_dir_missing_a_shard_is_refused_before_a_hooked_pull_writes_anything(fast_tmp_path):
    w = World(str(fast_tmp_path), shards=2)
    os.unlink(os.path.join(w.seed, "model-00002-of-00002.safetensors"))
    with pytest.raises(errors.SeedDirUnusableError, match="model-00002-of-00002.safetensors"):
        w.pull(2)
    assert not os.path.exists(w.local) and w.hook_calls == 0


def test_a_seed_that_cannot_be_read_midway_is_refused_after_the_hook_with_nothing_applied(world, monkeypatch):
    monkeypatch.setattr(identity, "seed_fingerprint", lambda seed_dir: identity.NO_SEED)
    with pytest.raises(errors.SeedDirUnusableError):
        world.pull(2)
    assert marker_version(world.local) is None
    assert not any(n.endswith(".safetensors") for n in os.listdir(world.local))
