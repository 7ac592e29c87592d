"""POST /pull_weights against a real sglang CPU server with two DP groups, over msgpack IPC.

One server, started with ``sglang serve`` (DP=2, ``SGLANG_USE_PICKLE_IPC=0``, so every message
between the tokenizer, the DP controller and the schedulers goes through sglang's msgpack codec
and our registered types).
The tokenizer fans the pull out to both DP groups and merges their replies: both groups' ranks
appear on the (single) host.
"""

from __future__ import annotations

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory):
    from testbed.feed import VersionFeed

    root = tmp_path_factory.mktemp("pull_dp2")
    server = server_factory(
        tiny_model_dir,
        dp=2,
        entrypoint="serve",  # the plugin's flags through `sglang serve` as well
        extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", str(root)],
        env={"SGLANG_USE_PICKLE_IPC": "0"},
    )

    class Env:
        pass

    e = Env()
    e.server, e.model, e.root = server, tiny_model_dir, root
    e.local = str(root / "local")
    e.feed = VersionFeed(tiny_model_dir, root / "shared")
    return e


def pull(env, version):
    return env.server.post(
        "/pull_weights",
        {"local_checkpoint_dir": env.local, "source_dir": env.feed.source_dir, "target_version": version},
    )


def test_reply_covers_both_dp_groups_over_msgpack_ipc(env):
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(1, encoding="xor")
    env.feed.publish(2, encoding="overwrite")
    resp = pull(env, 2)
    body = resp.json()
    assert resp.status_code == 200, body
    [host] = body["hosts"]
    assert host["ranks"] == ["dp0/tp0", "dp1/tp0"]
    # Both groups pulled on this host; one did the work, the other found it done.
    assert host["action"] == "seed+chain"
    assert_checkpoint_equals(env.local, env.feed.expected[2])


def test_reload_then_both_dp_groups_serve_the_new_weights(env):
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    v0 = assert_server_greedy_equals(env.server.generate_ids, env.model)
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    # Round-robin load balancing: asking each prompt twice reaches both groups.
    v2 = assert_server_greedy_equals(env.server.generate_ids, env.local)
    assert assert_server_greedy_equals(env.server.generate_ids, env.local) == v2
    assert any(v2[p] != v0[p] for p in v2), "v2 generates exactly what v0 did"


def test_a_failure_is_merged_from_both_groups(env):
    resp = pull(env, 7)
    body = resp.json()
    assert resp.status_code == 404, body
    assert body["error_type"] == "source_not_ready"
    [host] = body["hosts"]
    assert host["ranks"] == ["dp0/tp0", "dp1/tp0"] and host["success"] is False


def _digests(env) -> dict:
    resp = env.server.post("/weights_digest", {})
    assert resp.status_code == 200, resp.text
    return {r["rank"]: r["digests"] for r in resp.json()["ranks"]}


def test_a_live_apply_reaches_both_dp_groups_bit_identical_to_a_reload(env):
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    env.feed.publish(3, encoding="sparse-v1")
    assert pull(env, 3).status_code == 200
    before = _digests(env)
    resp = env.server.post("/update_weights_from_pulled", {"local_checkpoint_dir": env.local, "target_version": 3})
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["mode"] == "live" and body["weight_version"] == 3 and body["elements_scattered"] > 0, body
    [host] = body["hosts"]
    assert host["ranks"] == ["dp0/tp0", "dp1/tp0"]  # over msgpack IPC, merged from both groups
    live = _digests(env)
    assert sorted(live) == ["dp0/tp0", "dp1/tp0"] and live != before
    assert live["dp0/tp0"] == live["dp1/tp0"]  # both groups hold the same weights
    assert_server_greedy_equals(env.server.generate_ids, env.local)
    assert_server_greedy_equals(env.server.generate_ids, env.local)  # round robin: the other group
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    assert _digests(env) == live  # untied lm_head, TP=1: bit for bit what a reload gives
