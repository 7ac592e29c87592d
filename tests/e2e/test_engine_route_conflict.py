"""A real sglang server that already has ``POST /pull_weights`` when weightsync's plugin loads.

sglang-miles and slime's patch ship their own ``/pull_weights``. On such a server the weightsync
plugin must not register a second, conflicting route: the existing one keeps serving, and one
start-up log line says so. The existing route comes from a stand-in plugin
(``tests/e2e/foreign_route``) that is discovered, and so loaded, before weightsync's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FOREIGN_DIR = Path(__file__).resolve().parent / "foreign_route"


@pytest.fixture(scope="module")
def server(tiny_model_dir, server_factory, tmp_path_factory):
    from testbed.sglang_cpu import CPU_SCAFFOLDING_DIR, REPO_ROOT

    root = tmp_path_factory.mktemp("route_conflict")
    pythonpath = os.pathsep.join([str(FOREIGN_DIR), str(CPU_SCAFFOLDING_DIR), str(REPO_ROOT)])
    return server_factory(
        tiny_model_dir,
        extra_args=["--pull-weights-allowed-roots", str(root)],
        env={"PYTHONPATH": pythonpath},
    )


def test_existing_pull_weights_route_keeps_serving_and_one_line_says_so(server):
    resp = server.post(
        "/pull_weights",
        {"local_checkpoint_dir": "/tmp/x", "source_dir": "/tmp/y", "target_version": 1},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"served_by": "foreign_pull_route"}

    log = server.log_text()
    said = [line for line in log.splitlines() if "POST /pull_weights is already served by" in line]
    assert len(said) == 1, said
    assert "foreign_pull_route.pull_weights" in said[0] and "weightsync's is not added" in said[0]
    assert "POST /pull_weights is served by weightsync" not in log
    # weightsync's plugin did load (its scheduler side is up); the server is otherwise whole.
    assert "pull_weights ready on" in log
    assert server.generate_ids("the quick brown fox", 4)
