"""Deferred durability with co-located callers: a pull for the version another pull on this
host has already verified returns at once instead of waiting for that pull's flush; a stale
note from a dead process is never trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import weightsync.puller.apply as apply_mod
from weightsync import Publisher, applied_version, errors, pull, wait_until_durable
from weightsync.format.layout import verified_path
from weightsync.puller.lock import acquire_host_lock

from core_support import write_hf_checkpoint


@pytest.fixture
def chain(tmp_path):
    rng = np.random.default_rng(11)
    seed, source, local = (str(tmp_path / n) for n in ("seed", "src", "local"))
    t0 = {"a": rng.standard_normal(2048).astype(np.float32), "b": rng.standard_normal(512).astype(np.float32)}
    write_hf_checkpoint(seed, t0)
    pub = Publisher(source, encoding="xor")
    pub.seed_snapshot(t0)
    t1 = {k: v + np.float32(1e-3) * (rng.random(v.shape) < 0.2) for k, v in t0.items()}
    pub.publish(1, t1, full=False)
    pull(local, seed, source, 0)
    return seed, source, local


def test_co_located_pull_of_a_verified_version_does_not_wait_for_the_flush(chain, monkeypatch):
    seed, source, local = chain
    release = threading.Event()
    real_fsync = apply_mod.fsync_files

    def slow_fsync(paths):  # hold the flush open until the test lets it go
        assert release.wait(30)
        real_fsync(paths)

    from weightsync.puller import pull as pull_module

    monkeypatch.setattr(pull_module, "fsync_files", slow_fsync)
    first = pull(local, seed, source, 1, durability="deferred")
    assert first.durable is False and first.action == "chain"
    assert applied_version(local) is None  # no marker before the flush
    second = pull(local, seed, source, 1, lock_timeout_s=10)
    assert second.action == "noop" and second.durable is False
    assert "co-located pull" in second.reason and str(os.getpid()) in second.reason
    release.set()
    assert wait_until_durable(local, 30)
    assert applied_version(local) == 1
    assert not os.path.exists(verified_path(local))


def test_note_of_a_dead_process_is_not_trusted(chain):
    seed, source, local = chain
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    note = {"version": "000001", "source_dir": os.path.realpath(source), "pid": dead.pid}
    with open(verified_path(local), "w") as f:
        json.dump(note, f)
    held = acquire_host_lock(local, 1)  # another pull holds the lock
    try:
        with pytest.raises(errors.LockTimeoutError):
            pull(local, seed, source, 1, lock_timeout_s=0.3)
    finally:
        held.release()
    result = pull(local, seed, source, 1)
    assert result.action == "chain" and applied_version(local) == 1
    assert not os.path.exists(verified_path(local))  # the stale note was cleared under the lock


def test_note_for_another_version_does_not_end_the_wait(chain):
    seed, source, local = chain
    note = {"version": "000002", "source_dir": os.path.realpath(source), "pid": os.getpid()}
    with open(verified_path(local), "w") as f:
        json.dump(note, f)
    held = acquire_host_lock(local, 1)
    try:
        with pytest.raises(errors.LockTimeoutError):
            pull(local, seed, source, 1, lock_timeout_s=0.3)
    finally:
        held.release()
