"""Shared steps of the e2e live-apply tests on a real sglang server (TP=2 and PP=2 modules).

Role: ``/update_weights_from_pulled`` with its expected status, and the set-up every live-apply
fault test starts from: the engine serving the module's newest version with its map proven, and
the next version published (xor) and pulled, not yet applied.
"""

from __future__ import annotations

from typing import Any, Callable


def update_from_pulled(env: Any, version: int, *, status: int = 200) -> dict:
    resp = env.server.post("/update_weights_from_pulled", {"local_checkpoint_dir": env.local, "target_version": version})
    assert resp.status_code == status, resp.text
    return resp.json()


def serve_newest_then_pull_next(env: Any, pull: Callable[[Any, int], Any]) -> tuple[int, int]:
    """-> (the version served, the next version, pulled). ``pull(env, version)`` is the module's pull."""
    from testbed.live import wait_until_map_proven

    top = max(env.feed.expected)  # the module's last version (the test also runs alone: -k)
    if top == 0:
        env.feed.publish(top := 1, encoding="xor")
    assert pull(env, top).status_code == 200
    body = update_from_pulled(env, top)  # the engine serves it from the local dir, whatever it served before
    assert body["success"] and body["weight_version"] == top, body
    wait_until_map_proven(env.server)
    new = top + 1
    env.feed.publish(new, encoding="xor")
    assert pull(env, new).status_code == 200
    return top, new
