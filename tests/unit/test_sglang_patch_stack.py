"""Fitting the user's stack, in-process (no server): the version adapter (``sglang_patch.compat``)
and the metrics in Prometheus multiprocess mode as sglang sets it up (``sglang_patch.metrics``).

Elsewhere: an existing route kept as it is (``test_sglang_patch_glue.py``); on real servers, the
version matrix (``tests/e2e/test_engine_pull_tp2.py`` on each sglang) and
``tests/e2e/test_engine_route_conflict.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_patch import compat

REPO_ROOT = Path(__file__).resolve().parents[2]


# --- compat ----------------------------------------------------------------------------------


class _Channel:
    def __init__(self):
        self.sent = []

    def send_output(self, output, request):
        self.sent.append((output, request))


class _Scheduler0516:
    """The attributes sglang 0.5.16's Scheduler has for these purposes."""

    def __init__(self, dp_rank=None):
        self.ipc_channels = type("IpcChannels", (), {})()
        self.ipc_channels.send_to_tokenizer = _Channel()
        self.ps = type("ParallelState", (), {"dp_rank": dp_rank})()


class _Scheduler0523(_Scheduler0516):
    def __init__(self):
        super().__init__()
        self.control_outputs = []

    def send_control_output(self, output, request):
        self.control_outputs.append((output, request))


class _Parallel0516:  # ParallelContext without dp_rank
    tp_rank = 0


class _Parallel0523:
    def __init__(self, dp_rank):
        self.dp_rank = dp_rank


def test_a_deferred_reply_goes_through_send_control_output_where_sglang_has_it():
    scheduler = _Scheduler0523()
    compat.control_output_sender(scheduler)("out", "req")
    assert scheduler.control_outputs == [("out", "req")]
    assert scheduler.ipc_channels.send_to_tokenizer.sent == []


def test_a_deferred_reply_goes_to_the_tokenizer_channel_on_sglang_0516():
    scheduler = _Scheduler0516()
    compat.control_output_sender(scheduler)("out", "req")
    assert scheduler.ipc_channels.send_to_tokenizer.sent == [("out", "req")]


def test_dp_rank_comes_from_the_parallel_context_or_the_schedulers_own_state():
    assert compat.dp_rank_of(_Scheduler0516(), _Parallel0523(1)) == 1
    assert compat.dp_rank_of(_Scheduler0516(dp_rank=1), _Parallel0516()) == 1
    assert compat.dp_rank_of(_Scheduler0516(), _Parallel0516()) is None


def test_no_version_checks_outside_the_adapter():
    """The plugin adapts by what sglang has, in one module; no module asks for a version."""
    offenders = []
    for path in sorted((REPO_ROOT / "sglang_patch").glob("*.py")):
        if path.name == "compat.py":
            continue
        text = path.read_text()
        if re.search(r"__version__|version\(\s*['\"]sglang|packaging\.version|importlib\.metadata", text):
            offenders.append(path.name)
    assert not offenders


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_are_no_ops_without_enable_metrics(monkeypatch):
    from sglang_patch import metrics

    monkeypatch.delenv(metrics.MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.setattr(metrics, "_metrics", None)
    metrics.observe_pull({"success": True, "seconds": 1.0, "hosts": []})
    metrics.observe_weight_update_pause("reload", 0.5)
    metrics.set_live_weight_version(3)
    assert metrics._metrics is None


def test_an_unknown_weight_update_mode_is_refused():
    from sglang_patch import metrics

    with pytest.raises(ValueError, match="'hot' is not one of"):
        metrics.observe_weight_update_pause("hot", 0.1)


_MULTIPROCESS_SCRIPT = r"""
import json, os, sys
from sglang_patch import metrics

host = {"host": "h/node0", "applied_version": 3, "source_nbytes": 1000, "reseeded": True}
metrics.observe_pull({"success": True, "applied_version": 3, "seconds": 0.5, "hosts": [host]}, sys.argv[1])
metrics.observe_pull({"success": False, "error_type": "corrupt_artifact", "seconds": 0.25,
                      "hosts": [dict(host, source_nbytes=24, reseeded=False)]})
metrics.observe_update_from_pulled({"success": True, "mode": "live", "pause_s": 0.125, "weight_version": 2})
metrics.observe_update_from_pulled({"success": False, "mode": "live", "pause_s": 9.0, "weight_version": 7})
metrics.observe_reload(sys.argv[1], True, 0.75)

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry)
print(json.dumps({f"{s.name}{sorted(s.labels.items())}": s.value
                  for fam in registry.collect() for s in fam.samples if s.name.startswith("weightsync_")}))
"""


def test_metrics_in_prometheus_multiprocess_mode_as_sglang_sets_it_up(tmp_path):
    """A separate interpreter, as in sglang: PROMETHEUS_MULTIPROC_DIR is set before anything imports
    prometheus_client, and the values are read back through the MultiProcessCollector."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    local = tmp_path / "local"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _MULTIPROCESS_SCRIPT, str(local)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])

    def value(name, **labels):
        return got.get(f"{name}{sorted(labels.items())}")

    assert value("weightsync_pulls_total", outcome="success", error_type="none") == 1
    assert value("weightsync_pulls_total", outcome="failure", error_type="corrupt_artifact") == 1
    assert value("weightsync_pull_seconds_count", outcome="success") == 1
    assert value("weightsync_pull_seconds_sum", outcome="failure") == 0.25
    assert value("weightsync_pull_source_read_bytes_total", host="h/node0") == 1024
    assert value("weightsync_reseeds_total", host="h/node0") == 1
    assert value("weightsync_applied_version", host="h/node0") == 3
    # The reload was from the dir the successful pull brought to v3.
    assert value("weightsync_live_weight_version") == 3
    assert value("weightsync_weight_update_pause_seconds_sum", mode="reload") == 0.75
    assert value("weightsync_weight_update_pause_seconds_count", mode="live") == 1  # the failed one is not
    assert value("weightsync_weight_update_pause_seconds_sum", mode="live") == 0.125
    assert any(mp_dir.iterdir()), "nothing was written to the multiprocess dir"
