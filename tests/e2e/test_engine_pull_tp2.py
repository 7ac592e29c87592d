"""POST /pull_weights against one real sglang 0.5.23 CPU server at TP=2 (shared by the module).

The server runs with an admin API key, allowed roots, the test pre-read hook
(``testbed.hooks.record_pre_read``) and ``--enable-metrics``, so one start covers: the pull +
reload round trip checked against transformers, no-op/reset/backward pulls, a corrupt delta, a
missing version, two concurrent pulls with generation going on (a retry of the running pull
joins it, another target is refused), the hook, auth, path refusals, hostile bodies (a version
that is not a JSON integer, a 100 KB path), a reseed, and the weightsync metrics on ``/metrics``.

CI runs this module against each supported sglang (``make test``: 0.5.23 in ``.venv``, 0.5.16
through ``WEIGHTSYNC_SGLANG_PYTHON``).

The tests run in file order and build on each other (the engine's local checkpoint moves from
version to version); each asserts one behaviour.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from live_apply_support import serve_newest_then_pull_next, update_from_pulled
from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"  # for "is it still serving the same weights" checks
NEW_TOKENS = 8
ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory):
    from testbed.feed import VersionFeed

    root = tmp_path_factory.mktemp("pull_tp2")
    allowed = root / "allowed"
    (allowed / "shared").mkdir(parents=True)
    gate = root / "gate"
    gate.mkdir()
    (gate / "release").touch()  # the hook passes through unless a test removes this
    hook_log = root / "hook_calls.log"
    faults = root / "faults"  # live apply's one-shot fault files (WEIGHTSYNC_TEST_FAULT_DIR)
    faults.mkdir()
    server = server_factory(
        tiny_model_dir,
        tp=2,
        admin_api_key=ADMIN_KEY,
        extra_args=[
            *SERVER_COMPUTE_ARGS,  # fp32 compute: greedy ids equal transformers' exactly
            "--pull-weights-allowed-roots", str(allowed),
            "--custom-pull-weights-pre-read-hook", "testbed.hooks.record_pre_read",
            "--enable-metrics",
        ],
        env={"TESTBED_PRE_READ_HOOK_LOG": str(hook_log), "TESTBED_PRE_READ_HOOK_GATE": str(gate),
             "WEIGHTSYNC_TEST_FAULT_DIR": str(faults)},
    )  # fmt: skip

    class Env:
        pass

    e = Env()
    e.server = server
    e.model = tiny_model_dir
    e.root = root
    e.allowed = allowed
    e.local = str(allowed / "local")
    e.feed = VersionFeed(tiny_model_dir, allowed / "shared")
    e.gate = gate
    e.hook_log = str(hook_log)
    e.faults = faults
    e.v0_ids = server.generate_ids(PROMPT, NEW_TOKENS)
    return e


def pull(env, version, *, local=None, source=None, api_key=None):
    body = {
        "local_checkpoint_dir": local if local is not None else env.local,
        "source_dir": source if source is not None else env.feed.source_dir,
        "target_version": version,
    }
    return env.server.post("/pull_weights", body, api_key=api_key)


def reload(env):
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    return resp


def scrape_metrics(env) -> dict:
    """weightsync's samples on the server's /metrics: {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = env.server.get("/metrics", api_key="")  # sglang serves /metrics without a key
    assert resp.status_code == 200, resp.text[:500]
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name.startswith("weightsync_"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def hook_calls(env):
    from testbed.hooks import read_calls

    return read_calls(env.hook_log)


def check_against_transformers(env, model_dir):
    """The server's greedy ids for the reference prompts equal transformers' for model_dir, exactly."""
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    return assert_server_greedy_equals(env.server.generate_ids, model_dir, max_new_tokens=NEW_TOKENS)


def test_the_server_runs_the_sglang_of_its_interpreter(env, record_property):
    import subprocess

    expected = subprocess.run(
        [env.server.python, "-c", "from importlib.metadata import version; print(version('sglang'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    info = env.server.get("/server_info").json()
    assert info["version"] == expected
    record_property("sglang_version", expected)
    print(f"\n[matrix] sglang {expected} ({env.server.python})")


def test_v0_generation_matches_transformers(env):
    env.v0_served = check_against_transformers(env, env.model)


def test_pull_without_the_admin_key_is_refused_like_update_weights_from_disk(env):
    env.feed.publish(1, encoding="xor")
    resp = pull(env, 1, api_key="")
    assert resp.status_code == 401
    wrong = pull(env, 1, api_key="not-the-key")
    assert wrong.status_code == 401
    builtin = env.server.post("/update_weights_from_disk", {"model_path": env.model}, api_key="")
    assert builtin.status_code == 401
    assert not os.path.exists(env.local)


def test_pull_to_v3_then_reload_serves_exactly_the_v3_weights(env, record_property):
    from testbed.feed import assert_checkpoint_equals

    env.feed.publish(2, encoding="overwrite")
    env.feed.publish(3, encoding="xor")
    calls_before = len(hook_calls(env))

    t0 = time.perf_counter()
    resp = pull(env, 3)
    pull_s = time.perf_counter() - t0
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["success"] is True and body["error_type"] is None
    assert body["applied_version"] == 3
    [host] = body["hosts"]
    assert host["ranks"] == ["dp0/tp0", "dp0/tp1"]
    assert host["action"] == "seed+chain" and host["applied_version"] == 3
    assert_checkpoint_equals(env.local, env.feed.expected[3])
    env.v3_reply = body
    # One host, two TP ranks: the hook ran once (the second rank found the work done).
    assert len(hook_calls(env)) == calls_before + 1

    t0 = time.perf_counter()
    reload(env)
    reload_s = time.perf_counter() - t0
    served = check_against_transformers(env, env.local)
    # v3 is not v0 as far as generation goes: some prompt's output moved ...
    assert any(served[p] != env.v0_served[p] for p in served), "v3 generates exactly what v0 did"
    # ... so v0's outputs do not pass as v3's (the exact check has teeth).
    from testbed.tiny_qwen3 import assert_server_greedy_equals

    with pytest.raises(AssertionError, match="!= transformers'"):
        assert_server_greedy_equals(lambda prompt, n: env.v0_served[prompt], env.local, max_new_tokens=NEW_TOKENS)
    record_property("pull_s", round(pull_s, 3))
    record_property("reload_s", round(reload_s, 3))
    print(f"\n[measured] TP=2 CPU server: pull v0->v3 (seed + 3 deltas) {pull_s:.3f}s, reload {reload_s:.3f}s")


def test_metrics_count_the_successful_pull_its_source_bytes_and_the_reload(env):
    samples = scrape_metrics(env)
    [host] = env.v3_reply["hosts"]
    name = host["host"]
    # The 401s above never reached the route: one pull so far, a success.
    assert metric(samples, "weightsync_pulls_total", outcome="success", error_type="none") == 1
    assert not [k for k, v in samples.items() if k[0] == "weightsync_pulls_total" and ("outcome", "failure") in k[1] and v]
    assert metric(samples, "weightsync_pull_seconds_count", outcome="success") == 1
    assert metric(samples, "weightsync_pull_seconds_sum", outcome="success") == pytest.approx(env.v3_reply["seconds"])
    # Seeded from the engine's own model (not the source dir), then three deltas read from the
    # source dir: exactly their shard files.
    from testbed.feed import shard_nbytes

    shards = sum(shard_nbytes(env.feed.version_dir(v)) for v in (1, 2, 3))
    assert host["source_nbytes"] == shards > 0
    assert metric(samples, "weightsync_pull_source_read_bytes_total", host=name) == shards
    assert metric(samples, "weightsync_applied_version", host=name) == 3
    # The reload from the pulled checkpoint: the engine serves v3, and its pause was timed.
    assert metric(samples, "weightsync_live_weight_version") == 3
    assert metric(samples, "weightsync_weight_update_pause_seconds_count", mode="reload") == 1
    assert metric(samples, "weightsync_weight_update_pause_seconds_sum", mode="reload") > 0
    assert not metric(samples, "weightsync_reseeds_total", host=name)


def test_pull_to_the_current_version_is_a_noop_without_the_hook(env):
    calls_before = len(hook_calls(env))
    resp = pull(env, 3)
    body = resp.json()
    assert resp.status_code == 200, body
    assert body["hosts"][0]["action"] == "noop"
    assert len(hook_calls(env)) == calls_before


def test_backward_pull_is_refused_and_leaves_the_checkpoint(env):
    from testbed.feed import assert_checkpoint_equals

    resp = pull(env, 2)
    body = resp.json()
    assert resp.status_code == 400, body
    assert body["success"] is False and body["error_type"] == "bad_request"
    assert "backwards" in body["message"]
    assert "Traceback" not in resp.text
    assert_checkpoint_equals(env.local, env.feed.expected[3])


def test_metrics_count_the_refused_pull_by_error_type(env):
    samples = scrape_metrics(env)
    name = env.v3_reply["hosts"][0]["host"]
    assert metric(samples, "weightsync_pulls_total", outcome="failure", error_type="bad_request") == 1
    assert metric(samples, "weightsync_pulls_total", outcome="success", error_type="none") == 2  # v3, no-op
    assert metric(samples, "weightsync_pull_seconds_count", outcome="failure") == 1
    # The refusal moved nothing: the host still holds v3, the engine still serves it.
    assert metric(samples, "weightsync_applied_version", host=name) == 3
    assert metric(samples, "weightsync_live_weight_version") == 3
    assert metric(samples, "weightsync_weight_update_pause_seconds_count", mode="reload") == 1


def test_pull_v0_resets_to_the_engine_model_then_forward_again(env):
    from testbed.feed import assert_checkpoint_equals

    resp = pull(env, 0)
    assert resp.status_code == 200, resp.text
    assert resp.json()["applied_version"] == 0
    assert_checkpoint_equals(env.local, env.feed.expected[0])
    # The engine's own model (the seed) is untouched by all of this.
    assert_checkpoint_equals(env.model, env.feed.expected[0])
    resp = pull(env, 3)
    assert resp.status_code == 200, resp.text
    assert_checkpoint_equals(env.local, env.feed.expected[3])


def test_missing_version_is_not_ready_and_touches_nothing_locally(env):
    from testbed.feed import dir_fingerprint

    before = dir_fingerprint(env.local)
    resp = pull(env, 9)
    body = resp.json()
    assert resp.status_code == 404, body
    assert body["error_type"] == "source_not_ready"
    assert dir_fingerprint(env.local) == before


def test_corrupt_delta_is_422_engine_keeps_serving_and_a_republish_recovers(env):
    from testbed.feed import assert_checkpoint_equals, corrupt_delta

    served_v3 = env.server.generate_ids(PROMPT, NEW_TOKENS)
    env.feed.publish(4, encoding="xor")
    corrupt_delta(env.feed.version_dir(4))
    resp = pull(env, 4)
    body = resp.json()
    assert resp.status_code == 422, body
    assert body["error_type"] == "corrupt_artifact"
    assert body["hosts"][0]["success"] is False
    assert "Traceback" not in resp.text
    # The engine was not reloaded: it still serves v3.
    assert env.server.generate_ids(PROMPT, NEW_TOKENS) == served_v3

    env.feed.unpublish(4)
    env.feed.publish(4, encoding="xor")
    resp = pull(env, 4)
    assert resp.status_code == 200, resp.text
    assert_checkpoint_equals(env.local, env.feed.expected[4])
    reload(env)
    check_against_transformers(env, env.local)


def test_a_retry_of_the_running_pull_waits_for_it_another_target_is_refused_and_generation_continues(env):
    env.feed.publish(5, encoding="xor")
    (env.gate / "release").unlink()
    replies: dict = {}

    def run(key):
        replies[key] = pull(env, 5)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    retry = None
    try:
        deadline = time.monotonic() + 60
        while not (env.gate / "started-5").exists():
            assert time.monotonic() < deadline, "the first pull never reached the pre-read hook"
            time.sleep(0.05)

        other = pull(env, 6)
        body = other.json()
        assert other.status_code == 409, body
        assert body["error_type"] == "PullInProgress" and "not queued" in body["message"]
        assert body["target_version"] == 5  # names the pull in progress

        retry = threading.Thread(target=run, args=("retry",))  # same target: waits for it
        retry.start()
        # Generation is answered while the first pull is held inside the hook.
        assert env.server.generate_ids(PROMPT, NEW_TOKENS)
        assert first.is_alive(), "the first pull finished before the checks: they proved nothing"
    finally:
        (env.gate / "release").touch()
        first.join(timeout=120)
        if retry is not None:
            retry.join(timeout=120)
    for key in ("first", "retry"):
        assert replies[key].status_code == 200, replies[key].text
        assert replies[key].json()["applied_version"] == 5
    assert len([c for c in hook_calls(env) if c[2] == 5]) == 1  # one pull ran, not two


def test_paths_outside_the_allowed_roots_are_refused_and_untouched(env, tmp_path):
    outside = tmp_path / "outside-local"
    resp = pull(env, 5, local=str(outside))
    assert resp.status_code == 403, resp.text
    assert resp.json()["error_type"] == "forbidden"
    assert not outside.exists()

    escape = str(env.allowed / ".." / "escaped-local")
    resp = pull(env, 5, local=escape)
    assert resp.status_code == 403, resp.text
    assert not (env.root / "escaped-local").exists()

    link = env.allowed / "link-out"
    link.symlink_to(tmp_path)
    resp = pull(env, 5, local=str(link / "local"))
    assert resp.status_code == 403, resp.text
    assert "symlink" in resp.json()["message"]
    assert not (tmp_path / "local").exists()

    resp = pull(env, 5, source=str(tmp_path))
    assert resp.status_code == 403, resp.text

    resp = pull(env, 5, local="relative/local")
    assert resp.status_code == 400, resp.text


def test_a_malformed_body_is_400_with_the_structured_error(env):
    resp = env.server.post("/pull_weights", {"local_checkpoint_dir": env.local, "target_version": "five"})
    body = resp.json()
    assert resp.status_code == 400, body
    assert body["success"] is False and body["error_type"] == "bad_request"
    assert "source_dir" in body["message"] and "target_version" in body["message"]


def test_a_corrupted_local_tensor_reseeds_and_the_reseed_is_counted(env):
    from testbed.feed import assert_checkpoint_equals, changed_tensor_names, corrupt_local_tensor

    env.feed.publish(6, encoding="xor")
    # A byte of a tensor that v6 changes goes bad on the host's disk (the marker still says v5).
    victim = changed_tensor_names(env.feed.expected[5], env.feed.expected[6])[0]
    corrupt_local_tensor(env.local, victim)
    resp = pull(env, 6)
    body = resp.json()
    assert resp.status_code == 200, body
    [host] = body["hosts"]
    assert host["reseeded"] is True
    assert_checkpoint_equals(env.local, env.feed.expected[6])
    samples = scrape_metrics(env)
    assert metric(samples, "weightsync_reseeds_total", host=host["host"]) == 1
    assert metric(samples, "weightsync_applied_version", host=host["host"]) == 6
    text = env.server.get("/metrics", api_key="").text
    print("\n[metrics]\n" + "\n".join(line for line in text.splitlines() if line.startswith("weightsync_")))


def test_a_target_version_that_is_not_a_json_integer_is_400_not_a_pull(env):
    from testbed.feed import dir_fingerprint

    before = dir_fingerprint(env.local)
    for version in ("5", True, 5.0):
        resp = env.server.post(
            "/pull_weights", {"local_checkpoint_dir": env.local, "source_dir": env.feed.source_dir, "target_version": version}
        )
        assert resp.status_code == 400, (version, resp.text)
        assert resp.json()["error_type"] == "bad_request" and "target_version" in resp.json()["message"]
    assert dir_fingerprint(env.local) == before


def test_a_100kb_path_inside_an_allowed_root_is_a_short_400(env):
    long_local = str(env.allowed) + ("/" + "d" * 200) * 500
    resp = pull(env, 5, local=long_local)
    assert resp.status_code == 400, resp.text[:2000]
    assert resp.json()["error_type"] == "bad_request"
    assert len(resp.content) < 8_000  # the path is cut short, not echoed twice
    assert not os.path.exists(str(env.allowed) + "/" + "d" * 200)


def test_a_routine_not_published_404_writes_no_traceback_to_the_log(env):
    before = env.server.log_text().count("Traceback")
    resp = pull(env, 99)
    assert resp.status_code == 404, resp.text
    log_text = env.server.log_text()  # both ranks logged before they reported
    assert log_text.count("Traceback") == before
    assert "dp0/tp1: v99:" in log_text


# --- live apply on this server's sglang (the 0.5.16 matrix runs this module too) ------------------


def test_a_live_apply_equals_a_reload_and_a_fault_after_the_first_write_rolls_every_rank_back(env):
    """On 0.5.16 every live apply used to fail after its writes (its cache flush takes other
    arguments) and left the new values in place under the old version."""
    from testbed.live import assert_same_weights, weights_digest

    top, new = serve_newest_then_pull_next(env, pull)
    before = weights_digest(env.server)
    ids_before = env.server.generate_ids(PROMPT, NEW_TOKENS)
    (env.faults / "live-apply-fault-dp0_tp1").touch()
    body = update_from_pulled(env, new, status=500)
    assert body["success"] is False and body["mode"] == "live" and body["rolled_back"] is True, body
    assert "injected fault on dp0/tp1" in body["message"] and body["weight_version"] == top
    assert_same_weights(weights_digest(env.server), before)  # both ranks exactly at the previous version
    assert env.server.generate_ids(PROMPT, NEW_TOKENS) == ids_before
    body = update_from_pulled(env, new)  # the staged update was kept: the retry goes live
    assert body["success"] and body["mode"] == "live" and body["weight_version"] == new, body
    assert body["elements_scattered"] > 0
    live = weights_digest(env.server)
    assert {r["live_version"] for r in live.values()} == {new}
    resp = env.server.post("/update_weights_from_disk", {"model_path": env.local})
    assert resp.status_code == 200, resp.text
    assert_same_weights(live, weights_digest(env.server))
