"""A check that fails or cannot run never ends in success (issue 25, point 1, the engine half),
and the reply says how the mode was chosen (issue 28, point 4), on one real sglang CPU server.

Before: a full version lacking a tensor was reloaded, its check raised ``KeyError`` on the
missing tensor, and the reply was 200 ``success: true`` with ``failed_checks: []``.

- A local checkpoint edited after its pull (a shard rewritten without one tensor, the marker
  still naming the version): the update reloads, sglang's loader keeps the old values of the
  missing tensor, the check cannot read it: 500 ``update_check_failed``, the check in
  ``failed_checks``, the live version forgotten; with the shard back, the same call succeeds.
- A full version lacking a tensor, written in the upstream format by a writer of its own
  (safetensors and json only, nothing of ``weightsync``): the puller refuses it (422), or, if it
  is pulled, the update is not a success.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

from tests.e2e.live_apply_support import feed_env, make_model_and_allowed_root, pull_from_feed

pytestmark = pytest.mark.slow

MISSING = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def env(tmp_path_factory, server_factory):
    root, model, allowed = make_model_and_allowed_root(tmp_path_factory, "check_failure")
    server = server_factory(model, tp=1, extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", str(allowed)])
    return feed_env(server, str(model), allowed, root=root)


pull = pull_from_feed


def update(env, version):
    resp = env.server.post("/update_weights_from_pulled", {"local_checkpoint_dir": env.local, "target_version": version})
    return resp.status_code, resp.json()


def shard_of(checkpoint_dir: str, tensor: str) -> str:
    with open(os.path.join(checkpoint_dir, "model.safetensors.index.json")) as f:
        return os.path.join(checkpoint_dir, json.load(f)["weight_map"][tensor])


def rewrite_without(path: str, tensor: str) -> None:
    """The shard, rewritten under a new inode without ``tensor`` (its index still names it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != tensor}
        meta = f.metadata()
    os.unlink(path)
    save_file(kept, path, metadata=meta)


def test_a_reload_whose_check_cannot_read_a_tensor_replies_a_failure_and_forgets_the_live_version(env):
    from testbed.live import wait_until_map_proven, weights_digest

    wait_until_map_proven(env.server)  # the check samples proven parameters only
    env.feed.publish(1, encoding="xor")
    assert pull(env, 1).status_code == 200  # staged live
    shard = shard_of(env.local, MISSING)
    kept = env.root / "kept.safetensors"
    shutil.copy2(shard, kept)
    rewrite_without(shard, MISSING)
    # the seed reloaded by sglang's own route: the staged update is void, the next update reloads
    assert env.server.post("/update_weights_from_disk", {"model_path": env.model}).status_code == 200
    status, body = update(env, 1)
    assert status == 500 and not body["success"] and body["error_type"] == "update_check_failed", body
    assert body["mode"] == "reload" and not body["reloaded_after_check"], body
    failed = body["failed_checks"]
    assert failed and all(c["failed"] for c in failed) and MISSING in failed[0]["detail"], failed
    assert "no published version" in body["message"] and MISSING in body["message"], body["message"]
    assert body["mode_choice"]["by"] == "vote" and body["mode_choice"]["mode"] == "reload", body["mode_choice"]
    ranks = weights_digest(env.server)
    assert all(r["live_version"] is None and "did not hold" in r["live_reason"] for r in ranks.values()), ranks
    # the shard back: the same call reloads, checks and succeeds
    os.unlink(shard)
    shutil.copy2(kept, shard)
    status, body = update(env, 1)
    assert status == 200 and body["success"] and body["weight_version"] == 1 and not body["failed_checks"], body
    assert body["verified_elements"] > 0 and body["mismatches"] == 0, body


def _write_upstream_full_version(source_dir: str, version: int, tensors: dict) -> None:
    """A full version as an upstream writer makes it (docs/FORMAT.md): HF shards and an index
    whose metadata names the version, the index written last; safetensors and json only."""
    from safetensors.torch import save_file

    vdir = os.path.join(source_dir, f"weight_v{version:06d}")
    os.makedirs(vdir)
    names = sorted(tensors)
    weight_map = {}
    for i in range(2):
        fname = f"upstream-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[i::2]}, os.path.join(vdir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names[i::2]})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    tmp = os.path.join(vdir, "model.safetensors.index.json.partial")
    with open(tmp, "w") as f:
        json.dump({"metadata": {"total_size": total, "version": f"{version:06d}"}, "weight_map": weight_map}, f)
    os.replace(tmp, os.path.join(vdir, "model.safetensors.index.json"))


def test_a_full_version_lacking_a_tensor_from_an_upstream_writer_is_never_served_as_a_success(env):
    from testbed.live import weights_digest
    from testbed.tiny_qwen3 import perturb_state_dict

    top = max(env.feed.expected)
    if top == 0:  # the test also runs alone (-k)
        env.feed.publish(top := 1, encoding="xor")
    assert pull(env, top).status_code == 200
    status, body = update(env, top)
    assert status == 200 and body["success"], body
    new = top + 1
    tensors = perturb_state_dict(env.feed.expected[top], new, fraction=0.05)
    del tensors[MISSING]
    _write_upstream_full_version(env.feed.source_dir, new, tensors)
    resp = pull(env, new)
    if resp.status_code == 200:  # pulled: the engine's own check must not let it through
        status, body = update(env, new)
        assert status != 200 and not body["success"], body
        assert any(c["failed"] or c["mismatches"] for c in body["failed_checks"]), body
    else:  # refused by the puller (a typed 422 naming the tensor), the engine untouched
        assert resp.status_code == 422 and MISSING in resp.text, resp.text
        assert {r["live_version"] for r in weights_digest(env.server).values()} == {top}
