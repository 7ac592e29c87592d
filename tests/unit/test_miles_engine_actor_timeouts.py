"""The timeout flags reach engines given as Ray actor handles (issue 28 point 13), on real Ray: the
actors of ``make_engine_actor_class`` take them; an engine actor of the host trainer without
``set_timeouts`` keeps its own, and the warning names it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from miles_updater.engine_sync import as_engine_group
from miles_updater.engines import EngineTimeouts, make_engine_actor_class

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]


def test_the_timeout_flags_reach_engine_actors_and_one_without_set_timeouts_is_named(caplog, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # read by ray.init in this process (a local cluster)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}})
    try:
        actor = make_engine_actor_class().remote("http://127.0.0.1:9", name="engine0", timeout_s=120)

        @ray.remote(num_cpus=0)
        class HostTrainersEngine:  # an engine actor of the host trainer: the calls, no set_timeouts
            def pull_weights(self, local_checkpoint_dir, source_dir, target_version):
                return {"success": True}

        other = HostTrainersEngine.remote()
        flags = EngineTimeouts(engine_timeout_s=7.0, pull_timeout_s=70.0, not_ready_retry_s=0.7)
        with caplog.at_level(logging.WARNING, logger="miles_updater.engine_sync"):
            group, _ = as_engine_group([actor, other], ["engine0", "host-engine"], timeouts=flags)
        assert ray.get(actor.timeouts.remote()) == flags
        assert "['host-engine'] cannot take the timeout flags" in caplog.text and "engine0" not in caplog.text
    finally:
        ray.shutdown()
