"""The pause waits for the device before anything is reported (issue 19, point 10).

A rank's writes are fenced (``live.scatter.device.PauseFence``): on CUDA, events order them with
sglang's forward stream and ``wait`` blocks until the last one ran, raising an asynchronous
device error there. No device here, so the fence is the one fake: a recording fence whose
``wait`` can fail the way ``event.synchronize()`` does after a failed kernel. Everything else
is real: a core pull of a tiny Qwen3 chain, one rank's ``LiveApplyState`` staging it, and the
engine-wide transaction (``live.transaction.run_transaction``) driving that rank's
``handle_update`` phase by phase. sglang's weight updater is a stand-in that reloads by the
model's own ``load_weights`` (and calls the reload hooks as sglang's would). The real CUDA
fence runs in the GPU kit (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import torch

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx
from sglang_patch.live.scatter.device import HostFence, pause_fence_for

from live_support import cpu_standins_on_path, serve_from_local

WAIT_S = 0.2
with cpu_standins_on_path():
    from sglang.srt.managers import io_struct  # noqa: F401  (the reload phase's request type)
    from sglang_patch.io_types import UpdateWeightsFromPulledReqInput, UpdateWeightsFromPulledReqOutput


class RecordingFence:
    """Logs each call into ``log``; ``wait`` sleeps ``WAIT_S`` (the device finishing) and then
    raises ``fail`` that many times (an asynchronous device error surfacing at the wait)."""

    def __init__(self, log: list, fail: int = 0) -> None:
        self.log, self.fail = log, fail

    def begin_writes(self) -> None:
        self.log.append("begin_writes")

    def end_writes(self) -> None:
        self.log.append("end_writes")

    def wait(self) -> None:
        time.sleep(WAIT_S)
        self.log.append("wait")
        if self.fail:
            self.fail -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected at the fence)")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from testbed.feed import VersionFeed
    from testbed.tiny_qwen3 import make_tiny_qwen3
    from weightsync import pull

    root = tmp_path_factory.mktemp("live_fence")
    model_dir = make_tiny_qwen3(root / "model")
    feed = VersionFeed(model_dir, root / "shared")
    feed.publish(1)
    feed.publish(2)
    return SimpleNamespace(root=str(root), model_dir=model_dir, feed=feed, pull=pull)


class WeightUpdater:
    """sglang's scheduler weight updater, as far as live apply calls it: the cache flush and the
    weight version are logged; a reload is the model's own ``load_weights`` of the dir, between
    the hooks sglang's registry runs around it."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.state = None

    def flush_cache_after_weight_update(self, recv_req, success, message):
        self.log.append("flush")
        return success, message

    def record_weight_version_after_update(self, version):
        self.log.append(f"version {version}")

    def update_weights_from_disk(self, req):
        from testbed.tiny_qwen3 import read_state_dict

        self.log.append("reload")
        self.state.begin_reload(req.model_path)
        self.state.model.load_weights(read_state_dict(req.model_path).items())
        self.state.after_reload(req.model_path, True)
        return SimpleNamespace(success=True, message="reloaded")


def _rank_with_v2_staged(chain, tmp_path, log: list, fail: int):
    """One rank serving v1, with v2 pulled and staged, its fence the recording one."""
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from sglang_patch.live.mapping.stage import stage_job

    local = str(tmp_path / "local")
    chain.pull(local, chain.model_dir, chain.feed.source_dir, 1)
    state, model = serve_from_local(local, chain.model_dir, f"reload from {local} (marker)")
    state.proof.prove(CheckpointReader(local), state.live, checkpoint_dir=local)
    assert state.cmap.proven
    state.allowed_roots = (os.path.realpath(str(tmp_path)),)
    state.scheduler.weight_updater = WeightUpdater(log)
    state.scheduler.server_args = SimpleNamespace(load_format="auto")
    state.scheduler.weight_updater.state = state
    v1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    chain.pull(local, chain.model_dir, chain.feed.source_dir, 2)
    state.stage_after_pull(local, chain.feed.source_dir, 2, stage_job)
    assert state.weights.staged is not None and state.weights.staged.elements > 0, state.weights.stage_reason
    assert isinstance(state.weights.staged.fence, HostFence)  # what staging made for CPU parameters
    state.weights.staged.fence = RecordingFence(log, fail)
    return state, model, local, v1


def _run_update(state, local: str, log: list) -> dict:
    """The tokenizer's transaction with this one rank as the engine; each phase's reply logged."""
    txn = tx.new_transaction_id()

    async def send(phase, reason):
        request = UpdateWeightsFromPulledReqInput(local_checkpoint_dir=local, target_version=2, phase=phase,
                                                  txn=txn, reason=reason)
        out = state.handle_update(request, reply_type=UpdateWeightsFromPulledReqOutput)
        log.append(f"reply {phase}")
        return tx.PhaseReplies(votes=list(out.votes), reports=list(out.reports))

    return asyncio.run(tx.run_transaction(send, 2))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_a_rank_reports_its_writes_and_commits_only_after_the_fence_waited_for_the_device(chain, tmp_path):
    log: list = []
    state, model, local, _ = _rank_with_v2_staged(chain, tmp_path, log, fail=0)
    fields = _run_update(state, local, log)
    assert fields["success"] and fields["mode"] == lr.LIVE and fields["weight_version"] == 2, fields["message"]
    assert log[:5] == ["reply vote", "begin_writes", "end_writes", "wait", "reply apply"], log
    assert log.index("flush") > log.index("wait") and log[-1] == "reply commit"
    # the pause is timed after the device finished: the fence's wait is inside it
    (host,) = fields["hosts"]
    assert host.scatter_s >= WAIT_S and host.pause_s >= WAIT_S and fields["pause_s"] >= WAIT_S


def test_a_device_error_surfacing_at_the_fence_restores_the_rank_and_the_engine_replies_rolled_back(chain, tmp_path):
    log: list = []
    state, model, local, v1 = _rank_with_v2_staged(chain, tmp_path, log, fail=1)
    fields = _run_update(state, local, log)
    assert fields["success"] is False and fields["rolled_back"] is True and fields["weight_version"] == 1
    assert "illegal memory access" in fields["message"]
    assert "flush" not in log and "reload" not in log  # nothing committed, nothing reloaded
    # the scatter's wait failed, its restore waited again (and held): before the apply's reply
    assert log[:7] == ["reply vote", "begin_writes", "end_writes", "wait", "begin_writes", "end_writes", "wait"], log
    assert log[7] == "reply apply"
    assert _same(_weights(model), v1)
    assert state.live.version == 1


def test_a_device_error_that_stays_makes_the_restore_not_restored_and_every_rank_reload(chain, tmp_path):
    from testbed.tiny_qwen3 import read_state_dict

    log: list = []
    state, model, local, _ = _rank_with_v2_staged(chain, tmp_path, log, fail=2)  # the restore's wait fails too
    fields = _run_update(state, local, log)
    assert fields["success"] is True and fields["mode"] == lr.RELOAD and fields["weight_version"] == 2
    assert "could not be restored" in fields["reason"] and "illegal memory access" in fields["reason"]
    assert "flush" not in log and log.index("reload") > log.index("reply apply")
    reloaded = _weights(model)
    for n, t in read_state_dict(local).items():  # FlatModel: one parameter per checkpoint tensor
        assert torch.equal(reloaded[f"p{model.names.index(n)}"].view(-1), t.view(-1).to(reloaded[f"p{model.names.index(n)}"].dtype))


def test_cpu_parameters_get_the_fence_that_does_nothing_and_other_devices_are_refused():
    assert isinstance(pause_fence_for({"w": torch.zeros(2)}), HostFence)
    with pytest.raises(RuntimeError, match="on the CPU or on one CUDA device"):
        pause_fence_for({"w": torch.zeros(2, device="meta")})
