"""Shared fixtures of the end-to-end tests (real sglang servers, real processes, loopback only).

Generic on purpose (engine and trainer tests both use it):
- ``tiny_model_dir``: a tiny Qwen3 checkpoint (``testbed.tiny_qwen3``), one per test module;
- ``server_factory``: start ``testbed.sglang_cpu.SglangCpuServer`` instances that are stopped at
  the end of the module, with their log tail printed if a test in the module failed.

Every server start costs 20-60 s on a 2-core machine: modules share one server each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from testbed.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def server_factory(request, tmp_path_factory):
    from testbed.sglang_cpu import SglangCpuServer

    servers: list[SglangCpuServer] = []
    log_dir = tmp_path_factory.mktemp("server_logs")

    def start(model_dir, *, wait_healthy: bool = True, **kwargs) -> SglangCpuServer:
        kwargs.setdefault("log_path", log_dir / f"server-{len(servers)}.log")
        # Live apply's mode is chosen by measured pauses, and on these tiny models a reload is as
        # fast as a live apply's fixed cost: every reload takes as long as a real model's would,
        # so that the tests which exercise live apply get it (a module may set its own value).
        kwargs["env"] = {"WEIGHTSYNC_TEST_RELOAD_DELAY_S": "0.3", **(kwargs.get("env") or {})}
        server = SglangCpuServer(model_dir, **kwargs)
        servers.append(server)
        server.start(wait_healthy=wait_healthy)
        return server

    yield start
    failed = request.session.testsfailed > 0
    for server in reversed(servers):
        server.stop()
        if failed:
            print(f"\n--- tail of {server.log_path} ---\n{server.log_tail(40)}")
