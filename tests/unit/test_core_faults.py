"""Real faults: pulls SIGKILLed at random points, and several pullers racing on one host.

A killed pull leaves either no applied-version marker or a marker naming exactly the bytes on
disk; the next pull (in this process) ends bit-exact. Pullers racing on one host serialize on
the host lock: one does the work (and runs the pre-read hook), the others find it done.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from weightsync import Publisher, pull

from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "core_fault_child.py")
# 8 tensors, about 4.5 MB in all: big enough that a pull takes a while, small enough for CI.
SIZES = {f"layers.{i}.weight": ("float32", (128, 1024)) for i in range(8)} | {"norm": ("float32", (1024,))}
# (encoding, full?) of v1..v6: a full anchor in the middle, both upstream encodings.
CHAIN = [("xor", False), ("overwrite", False), ("xor", True), ("xor", False), ("overwrite", False), ("xor", False)]


@pytest.fixture(scope="module")
def chain(fast_module_tmp):
    root = str(fast_module_tmp)
    rng = np.random.default_rng(20240607)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    tensors = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, tensors, shards=2)
    expected = {0: tensor_bytes(tensors)}
    for version, (encoding, full) in enumerate(CHAIN, start=1):
        new = mutate(tensors, rng, 0.05, names=[n for n in tensors if rng.random() < 0.7])
        pub = Publisher(source, encoding=encoding, workers=2)
        pub.seed_snapshot(tensors, version=version - 1)
        assert pub.publish(version, new, full=full).kind == ("full" if full else "delta")
        pub.close()
        tensors = new
        expected[version] = tensor_bytes(new)
    return {"root": root, "seed": seed, "source": source, "expected": expected, "latest": len(CHAIN)}


def child_env(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.getcwd(), env.get("PYTHONPATH", "")])
    env["WEIGHTSYNC_CHUNK_NBYTES"] = str(64 << 10)  # more, shorter steps: kills land mid-apply
    env.update(extra)
    return env


def assert_marker_truthful(local: str, expected) -> int | None:
    v = marker_version(local)
    if v is not None:
        assert_checkpoint_is(local, expected[v])
    return v


def test_pull_killed_at_random_points_never_leaves_a_lying_marker_and_the_retry_is_bit_exact(chain, fast_tmp_path, rng):
    local = str(fast_tmp_path / "local")
    latest, expected = chain["latest"], chain["expected"]
    markers_after_kill = []
    for round_ in range(6):
        proc = subprocess.Popen(
            [sys.executable, CHILD, "loop", local, chain["seed"], chain["source"], f"0,2,{latest},0,4,{latest}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            time.sleep(float(rng.uniform(0.0, 0.4)))
            assert proc.poll() is None, f"the pull loop died on its own: {proc.stderr.read()}"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        markers_after_kill.append(assert_marker_truthful(local, expected))
        # The retry in this process: forward to the newest version, or reset first when the
        # killed pull had already gone further than an odd round's target.
        target = latest if round_ % 2 == 0 else 4
        marker = marker_version(local)
        if marker is not None and marker > target:
            target = latest
        result = pull(local, chain["seed"], chain["source"], target)
        assert result.applied_version == target
        assert marker_version(local) == target
        assert_checkpoint_is(local, expected[target])
    print("markers found right after each SIGKILL:", markers_after_kill)


def _start_once_children(n: int, local: str, chain, target: int, go: str, hook_log: str) -> list[subprocess.Popen]:
    procs = [
        subprocess.Popen(
            [sys.executable, CHILD, "once", local, chain["seed"], chain["source"], str(target), go],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(WS_HOOK_LOG=hook_log),
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return procs


def test_four_processes_pulling_one_host_do_the_work_once(chain, fast_tmp_path):
    local, go, hook_log = str(fast_tmp_path / "local"), str(fast_tmp_path / "go"), str(fast_tmp_path / "hook.log")
    latest = chain["latest"]
    procs = _start_once_children(4, local, chain, latest, go, hook_log)
    open(go, "w").close()  # all four start pulling at once
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(msgspec.json.decode(out.strip().splitlines()[-1]))
    actions = sorted(r["action"] for r in results)
    assert actions.count("noop") == 3 and [a for a in actions if a != "noop"] == ["seed+chain"], actions
    assert all(r["applied_version"] == latest for r in results)
    assert sum(r["hook_ran"] for r in results) == 1
    with open(hook_log) as f:
        assert len(f.read().splitlines()) == 1  # one host, one refresh of the shared filesystem
    assert_checkpoint_is(local, chain["expected"][latest])
    assert marker_version(local) == latest


def test_threads_pulling_one_host_serialize_on_the_lock(chain, fast_tmp_path):
    local = str(fast_tmp_path / "local")
    hook_calls = []
    results, failures = [], []
    start = threading.Barrier(4)

    def one():
        try:
            start.wait()
            results.append(pull(local, chain["seed"], chain["source"], 4, pre_read_hook=lambda s, v: hook_calls.append(v)))
        except BaseException as e:  # surfaced by the assertion below
            failures.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert sorted(r.action for r in results).count("noop") == 3
    assert hook_calls == [4]
    assert_checkpoint_is(local, chain["expected"][4])


def test_racing_pullers_to_different_targets_each_end_at_a_verified_version(chain, fast_tmp_path):
    """Two waves on one host: pulls to v2 and to the newest race; whichever order the lock
    grants, every pull either succeeds at its target or refuses a backward pull, and the
    local checkpoint ends at a version whose bytes it holds exactly."""
    from weightsync import errors

    local = str(fast_tmp_path / "local")
    outcomes = []
    start = threading.Barrier(4)

    def one(target):
        start.wait()
        try:
            outcomes.append(("ok", target, pull(local, chain["seed"], chain["source"], target).applied_version))
        except errors.BackwardPullError:
            outcomes.append(("backward", target, None))

    threads = [threading.Thread(target=one, args=(t,)) for t in (2, chain["latest"], 2, chain["latest"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 4
    for kind, target, applied in outcomes:
        assert kind == "backward" and target == 2 or applied == target
    final = marker_version(local)
    assert final == chain["latest"]
    assert_checkpoint_is(local, chain["expected"][final])
