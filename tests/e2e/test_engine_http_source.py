"""A real sglang CPU engine pulls from an HTTP(S) source through ``POST /pull_weights`` and serves
it (issue 29).

Two static servers on loopback over the same published run (``benchmarks.fleet.origin``): the
"cache" the request names, and the origin the server's environment names
(``WEIGHTSYNC_HTTP_ORIGIN``, the only place it comes from). One sglang server (TP=1) whose
``--pull-weights-allowed-roots`` names the cache's HTTP prefix. The trainer side publishes with the
core's ``Publisher`` into the served dir; the engine pulls a chain into a host-local dir, which
must hold exactly the trainer's tensors, then reloads it and generates what transformers
generates from the same weights.
"""

from __future__ import annotations

import os

import pytest

from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS
from tests.e2e.engine_pull_support import (
    assert_a_version_not_published_yet_is_not_ready, publish_and_pull_v2, pull, serve_v2_then_chain_v3)

pytestmark = pytest.mark.slow

INDEX = "model.safetensors.index.json"


def _server_has_libtorrent() -> bool:
    import subprocess

    from testbed.sglang_cpu import server_python

    return subprocess.run([server_python(), "-c", "import libtorrent"], capture_output=True).returncode == 0


def test_a_swarm_named_on_an_engine_host_without_libtorrent_replies_swarm_unavailable(tmp_path_factory, tiny_model_dir,
                                                                                      server_factory):
    # sglang 0.5.16's venv has no libtorrent (WEIGHTSYNC_SGLANG_PYTHON=.venv-sglang0516/bin/python);
    # first in the module, its server stopped before the shared one starts (one server at a time).
    if _server_has_libtorrent():
        pytest.skip("the server's interpreter has libtorrent (run with WEIGHTSYNC_SGLANG_PYTHON=.venv-sglang0516/bin/python)")
    root = tmp_path_factory.mktemp("http_swarm")
    url_root = "http://127.0.0.1:9/runs"  # never read: the refusal comes before any request
    server = server_factory(
        tiny_model_dir,
        extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", f"{root},{url_root}"],
        env={"WEIGHTSYNC_SWARM_PEERS": "127.0.0.1:6881,127.0.0.1:6882"},
    )
    try:
        resp = server.post("/pull_weights", {"local_checkpoint_dir": str(root / "local"),
                                             "source_dir": f"{url_root}/run", "target_version": 1})
        assert resp.status_code == 400, resp.text
        body = resp.json()
        assert body["error_type"] == "swarm_unavailable", body
        assert "weightsync[swarm]" in resp.text
        assert not (root / "local").exists()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, server_factory):
    from benchmarks.fleet.origin import OriginServer
    from testbed.tiny_qwen3 import read_state_dict, to_raw_tensors
    from weightsync import Publisher

    root = tmp_path_factory.mktemp("http_pull")
    www = root / "www"
    origin = OriginServer(str(www), ("127.0.0.1", 0))
    cache = OriginServer(str(www), ("127.0.0.1", 0))  # stands for the caching tier: same bytes, another port
    for s in (origin, cache):
        s.start_in_thread()

    class Env:
        pass

    e = Env()
    e.origin, e.cache, e.model = origin, cache, tiny_model_dir
    e.local = str(root / "local")
    e.url = f"{cache.base_url}/runs/run"
    e.expected = {0: read_state_dict(tiny_model_dir)}
    e.publisher = Publisher(str(www / "runs" / "run"), encoding="sparse-v1", template_dir=tiny_model_dir)
    e.publisher.seed_snapshot(to_raw_tensors(e.expected[0]), version=0)
    try:
        e.server = server_factory(
            tiny_model_dir,
            extra_args=[*SERVER_COMPUTE_ARGS, "--pull-weights-allowed-roots", f"{root / 'local'},{cache.base_url}/runs"],
            env={"WEIGHTSYNC_HTTP_ORIGIN": origin.base_url},
        )
        yield e
    finally:
        e.publisher.close()
        for s in (origin, cache):
            s.shutdown()
            s.server_close()


def test_an_engine_pulls_a_chain_over_http_to_the_trainers_tensors_and_serves_it(env):
    publish_and_pull_v2(env)
    # the commit point came from the environment's origin; the payload through the named "cache"
    assert any(p.endswith(INDEX) for _, p, _ in env.origin.served)
    assert not any(p.endswith(INDEX) for _, p, _ in env.cache.served)
    assert env.cache.bytes_served(".safetensors") > 0
    serve_v2_then_chain_v3(env)


def test_a_version_not_served_yet_is_not_ready(env):
    assert_a_version_not_published_yet_is_not_ready(env)


def test_the_same_run_on_another_port_or_host_name_is_forbidden(env):
    for source in (f"{env.origin.base_url}/runs/run", env.url.replace("127.0.0.1", "localhost")):
        resp = pull(env, 1, source=source)
        assert resp.status_code == 403, resp.text


def test_a_request_cannot_name_an_origin_or_credentials(env):
    for source in (f"{env.url}?origin={env.origin.base_url}", env.url.replace("http://", "http://u:p@")):
        resp = pull(env, 1, source=source)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error_type"] == "bad_request"
