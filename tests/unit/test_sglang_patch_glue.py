"""The thin sglang glue, in-process (no server): IPC types over pickle and msgpack, the CLI
flags through sglang's own parser and pickling, the route with sglang's auth middleware, and
the tokenizer-side fan-out with sglang's FanOutCommunicator."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from live_support import cpu_standins_on_path

with cpu_standins_on_path():
    from sglang.srt.managers import io_struct
    from sglang_patch import io_types, server_flags, tokenizer_side

    io_types.register_types()

from sglang_patch.pull import results  # noqa: E402
from sglang_patch.io_types import PullWeightsReqInput, PullWeightsReqOutput  # noqa: E402


def _sample_output() -> PullWeightsReqOutput:
    host = results.HostPullResult(host="h/node0", ranks=["dp0/tp0", "dp0/tp1"], success=True, applied_version=3,
                                  action="chain", seconds=0.25, hook_ran=True, nbytes_read=123)
    return PullWeightsReqOutput(**results.summarize(3, [host], 0.3))


def test_types_are_keyword_only_direct_basereq_subclasses():
    assert PullWeightsReqInput.__bases__ == (io_struct.BaseReq,)
    assert PullWeightsReqOutput.__bases__ == (io_struct.BaseReq,)
    with pytest.raises(TypeError):
        PullWeightsReqInput("/l", "/s", 3)  # positional arguments are refused


@pytest.mark.parametrize(
    "make",
    [
        lambda: PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=3, rid="r1"),
        lambda: PullWeightsReqOutput(success=False, message="m", error_type="conflict", http_status=409),
        _sample_output,
    ],
)
def test_pickle_round_trip(make):
    obj = make()
    assert pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) == obj


@pytest.mark.parametrize("make", [
    lambda: PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=3, http_worker_ipc="ipc"),
    _sample_output,
])
def test_msgpack_round_trip_through_sglangs_codec(make):
    obj = make()
    decoded = io_struct.msgpack_decode(io_struct.msgpack_encode(obj))
    assert type(decoded) is type(obj) and decoded == obj
    if isinstance(obj, PullWeightsReqOutput):
        assert isinstance(decoded.hosts[0], results.HostPullResult)


def test_the_flags_reach_server_args_and_survive_pickling(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    server_flags.install()
    hook = "testbed.hooks.record_pre_read"
    args = prepare_server_args([
        "--model-path", str(tmp_path),
        "--custom-pull-weights-pre-read-hook", hook,
        "--pull-weights-allowed-roots", f"{tmp_path}/a,{tmp_path}/b",
    ])  # fmt: skip
    options = server_flags.options_of(args)
    assert options.pre_read_hook == hook
    assert options.allowed_roots == (f"{tmp_path}/a", f"{tmp_path}/b")
    # What a scheduler process receives: a pickled copy.
    assert server_flags.options_of(pickle.loads(pickle.dumps(args))) == options
    default = server_flags.options_of(prepare_server_args(["--model-path", str(tmp_path)]))
    assert default.allowed_roots == () and default.pre_read_hook is None
    assert default.timeout_s == 600.0


def test_the_pull_deadline_flag_reaches_server_args_and_a_bad_value_fails_at_start_up(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    server_flags.install()
    args = prepare_server_args(["--model-path", str(tmp_path), "--pull-weights-timeout-s", "42.5"])
    assert server_flags.options_of(pickle.loads(pickle.dumps(args))).timeout_s == 42.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(ValueError, match="--pull-weights-timeout-s"):
            prepare_server_args(["--model-path", str(tmp_path), "--pull-weights-timeout-s", bad])


def test_a_bad_flag_value_fails_at_start_up(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    server_flags.install()
    with pytest.raises(ValueError, match="cannot be found"):
        prepare_server_args(["--model-path", str(tmp_path), "--custom-pull-weights-pre-read-hook", "no_such_mod.fn"])
    with pytest.raises(ValueError, match="absolute"):
        prepare_server_args(["--model-path", str(tmp_path), "--pull-weights-allowed-roots", "rel/dir"])


# --- tokenizer side --------------------------------------------------------------------------


class FakeTokenizerManager:
    """What the route and tokenizer side use of sglang's TokenizerManager, with a real
    FanOutCommunicator whose 'schedulers' are canned per-DP-group replies."""

    def __init__(self, replies_per_call, fan_out=2):
        from sglang.srt.managers.communicator import FanOutCommunicator

        self.sent = []
        self.replies_per_call = list(replies_per_call)
        self.pull_weights_communicator = FanOutCommunicator(self._send, fan_out)

    def auto_create_handle_loop(self):
        pass

    def _send(self, obj):
        self.sent.append(obj)
        replies = self.replies_per_call.pop(0)

        async def deliver():
            await asyncio.sleep(0.05)
            for reply in replies:
                self.pull_weights_communicator.handle_recv(reply)

        asyncio.get_running_loop().create_task(deliver())


def _group_reply(rank, version, *, ok=True):
    if ok:
        report = results.RankPullReport(host="h/node0", rank=rank, success=True, applied_version=version, action="chain")
    else:
        report = results.RankPullReport(host="h/node0", rank=rank, success=False, error_type="source_not_ready",
                                        http_status=404, message="not yet")
    return PullWeightsReqOutput(**results.summarize(version, results.merge_host_results([report])))


def test_the_communicator_is_declared_for_sglangs_tokenizer():
    from sglang.srt.managers import tokenizer_control_mixin

    tokenizer_side.install(tokenizer_control_mixin)
    tokenizer_side.install(tokenizer_control_mixin)
    specs = [s for s in tokenizer_control_mixin._COMMUNICATOR_SPECS if s[0] == "pull_weights"]
    assert specs == [("pull_weights", PullWeightsReqOutput)]


def test_fan_out_merges_every_dp_group_and_a_pull_to_another_target_is_pull_in_progress():
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2)]])
    req = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=2)
    other = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=3)

    async def scenario():
        first = asyncio.create_task(tokenizer_side.pull_weights(tm, req))
        await asyncio.sleep(0.01)
        second = await tokenizer_side.pull_weights(tm, other)
        return await first, second

    first, second = asyncio.run(scenario())
    assert first.success and first.hosts[0].ranks == ["dp0/tp0", "dp1/tp0"]
    assert (second.http_status, second.error_type) == (409, "PullInProgress")
    assert second.target_version == 2 and "v3 was not queued" in second.message  # names the running pull
    assert len(tm.sent) == 1  # the refused pull never reached a scheduler


def test_a_retry_of_the_running_pull_waits_for_it_even_after_the_first_caller_gave_up():
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2)]])
    req = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=2)
    retry = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=2)

    async def scenario():
        first = asyncio.create_task(tokenizer_side.pull_weights(tm, req))
        await asyncio.sleep(0.01)
        first.cancel()  # the trainer's client timed out and closed its connection
        return await tokenizer_side.pull_weights(tm, retry)

    out = asyncio.run(scenario())
    assert out.success and out.applied_version == 2
    assert len(tm.sent) == 1 and tm.sent[0].rid  # one pull, keyed for the pipeline stages


def test_shutdown_answers_a_waiting_pull_503_at_once():
    class NeverAnswers(FakeTokenizerManager):
        gracefully_exit = False

        def _send(self, obj):
            self.sent.append(obj)

    tm = NeverAnswers([])
    req = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=4)

    async def scenario():
        waiting = asyncio.create_task(tokenizer_side.pull_weights(tm, req))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        tm.gracefully_exit = True  # what sglang's SIGTERM handler sets
        out = await asyncio.wait_for(waiting, timeout=5)
        later = await tokenizer_side.pull_weights(tm, req)
        return out, later

    out, later = asyncio.run(scenario())
    for reply in (out, later):
        assert (reply.http_status, reply.error_type) == (503, "unavailable")
        assert "shutting down" in reply.message
    assert len(tm.sent) == 1


def test_one_failing_dp_group_fails_the_merged_reply():
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2, ok=False)]])
    req = PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=2)
    out = asyncio.run(tokenizer_side.pull_weights(tm, req))
    assert not out.success and out.http_status == 404 and out.error_type == "source_not_ready"


# --- route -----------------------------------------------------------------------------------


def _client(tm, *, api_key=None, admin_api_key=None):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.auth import add_api_key_middleware

    from sglang_patch.http_route import install_route

    app = FastAPI()
    install_route(app, lambda: tm)
    install_route(app, lambda: tm)  # idempotent
    if api_key or admin_api_key:
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    return TestClient(app)


BODY = {"local_checkpoint_dir": "/l", "source_dir": "/s", "target_version": 2}


def test_route_answers_200_with_the_merged_reply():
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2)]])
    resp = _client(tm).post("/pull_weights", json=BODY)
    assert resp.status_code == 200
    body = resp.json()
    assert body["success"] is True and body["error_type"] is None and body["applied_version"] == 2
    assert body["hosts"][0]["ranks"] == ["dp0/tp0", "dp1/tp0"]
    assert "http_status" not in body
    sent = tm.sent[0]
    assert isinstance(sent, PullWeightsReqInput) and sent.target_version == 2


def test_route_maps_a_typed_failure_to_its_status_with_a_structured_body():
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2, ok=False), _group_reply("dp1/tp0", 2)]])
    resp = _client(tm).post("/pull_weights", json=BODY)
    assert resp.status_code == 404
    assert resp.json()["error_type"] == "source_not_ready" and resp.json()["success"] is False


def test_route_answers_a_malformed_body_400_in_the_same_shape():
    tm = FakeTokenizerManager([])
    resp = _client(tm).post("/pull_weights", json={"local_checkpoint_dir": "/l", "target_version": "x"})
    assert resp.status_code == 400
    body = resp.json()
    assert body["error_type"] == "bad_request" and "source_dir" in body["message"]
    assert "target_version" in body["message"] and not tm.sent


@pytest.mark.parametrize("version", ["1", True, 1.0, None, [1]])
def test_route_refuses_a_target_version_that_is_not_a_json_integer(version):
    tm = FakeTokenizerManager([])
    resp = _client(tm).post("/pull_weights", json={**BODY, "target_version": version})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error_type"] == "bad_request" and "target_version" in resp.json()["message"]
    assert not tm.sent


def test_route_refuses_a_body_that_is_not_json_or_too_large():
    tm = FakeTokenizerManager([])
    client = _client(tm)
    json_header = {"Content-Type": "application/json"}
    assert client.post("/pull_weights", content=b"not json", headers=json_header).status_code == 400
    huge = client.post("/pull_weights", content=b" " * (2 << 20) + b"{}", headers=json_header)
    assert huge.status_code == 400 and "bytes" in huge.json()["message"]
    assert not tm.sent


def _both_routes_client(tm):
    from sglang_patch.http_route import install_live_routes

    client = _client(tm)
    install_live_routes(client.app, lambda: tm)
    return client


LIVE_BODY = {"local_checkpoint_dir": "/l", "target_version": 2}
BODIES = {"/pull_weights": BODY, "/update_weights_from_pulled": LIVE_BODY}


@pytest.mark.parametrize("route", sorted(BODIES))
@pytest.mark.parametrize("version", [2**64, 10**30, 2**63, -1])
def test_both_routes_answer_a_target_version_beyond_int64_400_in_the_error_shape(route, version):
    tm = FakeTokenizerManager([])
    resp = _both_routes_client(tm).post(route, json={**BODIES[route], "target_version": version})
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["success"] is False and body["error_type"] == "bad_request", body
    assert "target_version" in body["message"] and "Expected" in body["message"]
    assert not tm.sent


@pytest.mark.parametrize("route", sorted(BODIES))
@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonx", None,
])
def test_both_routes_refuse_a_body_not_sent_as_application_json_with_a_structured_415(route, content_type):
    import json

    tm = FakeTokenizerManager([])
    headers = {"Content-Type": content_type} if content_type else {}
    resp = _both_routes_client(tm).post(route, content=json.dumps(BODIES[route]).encode(), headers=headers)
    assert resp.status_code == 415, resp.text
    body = resp.json()
    assert body["success"] is False and body["error_type"] == "unsupported_media_type", body
    assert "application/json" in body["message"]
    assert not tm.sent


def test_a_json_body_with_a_charset_parameter_is_accepted():
    import json

    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2)]])
    resp = _client(tm).post("/pull_weights", content=json.dumps(BODY).encode(),
                            headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status_code == 200, resp.text
    assert len(tm.sent) == 1


def test_a_plugin_part_that_failed_to_install_makes_the_route_answer_503_with_the_reason(monkeypatch):
    import types

    from sglang_patch import parts

    monkeypatch.setattr(parts, "_failures", {})
    # An sglang whose tokenizer_control_mixin has no declarative communicator list.
    parts.guarded("tokenizer", tokenizer_side.install)(types.ModuleType("tokenizer_control_mixin"))
    assert "_COMMUNICATOR_SPECS" in parts.unavailable_reason()
    tm = FakeTokenizerManager([])
    resp = _client(tm).post("/pull_weights", json=BODY)
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["error_type"] == "unavailable" and "tokenizer" in body["message"] and "_COMMUNICATOR_SPECS" in body["message"]
    assert not tm.sent


def test_route_hides_an_internal_exception_behind_a_500():
    class Broken(FakeTokenizerManager):
        def auto_create_handle_loop(self):
            raise RuntimeError("secret internals")

    resp = _client(Broken([])).post("/pull_weights", json=BODY)
    assert resp.status_code == 500
    assert resp.json()["error_type"] == "internal_error" and "Traceback" not in resp.text


def test_an_existing_pull_weights_route_is_kept_and_one_line_names_it(caplog):
    """sglang-miles and slime's patch ship their own /pull_weights: it keeps serving."""
    import logging

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang_patch.http_route import install_route

    app = FastAPI()

    async def their_pull_weights():
        return {"served_by": "theirs"}

    app.add_api_route("/pull_weights", their_pull_weights, methods=["POST"])
    with caplog.at_level(logging.INFO, logger="sglang_patch.http_route"):
        assert install_route(app, lambda: None) is False
    assert [r.path for r in app.router.routes].count("/pull_weights") == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "already served by" in line and "their_pull_weights" in line and "weightsync's is not added" in line
    assert TestClient(app).post("/pull_weights", json=BODY).json() == {"served_by": "theirs"}


@pytest.mark.parametrize(
    "keys, header, status",
    [
        ({"admin_api_key": "adm"}, None, 401),
        ({"admin_api_key": "adm"}, "adm", 200),
        ({"api_key": "usr"}, None, 401),
        ({"api_key": "usr"}, "usr", 200),
        ({"api_key": "usr", "admin_api_key": "adm"}, "usr", 401),  # admin key required then
        ({"api_key": "usr", "admin_api_key": "adm"}, "adm", 200),
    ],
)
def test_route_honours_api_keys_like_update_weights_from_disk(keys, header, status):
    tm = FakeTokenizerManager([[_group_reply("dp0/tp0", 2), _group_reply("dp1/tp0", 2)]])
    headers = {"Authorization": f"Bearer {header}"} if header else {}
    resp = _client(tm, **keys).post("/pull_weights", json=BODY, headers=headers)
    assert resp.status_code == status


def _live_output():
    from sglang_patch.live import results as live_results

    report = live_results.LiveRankReport(host="h/node0", rank="dp0/tp0", success=True, mode="live", weight_version=4,
                                         elements_scattered=12, pause_s=0.01)
    return io_types.UpdateWeightsFromPulledReqOutput(**live_results.summarize(4, live_results.merge_hosts([report])))


@pytest.mark.parametrize("make", [
    lambda: io_types.UpdateWeightsFromPulledReqInput(local_checkpoint_dir="/l", target_version=4, flush_cache=False),
    _live_output,
    lambda: io_types.WeightsDigestReqInput(names=["a"]),
    lambda: io_types.WeightsDigestReqOutput(ranks=[io_types.RankDigests(
        host="h/node0", rank="dp0/tp1", digests={"a": "00"}, data_ptrs={"a": 1}, live_version=None,
        coordinate_map={"placements": 3, "reload_only_params": {"p": "why"}, "proven": True})]),
])
def test_live_apply_messages_round_trip_through_sglangs_msgpack_codec(make):
    io_types.register_live_types()
    obj = make()
    decoded = io_struct.msgpack_decode(io_struct.msgpack_encode(obj))
    assert type(decoded) is type(obj) and decoded == obj
    assert pickle.loads(pickle.dumps(obj)) == obj


def test_the_live_threshold_flag_is_validated(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    server_flags.install()
    args = prepare_server_args(["--model-path", str(tmp_path), "--update-weights-live-max-changed-fraction", "0.25"])
    assert server_flags.options_of(args).live_max_changed_fraction == 0.25
    assert server_flags.options_of(prepare_server_args(["--model-path", str(tmp_path)])).live_max_changed_fraction == 0.1
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        server_flags.options_from_values(None, None, "1.5")


# --- scheduler side --------------------------------------------------------------------------


def test_a_scheduler_whose_dispatcher_does_not_merge_serves_on_and_answers_pulls_503(caplog):
    from sglang.utils import TypeBasedDispatcher

    from sglang_patch import scheduler_side

    class OtherDispatcher(TypeBasedDispatcher):  # an sglang whose dispatcher class differs
        def __iadd__(self, other):
            raise TypeError("unsupported operand type(s) for +=")

    class Scheduler:
        pass

    scheduler = Scheduler()
    served: list = []
    scheduler._request_dispatcher = OtherDispatcher([(io_struct.FlushCacheReqInput, served.append)])
    with caplog.at_level("ERROR"):
        assert scheduler_side._after_init_request_dispatcher("result", scheduler) == "result"
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "disabled" in line and "unsupported operand" in line and "503" in line
    # sglang's own requests are dispatched as before ...
    flush = io_struct.FlushCacheReqInput()
    scheduler._request_dispatcher(flush)
    assert served == [flush]
    # ... and a pull gets a 503 with the reason instead of killing the scheduler as an unknown type.
    reply = scheduler._request_dispatcher(PullWeightsReqInput(local_checkpoint_dir="/l", source_dir="/s", target_version=1))
    assert isinstance(reply, PullWeightsReqOutput)
    assert (reply.http_status, reply.error_type, reply.success) == (503, "unavailable", False)
    assert "unsupported operand" in reply.message
    # The per-iteration hook finds no coordinator and does nothing.
    assert scheduler_side._after_process_input_requests(None, scheduler) is None
