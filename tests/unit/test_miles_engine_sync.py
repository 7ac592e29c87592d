"""The engine side of a sync: call order, live apply and its fallbacks, the baseline, retries.

An in-process HTTP engine double records each call (order and body) and answers from a script;
it exists only to cause faults and observe order (and to stand for the engine's
``/update_weights_from_pulled`` contract where a fault on it is needed). The real sglang server
is exercised in tests/e2e/test_trainer_e2e.py.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from miles_updater.engine_sync import APPLY_MODES, EngineSync, SyncHistory, SyncMetrics, as_engine_group
from miles_updater.engines import (
    EngineCallError,
    EngineSyncError,
    EngineTimeouts,
    SGLangEngineClient,
    ThreadEngineGroup,
)

from http_support import answer_json, serve_on_loopback

CALLS: list = []  # (engine, path, body, time) across engines, in arrival order


class EngineDouble:
    """A loopback HTTP server answering sglang's control calls from a per-path script."""

    def __init__(self, name: str):
        self.name = name
        self.script: dict[str, list[tuple[int, dict]]] = {}
        self.pull_gate = None  # a callable run inside the pull handler before it answers
        self.delay: dict[str, float] = {}  # path -> seconds the answer takes (a slow engine)
        self.has_live_route = True
        self.weight_version = "default"
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/model_info":
                    answer_json(self, 200, {"model_path": "/local/ckpt", "weight_version": outer.weight_version})
                else:
                    answer_json(self, 404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw and raw != b"null" else None
                path = self.path.split("?")[0]
                CALLS.append((outer.name, path, body, time.monotonic()))
                if path == "/pull_weights" and outer.pull_gate is not None:
                    outer.pull_gate()
                time.sleep(outer.delay.get(path, 0.0))
                queue = outer.script.get(path) or []
                status, reply = queue.pop(0) if queue else (200, {"success": True})
                if path == "/update_weights_from_pulled" and not outer.has_live_route:
                    status, reply = 404, {"detail": "Not Found"}  # FastAPI's answer for an unknown route
                elif status == 200 and reply == {"success": True}:
                    reply = outer.default_reply(path, body)
                if status == 200 and path in ("/update_weights_from_pulled", "/update_weights_from_disk"):
                    outer.weight_version = str(body.get("target_version", body.get("weight_version")))
                answer_json(self, status, reply)

        self.server, self.thread, self.url = serve_on_loopback(Handler)

    @staticmethod
    def default_reply(path: str, body: dict) -> dict:
        if path == "/pull_weights":
            return {"success": True, "applied_version": body["target_version"], "action": "chain",
                    "reason": "double", "seconds": 0.0}
        if path == "/update_weights_from_pulled":
            return {"success": True, "mode": "live", "reason": "", "message": "applied",
                    "weight_version": str(body["target_version"]), "elements_scattered": 123, "pause_s": 0.01,
                    "rolled_back": False, "hosts": []}
        return {"success": True}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def doubles():
    CALLS.clear()
    ds = [EngineDouble("e0"), EngineDouble("e1")]
    yield ds
    for d in ds:
        d.close()


def make_sync(doubles, **kw):
    retry_s = kw.pop("retry_s", 5)
    clients = [SGLangEngineClient(d.url, name=d.name, timeout_s=5, not_ready_retry_s=retry_s,
                                  backoff_initial_s=0.01) for d in doubles]
    return EngineSync(ThreadEngineGroup(clients), source_dir="/shared/run-x", local_checkpoint_dir="/local/ckpt", **kw)


def paths_of(engine):
    return [p for e, p, _, _ in CALLS if e == engine]


def test_sync_calls_engines_in_order_pull_pause_apply_continue(doubles):
    hook_calls = []
    sync = make_sync(doubles, post_write_hook=lambda args, vdir, engines: hook_calls.append((args, vdir, len(CALLS))),
                     hook_args="ARGS")
    m = sync.update(3, "/shared/run-x/weight_v000003", SyncMetrics(version=3))
    for d in doubles:
        assert paths_of(d.name) == ["/pull_weights", "/pause_generation", "/update_weights_from_pulled",
                                    "/continue_generation"]
    # The hook runs before any engine call; every pull precedes every pause.
    assert hook_calls == [("ARGS", "/shared/run-x/weight_v000003", 0)]
    order = [p for _, p, _, _ in CALLS]
    assert max(i for i, p in enumerate(order) if p == "/pull_weights") < min(
        i for i, p in enumerate(order) if p == "/pause_generation")
    bodies = {p: b for e, p, b, _ in CALLS if e == "e0"}
    assert bodies["/pull_weights"] == {"local_checkpoint_dir": "/local/ckpt", "source_dir": "/shared/run-x",
                                       "target_version": 3}
    assert bodies["/update_weights_from_pulled"] == {"local_checkpoint_dir": "/local/ckpt", "target_version": 3,
                                                     "flush_cache": True}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert [p["engine"] for p in m.pulls] == ["e0", "e1"]
    assert m.apply_mode == "live" and m.elements_scattered == 2 * 123
    assert [a["engine_pause_s"] for a in m.applies] == [0.01, 0.01]
    assert m.pause_s >= m.apply_s > 0


def test_reload_mode_flushes_the_cache_once_inside_the_reload(doubles):
    m = make_sync(doubles, apply_mode="reload").update(3, "/v", SyncMetrics(version=3))
    for d in doubles:
        assert paths_of(d.name) == ["/pull_weights", "/pause_generation", "/update_weights_from_disk",
                                    "/continue_generation"]
    body = next(b for e, p, b, _ in CALLS if p == "/update_weights_from_disk")
    assert body == {"model_path": "/local/ckpt", "flush_cache": True, "weight_version": "3"}
    assert m.apply_mode == "reload" and m.elements_scattered == 0
    assert {a["reason"] for a in m.applies} == {"--update-weight-apply reload"}


def test_failed_live_apply_falls_back_to_a_reload_in_the_same_pause(doubles):
    doubles[1].script["/update_weights_from_pulled"] = [
        (500, {"success": False, "error_type": "internal_error", "message": "scatter failed on dp0/tp1",
               "rolled_back": True})]
    m = make_sync(doubles).update(2, "/v", SyncMetrics(version=2))
    assert paths_of("e0") == ["/pull_weights", "/pause_generation", "/update_weights_from_pulled",
                              "/continue_generation"]
    assert paths_of("e1") == ["/pull_weights", "/pause_generation", "/update_weights_from_pulled",
                              "/update_weights_from_disk", "/continue_generation"]
    assert m.apply_mode == "mixed" and [a["mode"] for a in m.applies] == ["live", "reload"]
    assert "scatter failed on dp0/tp1" in m.applies[1]["reason"]
    assert doubles[1].weight_version == "2"


def test_live_reply_naming_another_weight_version_is_not_trusted(doubles):
    doubles[0].script["/update_weights_from_pulled"] = [
        (200, {"success": True, "mode": "live", "weight_version": "1", "elements_scattered": 5})]
    m = make_sync(doubles).update(2, "/v", SyncMetrics(version=2))
    assert "/update_weights_from_disk" in paths_of("e0")
    assert "weight version '1' after applying v2" in m.applies[0]["reason"]


def test_engine_reloading_by_itself_reports_reload_with_its_reason(doubles):
    doubles[0].script["/update_weights_from_pulled"] = [
        (200, {"success": True, "mode": "reload", "reason": "a full version in the chain", "weight_version": "4",
               "elements_scattered": 0, "pause_s": 0.3})]
    m = make_sync(doubles).update(4, "/v", SyncMetrics(version=4))
    assert "/update_weights_from_disk" not in paths_of("e0")
    assert m.applies[0] == dict(engine="e0", mode="reload", call="update_weights_from_pulled",
                                reason="a full version in the chain", elements_scattered=0, engine_pause_s=0.3,
                                call_s=None)


def test_engine_without_the_live_route_is_reloaded_and_remembered_in_auto(doubles):
    doubles[0].has_live_route = False
    sync = make_sync(doubles)
    for v in (1, 2):
        m = sync.update(v, "/v", SyncMetrics(version=v))
        assert [a["mode"] for a in m.applies] == ["reload", "live"]
        assert doubles[0].weight_version == str(v)
    # Asked once; the second sync went straight to the reload.
    assert paths_of("e0").count("/update_weights_from_pulled") == 1
    assert paths_of("e0").count("/update_weights_from_disk") == 2
    assert "has no /update_weights_from_pulled" in m.applies[0]["reason"]


def test_live_mode_tries_the_live_route_on_every_sync(doubles):
    doubles[0].has_live_route = False
    sync = make_sync(doubles, apply_mode="live")
    for v in (1, 2):
        sync.update(v, "/v", SyncMetrics(version=v))
    assert paths_of("e0").count("/update_weights_from_pulled") == 2
    assert paths_of("e0").count("/update_weights_from_disk") == 2


def test_unknown_apply_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="not one of auto, live, reload"):
        EngineSync(ThreadEngineGroup([]), source_dir="/s", local_checkpoint_dir="/l", apply_mode="fast")
    from miles_updater.args import APPLY_MODES as FLAG_CHOICES

    assert FLAG_CHOICES == APPLY_MODES


def test_reload_failing_after_a_failed_live_apply_fails_the_sync_and_resumes(doubles):
    doubles[0].script["/update_weights_from_pulled"] = [(500, {"success": False, "message": "boom"})]
    doubles[0].script["/update_weights_from_disk"] = [(400, {"success": False, "message": "shape mismatch"})]
    with pytest.raises(EngineSyncError, match="engine e0: update_weights_from_disk failed.*shape mismatch"):
        make_sync(doubles).update(1, "/v", SyncMetrics(version=1))
    for d in doubles:
        assert paths_of(d.name)[-1] == "/continue_generation"


def test_weight_version_is_read_from_model_info(doubles):
    client = SGLangEngineClient(doubles[0].url, name="e0", timeout_s=5)
    assert client.weight_version() == "default"
    make_sync(doubles).update(7, "/v", SyncMetrics(version=7))
    assert client.weight_version() == "7"


def test_pulls_run_concurrently_on_every_engine(doubles):
    # Each pull answers only once both engines' pulls have arrived: one at a time would time out.
    both_arrived = threading.Barrier(2, timeout=20)
    for d in doubles:
        d.pull_gate = both_arrived.wait
    m = make_sync(doubles).update(1, "/v", SyncMetrics(version=1))
    assert [p["applied_version"] for p in m.pulls] == [1, 1]
    assert not both_arrived.broken


@pytest.mark.parametrize("apply_mode,call", [("auto", "/update_weights_from_pulled"),
                                              ("reload", "/update_weights_from_disk")])
def test_in_place_pause_skips_flush_and_keeps_the_cache(doubles, apply_mode, call):
    make_sync(doubles, pause_mode="in_place", apply_mode=apply_mode).update(1, "/v", SyncMetrics(version=1))
    assert paths_of("e0") == ["/pull_weights", "/pause_generation", call, "/continue_generation"]
    body = next(b for e, p, b, _ in CALLS if p == call)
    assert body["flush_cache"] is False


def test_baseline_sends_version_0_without_waiting_and_the_first_sync_waits_for_it(doubles):
    # The baseline pulls answer only after start_baseline has returned: had it waited, it would hang.
    returned, released = threading.Event(), []
    for d in doubles:
        d.pull_gate = lambda: released.append(returned.wait(20))
    sync = make_sync(doubles)
    sync.start_baseline()
    returned.set()
    m = sync.update(1, "/v", SyncMetrics(version=1))
    assert sorted((e, b["target_version"]) for e, p, b, _ in CALLS if p == "/pull_weights") == [
        ("e0", 0), ("e0", 1), ("e1", 0), ("e1", 1)]
    # Every engine's v1 pull came after its baseline answered (the sync waited for it).
    assert [b["target_version"] for e, p, b, _ in CALLS if e == "e0" and p == "/pull_weights"] == [0, 1]
    assert released == [True] * 4  # released by start_baseline's return, not by the timeout
    assert m.baseline_errors == {} and sync.baseline_results is not None


def test_source_not_ready_is_retried_with_backoff(doubles):
    not_ready = (404, {"success": False, "error_type": "source_not_ready", "message": "weight_v000002 has no index"})
    doubles[0].script["/pull_weights"] = [not_ready, not_ready]
    m = make_sync(doubles).update(2, "/v", SyncMetrics(version=2))
    assert paths_of("e0").count("/pull_weights") == 3
    assert paths_of("e1").count("/pull_weights") == 1
    assert m.pulls[0]["applied_version"] == 2


def test_source_never_ready_fails_naming_the_engine(doubles):
    not_ready = (404, {"success": False, "error_type": "source_not_ready", "message": "no index yet"})
    doubles[1].script["/pull_weights"] = [not_ready] * 100
    with pytest.raises(EngineSyncError, match=r"engine e1: pull_weights failed \(HTTP 404 source_not_ready\).*"
                                              r"still not ready"):
        make_sync(doubles, retry_s=0.3).update(2, "/v", SyncMetrics(version=2))
    # The sync stopped before touching generation.
    assert "/pause_generation" not in paths_of("e0")


def test_corrupt_artifact_is_not_retried(doubles):
    doubles[0].script["/pull_weights"] = [
        (422, {"success": False, "error_type": "corrupt_artifact", "message": "digest mismatch in q_proj"})]
    with pytest.raises(EngineSyncError) as info:
        make_sync(doubles).update(2, "/v", SyncMetrics(version=2))
    err = info.value.errors["e0"]
    assert isinstance(err, EngineCallError) and err.error_type == "corrupt_artifact" and err.status == 422
    assert "engine e0" in str(info.value) and "digest mismatch in q_proj" in str(info.value)
    assert paths_of("e0").count("/pull_weights") == 1


def test_failed_reload_still_resumes_generation_and_names_the_engine(doubles):
    doubles[1].script["/update_weights_from_disk"] = [(400, {"success": False, "message": "shape mismatch"})]
    with pytest.raises(EngineSyncError, match="engine e1: update_weights_from_disk failed.*shape mismatch"):
        make_sync(doubles, apply_mode="reload").update(1, "/v", SyncMetrics(version=1))
    for d in doubles:
        assert paths_of(d.name)[-1] == "/continue_generation"


def test_missing_plugin_endpoint_says_so(doubles):
    doubles[0].script["/pull_weights"] = [(404, {"detail": "Not Found"})]
    with pytest.raises(EngineSyncError, match="no /pull_weights endpoint: is the sglang_patch plugin installed"):
        make_sync(doubles).update(1, "/v", SyncMetrics(version=1))


def test_unreachable_engine_fails_with_its_name():
    client = SGLangEngineClient("http://127.0.0.1:9", name="dead", timeout_s=1)
    with pytest.raises(EngineCallError, match="engine dead: pause_generation failed \\(no reply\\): cannot reach"):
        client.pause_generation()


def test_failed_baseline_is_logged_and_the_first_sync_goes_on(doubles, caplog):
    doubles[1].script["/pull_weights"] = [
        (500, {"success": False, "error_type": "local_state_corrupt", "message": "disk full while seeding"})]
    sync = make_sync(doubles)
    sync.start_baseline()
    with caplog.at_level("WARNING", logger="miles_updater.engine_sync"):
        m = sync.update(1, "/v", SyncMetrics(version=1))
    assert "baseline pull_weights(0) failed on 1 engine(s)" in caplog.text and "disk full while seeding" in caplog.text
    assert list(m.baseline_errors) == ["e1"]
    assert [p["applied_version"] for p in m.pulls] == [1, 1]
    assert paths_of("e1") == ["/pull_weights", "/pull_weights", "/pause_generation", "/update_weights_from_pulled",
                              "/continue_generation"]


def _in_progress(target):
    return (409, {"success": False, "error_type": "PullInProgress", "target_version": target,
                  "message": f"a pull to v{target} is still running"})


def test_same_target_pull_still_running_is_waited_for(doubles):
    doubles[0].script["/pull_weights"] = [_in_progress(4), _in_progress(4)]
    m = make_sync(doubles).update(4, "/v", SyncMetrics(version=4))
    assert paths_of("e0").count("/pull_weights") == 3
    assert m.pulls[0]["applied_version"] == 4


def test_pull_in_progress_to_another_target_is_a_failure(doubles):
    doubles[0].script["/pull_weights"] = [_in_progress(3)]
    with pytest.raises(EngineSyncError, match=r"engine e0: pull_weights failed \(HTTP 409 PullInProgress\)"):
        make_sync(doubles).update(4, "/v", SyncMetrics(version=4))
    assert paths_of("e0") == ["/pull_weights"]


def test_plain_conflict_is_a_failure(doubles):
    doubles[0].script["/pull_weights"] = [(409, {"success": False, "error_type": "conflict", "target_version": 4,
                                                 "message": "another pull (to v3) is still running"})]
    with pytest.raises(EngineSyncError, match="HTTP 409 conflict"):
        make_sync(doubles).update(4, "/v", SyncMetrics(version=4))


def test_same_target_pull_in_progress_is_waited_for_only_up_to_the_pull_timeout(doubles):
    doubles[0].script["/pull_weights"] = [_in_progress(4)] * 1000
    client = SGLangEngineClient(doubles[0].url, name="e0", pull_timeout_s=0.3, backoff_initial_s=0.01,
                                backoff_max_s=0.05)
    with pytest.raises(EngineCallError, match=r"still running \(an earlier request's pull to the same version\) after"):
        client.pull_weights("/local/ckpt", "/shared/run-x", 4)


def test_closing_a_thread_group_ends_its_threads(doubles):
    def engine_threads():
        return {t for t in threading.enumerate() if t.name.startswith("engine-call")}

    before = engine_threads()  # other tests' groups may still hold (and drop) threads
    for _ in range(3):
        sync = make_sync(doubles, owns_engines=True)
        sync.update(1, "/v", SyncMetrics(version=1))
        started = engine_threads() - before
        assert started
        sync.close()
        assert not any(t.is_alive() for t in started)


# --- a failed sync tells the truth about the fleet (issue 21 point 5) ------------------------------


def _calls_since(mark: int, engine: str) -> list:
    return [(p, (b or {}).get("target_version")) for e, p, b, _ in CALLS[mark:] if e == engine]


def test_a_failed_apply_on_one_engine_says_which_version_each_serves_and_the_next_sync_brings_it_up_first(doubles):
    sync = make_sync(doubles)
    m1 = sync.update(1, "/v1", SyncMetrics(version=1))
    assert m1.served == {"e0": 1, "e1": 1}
    # v2: e1 can apply it neither live nor by a reload; e0 applies it.
    doubles[1].script["/update_weights_from_pulled"] = [(500, {"success": False, "message": "boom"})]
    doubles[1].script["/update_weights_from_disk"] = [(400, {"success": False, "message": "shape mismatch"})]
    with pytest.raises(EngineSyncError) as info:
        sync.update(2, "/v2", SyncMetrics(version=2))
    err = info.value
    assert list(err.errors) == ["e1"] and err.version == 2
    assert err.served == {"e0": 2, "e1": 1}  # e1 said so itself (GET /model_info)
    assert err.metrics.served == err.served and [a["engine"] for a in err.metrics.applies] == []
    assert "Engines now serve: e0 v2, e1 v1 (the sync was bringing them to v2)" in str(err)
    assert sync.lagging() == ["e1"]
    for d in doubles:  # both generate again
        assert paths_of(d.name)[-1] == "/continue_generation"
    # The next sync brings e1 to v2 first (only it pauses for that), then both to v3.
    mark = len(CALLS)
    m3 = sync.update(3, "/v3", SyncMetrics(version=3))
    assert _calls_since(mark, "e1") == [
        ("/pull_weights", 2), ("/pause_generation", None), ("/update_weights_from_pulled", 2), ("/continue_generation", None),
        ("/pull_weights", 3), ("/pause_generation", None), ("/update_weights_from_pulled", 3), ("/continue_generation", None)]
    assert _calls_since(mark, "e0") == [
        ("/pull_weights", 3), ("/pause_generation", None), ("/update_weights_from_pulled", 3), ("/continue_generation", None)]
    assert m3.caught_up == {"e1": 2} and m3.served == {"e0": 3, "e1": 3} and sync.lagging() == []


def test_a_failed_pull_leaves_every_engine_serving_what_it_did_and_says_so(doubles):
    sync = make_sync(doubles)
    sync.update(1, "/v1", SyncMetrics(version=1))
    doubles[0].script["/pull_weights"] = [
        (422, {"success": False, "error_type": "corrupt_artifact", "message": "digest mismatch"})]
    with pytest.raises(EngineSyncError) as info:
        sync.update(2, "/v2", SyncMetrics(version=2))
    assert info.value.served == {"e0": 1, "e1": 1} and info.value.version == 2
    assert all("/pause_generation" not in [p for p, _ in _calls_since(0, d.name)][2:] for d in doubles)


def test_an_engine_that_cannot_say_its_version_after_a_failure_is_unknown_and_caught_up(doubles):
    sync = make_sync(doubles, apply_mode="reload")
    sync.update(1, "/v1", SyncMetrics(version=1))
    doubles[1].script["/update_weights_from_disk"] = [(500, {"success": False, "message": "oom while loading"})]
    doubles[1].weight_version = "default"  # the engine no longer names a version
    with pytest.raises(EngineSyncError) as info:
        sync.update(2, "/v2", SyncMetrics(version=2))
    assert info.value.served == {"e0": 2, "e1": None}
    assert "e1 unknown" in str(info.value)
    m = sync.update(3, "/v3", SyncMetrics(version=3))
    assert m.caught_up == {"e1": 2} and m.served == {"e0": 3, "e1": 3}


def test_the_sync_error_keeps_what_it_carries_through_pickling():
    import pickle

    err = EngineSyncError("update_weights_from_disk", {"e1": RuntimeError("x")}, served={"e0": 2, "e1": 1}, version=2)
    again = pickle.loads(pickle.dumps(err))
    assert (again.served, again.version, str(again)) == (err.served, err.version, str(err))


# --- the timeout flags reach the clients (issue 28 point 13) ----------------------------------------


@pytest.mark.parametrize("given", ["urls", "clients"])
def test_the_timeout_flags_reach_every_engine_client_however_the_engines_were_given(doubles, given):
    timeouts = EngineTimeouts(engine_timeout_s=0.3, pull_timeout_s=5.0, not_ready_retry_s=0.2)
    # Clients built by the caller keep their own defaults (120 s, 60 s of "not ready") until set.
    engines = [d.url for d in doubles] if given == "urls" else [SGLangEngineClient(d.url, name=d.name) for d in doubles]
    group, owned = as_engine_group(engines, [d.name for d in doubles], timeouts=timeouts)
    sync = EngineSync(group, source_dir="/shared/run-x", local_checkpoint_dir="/local/ckpt", owns_engines=owned)
    not_ready = (404, {"success": False, "error_type": "source_not_ready", "message": "no index yet"})
    doubles[1].script["/pull_weights"] = [not_ready] * 1000
    with pytest.raises(EngineSyncError, match=r"engine e1: pull_weights failed .*still not ready after \d+ attempts "
                                              r"over 0.2s"):
        sync.update(1, "/v1", SyncMetrics(version=1))
    doubles[1].script["/pull_weights"] = []
    doubles[0].delay["/pause_generation"] = 1.0  # past the flag's 0.3 s, far within a client default
    with pytest.raises(EngineSyncError, match=r"engine e0: pause_generation failed \(no reply\): no reply within 0.3s"):
        sync.update(1, "/v1", SyncMetrics(version=1))
    assert paths_of("e0")[-1] == "/continue_generation"
    sync.close()


# --- the metrics kept stay bounded (issue 28 point 14) ----------------------------------------------


def _metrics_of_a_sync_at_64_engines(version: int) -> SyncMetrics:
    names = [f"engine{i}" for i in range(64)]
    m = SyncMetrics(version=version, kind="delta", wire_nbytes=1000, pause_s=0.5, total_s=2.0, apply_mode="live",
                    elements_scattered=64)
    m.pulls = [dict(engine=n, applied_version=version, seconds=1.5, actions=["chain"], nbytes_read=1 << 20,
                    message=f"pulled v{version} " + "x" * 200) for n in names]
    m.applies = [dict(engine=n, mode="live", call="update_weights_from_pulled", reason="", elements_scattered=1,
                      engine_pause_s=0.01, call_s=None) for n in names]
    m.served = {n: version for n in names}
    return m


def test_a_sync_history_keeps_the_last_n_syncs_and_totals_of_all_in_bounded_memory():
    import tracemalloc

    def held_nbytes() -> int:  # what the metrics built here still hold (other threads' allocations aside)
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, __file__)])
        return sum(stat.size for stat in snapshot.statistics("filename"))

    history = SyncHistory(size=8)
    tracemalloc.start()
    try:
        before = held_nbytes()
        one = _metrics_of_a_sync_at_64_engines(0)
        one_sync_nbytes = held_nbytes() - before
        del one
        for v in range(1, 101):
            history.append(_metrics_of_a_sync_at_64_engines(v))
        after_100 = held_nbytes()
        for v in range(101, 2001):
            history.append(_metrics_of_a_sync_at_64_engines(v))
        after_2000 = held_nbytes()
    finally:
        tracemalloc.stop()
    assert one_sync_nbytes > 20_000  # the metrics the issue measured: tens of KiB per sync
    assert after_2000 - after_100 < one_sync_nbytes  # 1900 more syncs cost less than one more sync's metrics
    assert len(history) == 8 and [m.version for m in history] == list(range(1993, 2001))
    assert history[-1].version == 2000 and [m.version for m in history[-2:]] == [1999, 2000]
    t = history.totals
    assert (t.syncs, t.first_version, t.last_version, t.wire_nbytes) == (2000, 1, 2000, 2_000_000)
    assert t.kinds == {"delta": 2000} and t.apply_modes == {"live": 2000} and t.max_pause_s == 0.5


def test_a_sync_history_of_no_syncs_is_refused():
    with pytest.raises(ValueError, match="at least one sync"):
        SyncHistory(size=0)
