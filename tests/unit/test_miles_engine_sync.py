"""The engine side of a sync: call order, the baseline, retry on "not ready", no retry on corrupt.

An in-process HTTP engine double records each call (order and body) and answers from a script;
it exists only to cause faults and observe order. The real sglang server is exercised in
tests/e2e/test_trainer_e2e.py.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_updater.engines import EngineCallError, EngineSyncError, SGLangEngineClient, ThreadEngineGroup
from miles_updater.updater import EngineSync, SyncMetrics

CALLS: list = []  # (engine, path, body, time) across engines, in arrival order


class EngineDouble:
    """A loopback HTTP server answering sglang's control calls from a per-path script."""

    def __init__(self, name: str):
        self.name = name
        self.script: dict[str, list[tuple[int, dict]]] = {}
        self.pull_delay_s = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw and raw != b"null" else None
                CALLS.append((outer.name, self.path.split("?")[0], body, time.monotonic()))
                if self.path.startswith("/pull_weights") and outer.pull_delay_s:
                    time.sleep(outer.pull_delay_s)
                queue = outer.script.get(self.path.split("?")[0]) or []
                status, reply = queue.pop(0) if queue else (200, {"success": True})
                if status == 200 and self.path.startswith("/pull_weights") and reply == {"success": True}:
                    reply = {"success": True, "applied_version": body["target_version"], "action": "chain",
                             "reason": "double", "seconds": 0.0}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

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
    clients = [SGLangEngineClient(d.url, name=d.name, timeout_s=5, not_ready_retry_s=kw.pop("retry_s", 5),
                                  backoff_initial_s=0.01) for d in doubles]
    return EngineSync(ThreadEngineGroup(clients), source_dir="/shared/run-x", local_checkpoint_dir="/local/ckpt", **kw)


def paths_of(engine):
    return [p for e, p, _, _ in CALLS if e == engine]


def test_sync_calls_engines_in_order_pull_pause_flush_reload_continue(doubles):
    hook_calls = []
    sync = make_sync(doubles, post_write_hook=lambda args, vdir, engines: hook_calls.append((args, vdir, len(CALLS))),
                     hook_args="ARGS")
    m = sync.update(3, "/shared/run-x/weight_v000003", SyncMetrics(version=3))
    for d in doubles:
        assert paths_of(d.name) == ["/pull_weights", "/pause_generation", "/flush_cache",
                                    "/update_weights_from_disk", "/continue_generation"]
    # The hook runs before any engine call; every pull precedes every pause.
    assert hook_calls == [("ARGS", "/shared/run-x/weight_v000003", 0)]
    order = [p for _, p, _, _ in CALLS]
    assert max(i for i, p in enumerate(order) if p == "/pull_weights") < min(
        i for i, p in enumerate(order) if p == "/pause_generation")
    bodies = {p: b for e, p, b, _ in CALLS if e == "e0"}
    assert bodies["/pull_weights"] == {"local_checkpoint_dir": "/local/ckpt", "source_dir": "/shared/run-x",
                                       "target_version": 3}
    assert bodies["/update_weights_from_disk"] == {"model_path": "/local/ckpt", "flush_cache": True,
                                                   "weight_version": "3"}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert [p["engine"] for p in m.pulls] == ["e0", "e1"]


def test_pulls_run_concurrently_on_every_engine(doubles):
    for d in doubles:
        d.pull_delay_s = 0.5
    make_sync(doubles).update(1, "/v", SyncMetrics(version=1))
    starts = [t for _, p, _, t in CALLS if p == "/pull_weights"]
    assert abs(starts[0] - starts[1]) < 0.4  # the second did not wait for the first


def test_in_place_pause_skips_flush_and_keeps_the_cache(doubles):
    make_sync(doubles, pause_mode="in_place").update(1, "/v", SyncMetrics(version=1))
    assert paths_of("e0") == ["/pull_weights", "/pause_generation", "/update_weights_from_disk",
                              "/continue_generation"]
    body = next(b for e, p, b, _ in CALLS if p == "/update_weights_from_disk")
    assert body["flush_cache"] is False


def test_baseline_sends_version_0_without_waiting_and_the_first_sync_waits_for_it(doubles):
    for d in doubles:
        d.pull_delay_s = 0.6
    sync = make_sync(doubles)
    t0 = time.monotonic()
    sync.start_baseline()
    assert time.monotonic() - t0 < 0.3  # did not wait for the pulls
    time.sleep(0.1)
    assert [(e, p, b["target_version"]) for e, p, b, _ in CALLS] in (
        [("e0", "/pull_weights", 0), ("e1", "/pull_weights", 0)],
        [("e1", "/pull_weights", 0), ("e0", "/pull_weights", 0)])
    m = sync.update(1, "/v", SyncMetrics(version=1))
    pulls = [b["target_version"] for e, p, b, _ in CALLS if e == "e0" and p == "/pull_weights"]
    assert pulls == [0, 1]
    assert m.baseline_wait_s > 0.2


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
        make_sync(doubles).update(1, "/v", SyncMetrics(version=1))
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
