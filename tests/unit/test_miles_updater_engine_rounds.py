"""The other ranks' wait for rank 0's engine phase, under every call the phase can make (issue 28,
points 11-14), on two real Megatron ranks (TP=2, gloo).

Rank 0 drives two engines given as URLs, so the updater builds their clients from the timeout
flags (point 13). The engines are HTTP stand-ins served from rank 0's process, used only because a
real server cannot be made to answer each call at 0.9x its timeout: each pull is the core's real
``pull`` onto the engine's own local checkpoint, a reload reads that checkpoint back, so what an
engine serves is what it pulled. Scripted faults: e1's reload of v1 fails (the trainer then asks
``/model_info``), e1's catch-up pull first meets a same-target pull in progress, and both pulls of
v2 first meet "source not ready".

Part A (points 11, 13, 14): the sync to v2 runs the catch-up of e1 and the drive of both engines,
every reply at 0.9x its timeout: longer than the accepted wait of the issue's reproduction, and
than the waiting rank's heartbeat timeout. Every rank must finish it, and v3 after it.
Part B (point 12): a second updater whose cap on the wait (the least it accepts) is passed by a
slow post-write hook: rank 1 gives up on that sync, and the two syncs after it work on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from http_support import answer_json, serve_on_loopback
from megatron_support import free_port, move_weights, run_gloo_ranks

PULL_S, ENGINE_S, NOT_READY_S = 3.0, 0.8, 1.5  # part A's timeout flags
HEARTBEAT_S = 3.0  # the waiting rank's only timeout in part A: shorter than rank 0's phase
OLD_BOUND_S = 2 * PULL_S + NOT_READY_S + 4 * ENGINE_S  # what the wait was derived from before
B_PULL_S, B_ENGINE_S = 1.0, 0.2  # part B: a small bound, so the smallest accepted cap is short
HOOK_SLEEP_S = 3 * (2 * B_PULL_S) + 10 * B_ENGINE_S + 1.0  # past part B's cap (the bound itself)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    work = tmp_path_factory.mktemp("engine_rounds")
    hf = make_tiny_qwen3(work / "hf", seed=5)
    cfg = dict(port=free_port(), hf_dir=hf, out_dir=str(work / "out"), disk_dir=str(work / "shared"),
               local_dir=str(work / "engines"))
    seen, _ = run_gloo_ranks(__file__, cfg)
    print("rank 0 / rank 1 seconds per call:", [s["seconds"] for s in seen], "old bound", OLD_BOUND_S)
    return dict(cfg, seen=seen)


def test_every_rank_finishes_a_sync_whose_engine_phase_makes_every_call_at_nine_tenths_of_its_timeout(run):
    r0, r1 = run["seen"]
    for seen in (r0, r1):
        assert [o["outcome"] for o in seen["a"]] == ["failed", "ok", "ok"], seen["a"]
        assert "e1" in seen["a"][0]["error"] and "update_weights_from_disk" in seen["a"][0]["error"]
        # v2: rank 0's metrics on every rank; e1 was caught up to v1 first, then both reached v2.
        assert seen["a"][1]["version"] == 2 and seen["a"][1]["caught_up"] == {"e1": 1}
        assert seen["a"][1]["served"] == {"e0": 2, "e1": 2} and seen["a"][2]["served"] == {"e0": 3, "e1": 3}
    # The phase made the calls the old bound left out (what the engines saw, in order).
    e1 = r0["engine_calls"]["e1"]
    assert "GET /model_info" in e1[: e1.index("pull 2")]  # asked after its failed reload of v1
    assert e1.count("pull 1 -> 409 same target") == 1 and "pull 1" in e1  # the catch-up pull, waited for
    for name in ("e0", "e1"):
        calls = r0["engine_calls"][name]
        assert calls.count("pull 2 -> 404 not ready") == 1 and calls.count("pull 2") == 1


def test_the_engines_serve_the_trainers_bytes_after_the_slow_syncs(run):
    assert run["seen"][0]["served_equals_published"] == {"2": {"e0": True, "e1": True}, "3": {"e0": True, "e1": True}}


def test_the_timeout_flags_reach_the_clients_the_updater_builds_from_urls(run):
    expected = {"engine_timeout_s": ENGINE_S, "pull_timeout_s": PULL_S, "not_ready_retry_s": NOT_READY_S}
    assert run["seen"][0]["client_timeouts"] == [expected, expected]


def test_every_rank_keeps_the_metrics_of_the_last_n_syncs_and_totals_of_all(run):
    for seen in run["seen"]:
        assert seen["history"] == {"versions": [3], "syncs": 2, "first": 2, "last": 3}  # history_size=1


def test_after_one_wait_gave_up_the_next_syncs_work_on_every_rank(run):
    r0, r1 = run["seen"]
    assert [o["outcome"] for o in r0["b"]] == ["ok", "ok", "ok"], r0["b"]
    assert [o["outcome"] for o in r1["b"]] == ["failed", "ok", "ok"], r1["b"]
    assert "did not end within --update-weight-engine-wait-timeout-s" in r1["b"][0]["error"]
    first = r0["b"][0]["version"]
    for seen in (r0, r1):
        assert [o["version"] for o in seen["b"][1:]] == [first + 1, first + 2]
        assert seen["b"][2]["served"] == {"e0": first + 2, "e1": first + 2}

def test_no_round_of_the_wait_leaves_keys_in_the_store_even_one_given_up_on(run):
    for seen in run["seen"]:
        assert seen["rounds"] == [3, 3] and seen["round_keys_left"] == []


# --- the engines (rank 0) -----------------------------------------------------------------------


class SlowEngine:
    """One engine host over HTTP: every reply comes at 0.9x the timeout of its call (``slow``),
    after the real work; ``script`` puts faults before it (per call key: [(delay, status, body)])."""

    def __init__(self, name: str, hf_dir: str, timeouts: dict):
        self.name, self.hf_dir, self.timeouts = name, hf_dir, timeouts
        self.slow = True
        self.weight_version = "default"
        self.served: dict = {}
        self.calls: list[str] = []
        self.script: dict[str, list] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                t = time.monotonic()
                outer.calls.append("GET /model_info")
                outer.wait_out(t, "engine")
                answer_json(self, 200, {"weight_version": outer.weight_version})

            def do_POST(self):
                t = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null") or {}
                status, reply = outer.handle(self.path, body, t)
                answer_json(self, status, reply)

        self.server, _, self.url = serve_on_loopback(Handler)

    def wait_out(self, t0: float, kind: str) -> None:
        if self.slow:
            time.sleep(max(0.0, 0.9 * self.timeouts[kind] - (time.monotonic() - t0)))

    def handle(self, path: str, body: dict, t0: float):
        from testbed.tiny_qwen3 import read_state_dict
        from weightsync import pull

        key = f"pull {body['target_version']}" if path == "/pull_weights" else path
        scripted = self.script.get(key) or []
        if scripted:
            delay, status, reply = scripted.pop(0)
            time.sleep(delay)
            self.calls.append(f"{key} -> {reply['note']}")
            return status, reply
        self.calls.append(key)
        if path == "/pull_weights":
            local = os.path.join(body["local_checkpoint_dir"], self.name)  # each engine on its own "host"
            result = pull(local, self.hf_dir, body["source_dir"], int(body["target_version"]))
            self.wait_out(t0, "pull")
            return 200, {"success": True, "applied_version": result.applied_version, "action": result.action}
        if path == "/update_weights_from_disk":
            self.served = read_state_dict(os.path.join(body["model_path"], self.name))
            self.weight_version = str(body["weight_version"])
        self.wait_out(t0, "engine")
        return 200, {"success": True}


def _same_bytes(served: dict, published: dict) -> bool:
    return sorted(served) == sorted(published) and all(
        served[n].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() == bytes(t.data)
        for n, t in published.items())


def _worker(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    from miles_updater.args import DiskDeltaConfig
    from miles_updater.gather import load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater

    init_distributed_cpu(rank, 2, cfg["port"], tp=2, timeout_s=60)
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    store = dist.distributed_c10d._get_default_store()
    seen: dict = {"a": [], "b": [], "seconds": [], "served_equals_published": {}}
    timeouts = {"pull": PULL_S, "engine": ENGINE_S}
    engines = [SlowEngine(n, cfg["hf_dir"], timeouts) for n in ("e0", "e1")] if rank == 0 else []

    def sync(updater, part: str, step: int) -> None:
        move_weights(model, step)
        t = time.monotonic()
        try:
            m = updater.update_weights()
            seen[part].append(dict(outcome="ok", version=m.version, served=m.served, caught_up=m.caught_up))
        except Exception as e:  # noqa: BLE001 - recorded for the parent to check
            seen[part].append(dict(outcome="failed", error=f"{type(e).__name__}: {e}", version=updater.version))
        seen["seconds"].append(round(time.monotonic() - t, 1))
        if rank == 0 and seen[part][-1]["outcome"] == "ok" and part == "a":
            published = updater.gatherer.owned_tensors()  # TP=2, PP=1: rank 0 owns every tensor
            seen["served_equals_published"][str(m.version)] = {
                e.name: _same_bytes(e.served, published) for e in engines}

    # Part A: every engine call at 0.9x its timeout; the others' only timeout is the heartbeat's.
    a = DiskDeltaConfig(source_dir=cfg["disk_dir"], local_checkpoint_dir=cfg["local_dir"], hf_checkpoint=cfg["hf_dir"],
                        apply_mode="reload", pull_timeout_s=PULL_S, engine_timeout_s=ENGINE_S,
                        not_ready_retry_s=NOT_READY_S, engine_heartbeat_timeout_s=HEARTBEAT_S, history_size=1)
    updater = DiskDeltaWeightUpdater(a, [model], group=dist.group.WORLD)
    if rank == 0:
        updater.connect_rollout_engines([e.url for e in engines], [e.name for e in engines])
        seen["client_timeouts"] = [
            dict(engine_timeout_s=c.timeout_s, pull_timeout_s=c.pull_timeout_s, not_ready_retry_s=c.not_ready_retry_s)
            for c in updater.engine_sync.engines.clients]
        engines[1].script["/update_weights_from_disk"] = [
            (0.9 * ENGINE_S, 400, {"success": False, "message": "shape mismatch", "note": "400"})]
    for step in (1, 2, 3):
        if rank == 0 and step == 2:  # the catch-up pull of e1 (to v1), then both pulls of v2
            engines[1].script["pull 1"] = [(0.5, 409, {"success": False, "error_type": "PullInProgress",
                                                       "target_version": 1, "message": "running",
                                                       "note": "409 same target"})]
            for e in engines:
                e.script["pull 2"] = [(0.4 * NOT_READY_S, 404, {"success": False, "error_type": "source_not_ready",
                                                                  "message": "v2 not visible yet",
                                                                  "note": "404 not ready"})]
        sync(updater, "a", step)
    seen["history"] = dict(versions=[m.version for m in updater.history], syncs=updater.history.totals.syncs,
                           first=updater.history.totals.first_version, last=updater.history.totals.last_version)
    if rank == 0:
        seen["engine_calls"] = {e.name: list(e.calls) for e in engines}
    waits = [updater._engine_wait]
    updater.close()

    # Part B: the smallest cap the updater accepts, passed by a slow post-write hook on the first sync.
    b = DiskDeltaConfig(source_dir=cfg["disk_dir"], local_checkpoint_dir=cfg["local_dir"], hf_checkpoint=cfg["hf_dir"],
                        apply_mode="reload", pull_timeout_s=B_PULL_S, engine_timeout_s=B_ENGINE_S,
                        not_ready_retry_s=0.0,
                        engine_wait_timeout_s=3 * (2 * B_PULL_S) + 10 * B_ENGINE_S,
                        post_write_path=f"{Path(__file__).stem}.slow_first_hook")
    updater = DiskDeltaWeightUpdater(b, [model], group=dist.group.WORLD)
    if rank == 0:
        for e in engines:
            e.slow = False
        updater.connect_rollout_engines([e.url for e in engines], [e.name for e in engines])
    for step in (4, 5, 6):
        sync(updater, "b", step)
    waits.append(updater._engine_wait)
    updater.close()
    dist.barrier()
    seen["round_keys_left"] = [k for w in waits for n in range(w.round) for what in ("done", "beat", "seen")
                               if store.check([k := f"{w.namespace}/{n}/{what}"])]
    seen["rounds"] = [w.round for w in waits]
    (Path(cfg["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    os._exit(0)


_HOOK_CALLS: list = []


def slow_first_hook(args, version_dir, rollout_engines):
    """Part B's post-write hook: the first call outlasts the cap on the others' wait."""
    _HOOK_CALLS.append(version_dir)
    if len(_HOOK_CALLS) == 1:
        time.sleep(HOOK_SLEEP_S)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
