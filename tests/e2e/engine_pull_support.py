"""Shared steps of the e2e tests where a real sglang engine pulls a publisher's chain through
``POST /pull_weights`` (from a bucket, from an HTTP(S) source): the trainer publishes perturbed
versions of the tiny model, the engine pulls them, serves them and chains the next one.

``env`` carries ``server``, ``model`` (the seed dir), ``local`` (the engine's local dir), ``url`` (the
source), ``publisher`` and ``expected`` (version -> the trainer's tensors).
"""

from __future__ import annotations

from typing import Any


def publish(env: Any, version: int, **kw) -> None:
    from testbed.tiny_qwen3 import perturb_state_dict, to_raw_tensors

    tensors = perturb_state_dict(env.expected[version - 1], version, fraction=0.05, seed=0)
    env.publisher.publish(version, to_raw_tensors(tensors), **kw)
    env.expected[version] = tensors


def pull(env: Any, version: int, source: str | None = None):
    return env.server.post(
        "/pull_weights",
        {"local_checkpoint_dir": env.local, "source_dir": source or env.url, "target_version": version},
    )


def publish_and_pull_v2(env: Any) -> None:
    """A full v1 and a delta v2 published; the engine's pull leaves exactly the trainer's v2 tensors."""
    from testbed.feed import assert_checkpoint_equals

    publish(env, 1, full=True)
    publish(env, 2)
    resp = pull(env, 2)
    assert resp.status_code == 200, resp.text
    assert_checkpoint_equals(env.local, env.expected[2])


def serve_v2_then_chain_v3(env: Any) -> None:
    """The engine reloads the pulled v2 and generates what transformers does from it (not what v0 did);
    then v3 is pulled as one delta chained onto the local v2."""
    from testbed.feed import assert_checkpoint_equals
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    v0 = assert_server_greedy_equals(env.server.generate_ids, env.model)
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    v2 = assert_server_greedy_equals(env.server.generate_ids, env.local)
    assert any(v2[p] != v0[p] for p in v2), "v2 generates exactly what v0 did"
    publish(env, 3)
    resp = pull(env, 3)
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["hosts"][0]["action"] == "chain"  # one delta fetched onto the local v2
    assert_checkpoint_equals(env.local, env.expected[3])


def assert_a_version_not_published_yet_is_not_ready(env: Any) -> None:
    resp = pull(env, 9)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error_type"] == "source_not_ready"
