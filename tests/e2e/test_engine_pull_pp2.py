"""POST /pull_weights against one real sglang 0.5.23 CPU server with two pipeline stages (PP=2,
TP=1), shared by the module: every stage's outcome is in the reply, a pull stuck on a hung read
ends at the deadline, a retry of it waits for it, and SIGTERM during a pull answers and exits.

Both stages run on this one host, so they share the local checkpoint and its host lock: the
stage that takes the lock first does the work (and runs the pre-read hook), the other finds it
done. The server runs with a short pull deadline (``--pull-weights-timeout-s``) and a short host
lock timeout, so that a stage can be made to fail on its own (its lock wait times out while the
other stage's hook is slow) and a hung read ends within a test's patience.

The tests run in file order and build on each other; the last one shuts the server down.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from live_apply_support import serve_newest_then_pull_next, update_from_pulled
from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

pytestmark = pytest.mark.slow

DEADLINE_S = 30  # room for a fresh pull helper to start after the hung one is killed
LOCK_TIMEOUT_S = 6
STAGES = ["dp0/pp0/tp0", "dp0/pp1/tp0"]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory):
    from testbed.feed import VersionFeed

    root = tmp_path_factory.mktemp("pull_pp2")
    allowed = root / "allowed"
    (allowed / "shared").mkdir(parents=True)
    gate = root / "gate"
    gate.mkdir()
    (gate / "release").touch()  # the hook passes through unless a test removes this
    control = root / "hook_control.json"
    faults = root / "faults"  # live apply's one-shot fault files (WEIGHTSYNC_TEST_FAULT_DIR)
    faults.mkdir()
    server = server_factory(
        tiny_model_dir,
        pp=2,
        extra_args=[
            *SERVER_COMPUTE_ARGS,
            "--pull-weights-allowed-roots", str(allowed),
            "--custom-pull-weights-pre-read-hook", "testbed.hooks.record_pre_read",
            "--pull-weights-timeout-s", str(DEADLINE_S),
        ],
        env={
            "TESTBED_PRE_READ_HOOK_GATE": str(gate),
            "TESTBED_PRE_READ_HOOK_CONTROL": str(control),
            "WEIGHTSYNC_LOCK_TIMEOUT_S": str(LOCK_TIMEOUT_S),
            "WEIGHTSYNC_TEST_FAULT_DIR": str(faults),
        },
    )  # fmt: skip

    class Env:
        pass

    e = Env()
    e.server = server
    e.local = str(allowed / "local")
    e.feed = VersionFeed(tiny_model_dir, allowed / "shared")
    e.gate = gate
    e.control = control
    e.faults = faults
    return e


def pull(env, version, *, timeout=300.0):
    body = {"local_checkpoint_dir": env.local, "source_dir": env.feed.source_dir, "target_version": version}
    return env.server.post("/pull_weights", body, timeout=timeout)


def wait_for(path, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def start_pull(env, version, into: dict, key: str) -> threading.Thread:
    def run():
        t0 = time.monotonic()
        into[key] = pull(env, version)
        into[key + "_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_pull_reply_lists_the_ranks_of_both_pipeline_stages(env):
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(1, encoding="xor")
    resp = pull(env, 1)
    body = resp.json()
    assert resp.status_code == 200, body
    [host] = body["hosts"]
    assert host["ranks"] == STAGES and host["success"] and host["applied_version"] == 1
    assert_checkpoint_equals(env.local, env.feed.expected[1])


def test_a_failure_on_one_stage_alone_fails_the_reply_and_names_that_stage(env):
    from testbed.feed import assert_checkpoint_equals
    from testbed.hooks import slept_stage

    env.feed.publish(2, encoding="xor")
    # The stage that takes the host lock first reads slowly (it holds the lock); the other gives
    # up waiting for the lock. Which stage arrives first is the scheduler's business, not the
    # test's: the hook says which one slept.
    env.control.write_text(json.dumps({"first_sleeps_s": LOCK_TIMEOUT_S + 6}))
    try:
        resp = pull(env, 2)
    finally:
        env.control.unlink()
    slept = slept_stage(str(env.control))
    body = resp.json()
    assert slept in (0, 1), slept
    assert resp.status_code == 409, body
    assert body["success"] is False and body["error_type"] == "conflict"
    assert f"dp0/pp{1 - slept}/tp0: another pull held" in body["message"], body["message"]
    [host] = body["hosts"]
    assert host["ranks"] == STAGES and host["success"] is False
    # The stage that slept did finish its pull: the bytes are v2, and a retry succeeds on both stages.
    resp = pull(env, 2)
    assert resp.status_code == 200, resp.text
    assert resp.json()["hosts"][0]["ranks"] == STAGES
    assert_checkpoint_equals(env.local, env.feed.expected[2])


def test_a_hung_read_ends_at_the_deadline_a_retry_waits_for_it_and_another_target_is_refused(env):
    import weightsync
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(3, encoding="xor")
    (env.gate / "release").unlink()  # stage 0's read of v3 hangs
    replies: dict = {}
    first = start_pull(env, 3, replies, "first")
    try:
        wait_for(env.gate / "started-3", "the pull never reached the pre-read hook")
        other = pull(env, 4)
        assert other.status_code == 409, other.text
        assert other.json()["error_type"] == "PullInProgress" and other.json()["target_version"] == 3
        retry = start_pull(env, 3, replies, "retry")  # a trainer's retry after its own timeout
        first.join(timeout=DEADLINE_S + 60)
        retry.join(timeout=DEADLINE_S + 60)
        assert not first.is_alive() and not retry.is_alive(), "the pull did not end at its deadline"
        for key in ("first", "retry"):
            body = replies[key].json()
            assert replies[key].status_code == 504, body
            assert body["error_type"] == "pull_timeout" and f"within {DEADLINE_S} s" in body["message"]
            assert body["hosts"][0]["ranks"] == STAGES
        assert replies["first_s"] < DEADLINE_S + 30
        # The marker still names the last verified version while the read hangs.
        assert weightsync.applied_version(env.local) == 2
    finally:
        (env.gate / "release").touch()
    # The abandoned pull finishes late; it reports nothing, and the next pull answers for itself.
    resp = pull(env, 3)
    assert resp.status_code == 200, resp.text
    assert resp.json()["applied_version"] == 3 and resp.json()["hosts"][0]["ranks"] == STAGES
    assert_checkpoint_equals(env.local, env.feed.expected[3])


def test_a_fault_on_stage_1_rolls_both_stages_back_and_the_retry_commits_on_both(env):
    """Stage 0 used to reply success before stage 1 had even seen the request; stage 1 then
    failed, rolled back alone, and the engine served the old weights under the new version."""
    from testbed.live import assert_same_weights, weights_digest

    top, new = serve_newest_then_pull_next(env, pull)
    before = weights_digest(env.server)
    assert sorted(before) == STAGES
    (env.faults / "live-apply-fault-dp0_pp1_tp0").touch()
    body = update_from_pulled(env, new, status=500)
    assert body["success"] is False and body["mode"] == "live" and body["rolled_back"] is True, body
    assert "injected fault on dp0/pp1/tp0" in body["message"] and body["weight_version"] == top, body
    assert body["hosts"][0]["ranks"] == STAGES
    after = weights_digest(env.server)
    assert_same_weights(after, before)  # stage 0 wrote and was restored too
    assert {r["live_version"] for r in after.values()} == {top}
    body = update_from_pulled(env, new)
    assert body["success"] and body["mode"] == "live" and body["weight_version"] == new, body
    assert body["hosts"][0]["ranks"] == STAGES and body["elements_scattered"] > 0
    live = weights_digest(env.server)
    assert {r["live_version"] for r in live.values()} == {new}
    for rank in STAGES:
        assert live[rank]["digests"] != before[rank]["digests"], rank  # each stage holds changed layers
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    assert_same_weights(live, weights_digest(env.server))


def test_every_step_of_a_random_sequence_leaves_both_stages_equal_to_a_reload_of_the_claimed_version(env):
    """Issue 19's model-based differential test on this server (tests/e2e/live_model_support.py):
    pulls, live applies, reloads of another path, new runs, a replaced seed dir, reseeds, faults
    on either stage mid-scatter, killed pull helpers (held at the pre-read hook's gate) and a
    reload that fails on one stage once or twice."""
    from pathlib import Path

    from tests.e2e.live_model_support import run_model_sequences

    ran = run_model_sequences(env.server, root=Path(env.local).parent / "live_model", seed_dir=env.feed.model_dir,
                              local=env.local, faults=env.faults, gate=env.gate, default_seed=1910)
    print(f"\n[measured] live model PP=2: {ran}")
    assert ran["steps"] >= 9 and ran["sequences"] >= 1


def test_sigterm_during_a_pull_answers_it_503_and_the_server_exits(env):
    version = max(env.feed.expected) + 1
    env.feed.publish(version, encoding="xor")
    (env.gate / "release").unlink()
    replies: dict = {}
    thread = start_pull(env, version, replies, "pull")
    try:
        wait_for(env.gate / f"started-{version}", "the pull never reached the pre-read hook")
        t0 = time.monotonic()
        os.kill(env.server.proc.pid, signal.SIGTERM)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the pull got no reply after SIGTERM"
        body = replies["pull"].json()
        assert replies["pull"].status_code == 503, body
        assert body["error_type"] == "unavailable" and "shutting down" in body["message"]
        env.server.proc.wait(timeout=60)
        exited_s = time.monotonic() - t0
    finally:
        (env.gate / "release").touch()
    print(f"\n[measured] SIGTERM mid-pull: 503 after {replies['pull_s']:.1f}s of pull, exit {exited_s:.1f}s after SIGTERM")
    assert exited_s < 30
