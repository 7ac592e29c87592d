"""Shared steps of the e2e live-apply tests on a real sglang server (TP=2 and PP=2 modules).

Role: a module's engine set-up (a tiny model, the allowed root, the version feed), ``/pull_weights``
from the feed, ``/update_weights_from_pulled`` with its expected status, and the set-up every live-apply
fault test starts from: the engine serving the module's newest version with its map proven, and
the next version published (xor) and pulled, not yet applied.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable


def make_model_and_allowed_root(tmp_path_factory: Any, name: str, *gates: str, **model_kw) -> tuple[Path, ...]:
    """-> (root, model, allowed, *gate dirs): a fresh tiny Qwen3 under a new temp root, the engine's allowed
    root with the feed's empty ``shared`` dir, and one empty dir per name in ``gates``."""
    from testbed.tiny_qwen3 import make_tiny_qwen3

    root = tmp_path_factory.mktemp(name)
    model = make_tiny_qwen3(root / "model", **model_kw)
    allowed = root / "allowed"
    (allowed / "shared").mkdir(parents=True)
    made = [root / g for g in gates]
    for d in made:
        d.mkdir()
    return (root, model, allowed, *made)


def feed_env(server: Any, model: Any, allowed: Path, **attrs) -> SimpleNamespace:
    """The module's env: the engine, its local dir under ``allowed`` and a version feed into ``allowed/shared``."""
    from testbed.feed import VersionFeed

    return SimpleNamespace(server=server, model=model, local=str(allowed / "local"),
                           feed=VersionFeed(model, allowed / "shared"), **attrs)


def pull_from_feed(env: Any, version: int):
    return env.server.post("/pull_weights", {"local_checkpoint_dir": env.local, "source_dir": env.feed.source_dir,
                                             "target_version": version})


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
