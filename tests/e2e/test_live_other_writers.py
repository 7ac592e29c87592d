"""Another writer of the engine's weights during a live apply (issue 28, points 1 and 2), on one
real sglang CPU server at TP=2 (both releases: the Makefile's ``SGLANG_MATRIX_TESTS``).

- sglang's own ``/weights_checker {"action": "reset_tensors"}`` (the RL self-check) after a pull:
  the staged update is void, the next update reloads;
- generation paused (the RL flow): a reload between the vote and the apply, ``reset_tensors``
  between the apply and the commit: every rank reloads the target instead of a "live" success for
  a version the engine does not hold; ``continue_generation`` waits until the transaction is over;
  two updates of our own run one after the other.

The transaction is held between two phases by the test-only gate of ``tokenizer_side``
(``WEIGHTSYNC_TEST_TXN_GATE``: ``hold-<phase>`` / ``at-<phase>``), so the other writer lands in the
window every time. The oracle is a reload of the local checkpoint (``/update_weights_from_disk``).
"""

from __future__ import annotations

import threading
import time

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS, TIED_PADDED_VOCAB

from tests.e2e.live_apply_support import (
    feed_env, make_model_and_allowed_root, pull_from_feed, serve_newest_then_pull_next, update_from_pulled)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory, server_factory):
    root, model, allowed, gate = make_model_and_allowed_root(tmp_path_factory, "live_writers", "txn_gate",
                                                             **TIED_PADDED_VOCAB)
    server = server_factory(
        model, tp=2,
        extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", str(allowed)],
        env={"WEIGHTSYNC_TEST_TXN_GATE": str(gate)},
    )  # fmt: skip
    return feed_env(server, str(model), allowed, gate=gate, root=root)


pull = pull_from_feed


def digests(env) -> dict:
    from testbed.live import weights_digest

    return weights_digest(env.server)


def assert_serves_exactly_a_reload_of(env, version: int) -> None:
    from testbed.live import assert_same_weights

    served = digests(env)
    assert {r["live_version"] for r in served.values()} == {version}, served
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    assert_same_weights(served, digests(env))


def post_ok(env, route: str, body: dict) -> dict:
    resp = env.server.post(route, body)
    assert resp.status_code == 200, (route, resp.text)
    return resp.json() if resp.content else {}


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class HeldTransaction:
    """``/update_weights_from_pulled`` in a thread, held by the gate before ``phase`` is sent."""

    def __init__(self, env, version: int, phase: str) -> None:
        self.env, self.phase = env, phase
        (env.gate / f"at-{phase}").unlink(missing_ok=True)
        (env.gate / f"hold-{phase}").touch()
        self.reply: dict = {}
        self.thread = threading.Thread(target=lambda: self.reply.setdefault("body", update_from_pulled(env, version)))
        self.thread.start()
        wait_for(lambda: (env.gate / f"at-{phase}").exists(), f"the transaction never reached its {phase}")

    def release(self) -> dict:
        (self.env.gate / f"hold-{self.phase}").unlink(missing_ok=True)
        self.thread.join(300)
        assert not self.thread.is_alive(), "the update got no reply"
        return self.reply["body"]


def test_reset_tensors_after_a_pull_voids_the_staged_update_and_the_next_update_reloads(env):
    _, new = serve_newest_then_pull_next(env, pull)  # staged live
    post_ok(env, "/weights_checker", {"action": "reset_tensors"})  # every parameter random
    ranks = digests(env)
    assert {r["live_version"] for r in ranks.values()} == {None}, ranks
    assert all("reset_tensors" in r["live_reason"] for r in ranks.values()), ranks
    body = update_from_pulled(env, new)
    assert body["success"] and body["mode"] == "reload" and body["weight_version"] == new, body
    assert "the live version is unknown" in body["reason"] and "reset_tensors" in body["reason"], body["reason"]
    assert_serves_exactly_a_reload_of(env, new)


def test_a_reload_between_the_vote_and_the_apply_while_paused_makes_every_rank_reload_the_target(env):
    _, new = serve_newest_then_pull_next(env, pull)
    post_ok(env, "/pause_generation", {"mode": "in_place"})
    try:
        held = HeldTransaction(env, new, "apply")  # voted live, nothing written yet
        try:
            # paused, sglang's reload takes no lock: it lands between our vote and our apply
            post_ok(env, "/update_weights_from_disk", {"model_path": env.model})
        finally:
            body = held.release()
    finally:
        post_ok(env, "/continue_generation", {})
    assert body["success"] and body["mode"] == "reload" and body["weight_version"] == new, body
    assert "written by a reload from" in body["reason"] and "nothing applied" in body["reason"], body["reason"]
    assert "could not be restored" in body["reason"], body["reason"]
    assert_serves_exactly_a_reload_of(env, new)


def test_reset_tensors_between_the_apply_and_the_commit_while_paused_reloads_and_continue_generation_waits(env):
    _, new = serve_newest_then_pull_next(env, pull)
    post_ok(env, "/pause_generation", {"mode": "in_place"})
    resumed: dict = {}
    resumer = None
    try:
        (env.gate / "continue-waiting").unlink(missing_ok=True)
        held = HeldTransaction(env, new, "commit")  # every rank applied, nothing committed yet
        try:
            post_ok(env, "/weights_checker", {"action": "reset_tensors"})
            resumer = threading.Thread(target=lambda: resumed.setdefault("resp", env.server.post("/continue_generation", {})))
            resumer.start()
            wait_for(lambda: (env.gate / "continue-waiting").exists(), "continue_generation never reached the lock")
            assert resumer.is_alive() and not resumed  # blocked on the transaction: serving has not resumed
        finally:
            body = held.release()
    finally:
        if resumer is not None:
            resumer.join(120)
        else:
            post_ok(env, "/continue_generation", {})
    assert resumed["resp"].status_code == 200, resumed["resp"].text
    assert body["success"] and body["mode"] == "reload" and body["weight_version"] == new, body
    assert body["reloaded_after_check"] and "reset_tensors" in body["reason"], body
    assert "between the apply and the commit" in body["reason"], body["reason"]
    assert_serves_exactly_a_reload_of(env, new)


def test_two_paused_updates_of_our_own_run_one_after_the_other_and_both_succeed(env):
    """Paused, sglang's writer lock is not taken: without a lock of our own, the second update's
    vote replaced the first's transaction on every rank and the first's commit failed."""
    _, new = serve_newest_then_pull_next(env, pull)
    post_ok(env, "/pause_generation", {"mode": "in_place"})
    second: dict = {}
    waiter = None
    try:
        (env.gate / "txn-waiting").unlink(missing_ok=True)
        held = HeldTransaction(env, new, "commit")  # the first: applied, not committed
        try:
            waiter = threading.Thread(target=lambda: second.setdefault("body", update_from_pulled(env, new)))
            waiter.start()
            wait_for(lambda: (env.gate / "txn-waiting").exists(), "the second update never reached the lock")
        finally:
            first = held.release()
            if waiter is not None:
                waiter.join(300)
    finally:
        post_ok(env, "/continue_generation", {})
    assert first["success"] and first["mode"] == "live" and first["weight_version"] == new, first
    body = second["body"]  # after the first committed: already serving it, nothing to write
    assert body["success"] and body["weight_version"] == new and body["elements_scattered"] == 0, body
    assert_serves_exactly_a_reload_of(env, new)
