"""POST /pull_weights across two sglang "nodes" (``--nnodes 2``, TP=2: one rank per node).

Both nodes run on this machine over loopback, each in its own mount namespace (``unshare -m``
plus bind mounts, so it needs root or CAP_SYS_ADMIN): the same local checkpoint path is a
different real directory on each node, like two hosts' local disks. Node 1 also sees its own copy
of the source dir, which can lag behind (a shared filesystem that has not shown a version yet),
so a failure on node 1 alone can be caused for real.

Findings about sglang 0.5.23 on the CPU: two nodes work with gloo over loopback; node 1 serves
no API but starts a "dummy health check server" on its own ``--port``, so the nodes need
different ports when they share a machine.

Live apply (``/update_weights_from_pulled``) fans out to both nodes the same way: each node
patches its own shard from its own local dir, and after each of two live applies every
parameter on both nodes equals, bit for bit, what a reload of the same local checkpoint gives.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

pytestmark = pytest.mark.slow


def _can_unshare_mounts() -> bool:
    try:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory):
    if not _can_unshare_mounts():
        pytest.skip("needs 'unshare -m' (root or CAP_SYS_ADMIN) to give each node its own local dir")
    from testbed.feed import VersionFeed
    from testbed.sglang_cpu import LOOPBACK, find_free_port

    root = tmp_path_factory.mktemp("pull_two_nodes")
    local = root / "local"  # the path both nodes are asked to write
    shared = root / "shared"  # the path both nodes are asked to read
    node_local = [root / "node0-local", root / "node1-local"]
    node1_shared = root / "node1-shared"  # what node 1 sees at `shared`
    for d in (local, shared, *node_local, node1_shared):
        d.mkdir()
    feed = VersionFeed(tiny_model_dir, shared)

    dist_init_addr = f"{LOOPBACK}:{find_free_port()}"
    common = dict(
        tp=2,
        nnodes=2,
        dist_init_addr=dist_init_addr,
        extra_args=[
            *SERVER_COMPUTE_ARGS,  # fp32 compute: greedy ids equal transformers' exactly
            "--pull-weights-allowed-roots", str(root),
            "--custom-pull-weights-pre-read-hook", "testbed.hooks.record_pre_read",
        ],
    )  # fmt: skip
    hook_logs = [str(root / "hook-node0.log"), str(root / "hook-node1.log")]
    node1 = server_factory(
        tiny_model_dir,
        node_rank=1,
        wait_healthy=False,
        bind_mounts={str(local): str(node_local[1]), str(shared): str(node1_shared)},
        env={"SGLANG_CPU_OMP_THREADS_BIND": "1", "TESTBED_PRE_READ_HOOK_LOG": hook_logs[1]},
        **common,
    )
    node0 = server_factory(
        tiny_model_dir,
        node_rank=0,
        wait_healthy=False,
        bind_mounts={str(local): str(node_local[0])},
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0", "TESTBED_PRE_READ_HOOK_LOG": hook_logs[0]},
        **common,
    )
    node0.wait_healthy()

    class Env:
        pass

    e = Env()
    e.server, e.node1, e.feed = node0, node1, feed
    e.local, e.shared = str(local), str(shared)
    e.node_local, e.node1_shared = node_local, node1_shared
    e.hook_logs = hook_logs
    return e


def hook_call_counts(env):
    """Pre-read hook calls so far on (node 0, node 1)."""
    from testbed.hooks import read_calls

    return [len(read_calls(path)) for path in env.hook_logs]


def sync_node1_view(env, version):
    """Make ``version`` visible in node 1's view of the source dir."""
    shutil.copytree(env.feed.version_dir(version), env.node1_shared / f"weight_v{version:06d}")


def pull(env, version):
    return env.server.post(
        "/pull_weights", {"local_checkpoint_dir": env.local, "source_dir": env.shared, "target_version": version}
    )


def test_pull_reaches_both_nodes_and_both_local_dirs_end_bit_exact(env):
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(1, encoding="xor")
    sync_node1_view(env, 1)
    resp = pull(env, 1)
    body = resp.json()
    assert resp.status_code == 200, body
    assert [h["host"].rsplit("/", 1)[1] for h in body["hosts"]] == ["node0", "node1"]
    assert [h["ranks"] for h in body["hosts"]] == [["dp0/tp0"], ["dp0/tp1"]]
    assert all(h["action"] == "seed+chain" for h in body["hosts"])
    for d in env.node_local:
        assert_checkpoint_equals(d, env.feed.expected[1])
    assert not any((env.node_local[0].parent / "local").iterdir()), "a bind mount leaked"
    assert hook_call_counts(env) == [1, 1]  # once per host per pull with work


def test_a_failure_on_node1_alone_fails_the_reply(env):
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(2, encoding="overwrite")  # not yet visible to node 1
    resp = pull(env, 2)
    body = resp.json()
    assert resp.status_code == 404, body
    assert body["success"] is False and body["error_type"] == "source_not_ready"
    node0, node1 = body["hosts"]
    assert node0["success"] is True and node0["applied_version"] == 2
    assert node1["success"] is False and node1["error_type"] == "source_not_ready"
    assert_checkpoint_equals(env.node_local[0], env.feed.expected[2])
    assert_checkpoint_equals(env.node_local[1], env.feed.expected[1])
    # Both hosts had work; node 1's hook ran too (it is what would refresh a lagging mount).
    assert hook_call_counts(env) == [2, 2]


def test_once_node1_sees_the_version_the_pull_succeeds_and_serves_it(env):
    from testbed.feed import assert_checkpoint_equals
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    v0 = assert_server_greedy_equals(env.server.generate_ids, env.feed.model_dir)  # not reloaded yet
    sync_node1_view(env, 2)
    resp = pull(env, 2)
    body = resp.json()
    assert resp.status_code == 200, body
    assert [h["action"] for h in body["hosts"]] == ["noop", "chain"]
    assert hook_call_counts(env) == [2, 3]  # only node 1 had work
    for d in env.node_local:
        assert_checkpoint_equals(d, env.feed.expected[2])
    # Each node reloads from its own local dir (same path, different directory).
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    v2 = assert_server_greedy_equals(env.server.generate_ids, env.node_local[0])
    assert any(v2[p] != v0[p] for p in v2), "v2 generates exactly what v0 did"


@pytest.mark.parametrize("version,encoding", [(3, "sparse-v1"), (4, "xor")])
def test_a_live_apply_spans_both_nodes_bit_identical_to_a_reload(env, version, encoding):
    from testbed.live import assert_same_weights, wait_until_map_proven, weights_digest
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    # The map is built and proven on a thread after start-up (again after a reload that voided it).
    wait_until_map_proven(env.server)
    env.feed.publish(version, encoding=encoding)
    sync_node1_view(env, version)
    assert pull(env, version).status_code == 200
    before = weights_digest(env.server)
    resp = env.server.post("/update_weights_from_pulled", {"local_checkpoint_dir": env.local, "target_version": version})
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["mode"] == "live" and body["reason"] is None and body["weight_version"] == version, body
    assert [h["host"].rsplit("/", 1)[1] for h in body["hosts"]] == ["node0", "node1"]
    assert [h["ranks"] for h in body["hosts"]] == [["dp0/tp0"], ["dp0/tp1"]]
    assert all(h["mode"] == "live" and h["elements_scattered"] > 0 for h in body["hosts"]), body["hosts"]
    live = weights_digest(env.server)
    assert {rank: r["host"].rsplit("/", 1)[1] for rank, r in live.items()} == {"dp0/tp0": "node0", "dp0/tp1": "node1"}
    for rank, r in live.items():  # each node patched its own shard, in place
        assert r["live_version"] == version and "live apply from" in r["live_reason"], (rank, r["live_reason"])
        assert r["data_ptrs"] == before[rank]["data_ptrs"], rank
        assert r["digests"] != before[rank]["digests"], rank
    assert_server_greedy_equals(env.server.generate_ids, env.node_local[0])
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    assert_same_weights(live, weights_digest(env.server))  # bit for bit what a reload of the same dir gives
