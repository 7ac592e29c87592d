"""The ranks that do not drive the engines wait for rank 0's engine phase, however long it lasts.

Two real Megatron ranks (TP=2, gloo) whose training process group has a short collective timeout
(GROUP_TIMEOUT_S) run ``DiskDeltaWeightUpdater``. Rank 0 drives one engine whose first pull is
slower than that timeout (a slow shared filesystem: the only part made slow on purpose). The engine
is a host-side stand-in: its pull is the core's real ``pull`` onto a local checkpoint, and its
reload reads that checkpoint back, so what it serves is what it pulled.

Every rank must return success for that sync, the next sync must work, and the engine must serve
exactly the trainer's bytes. A last step shows the timeout is real: the same wait on the training
group fails on both ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from megatron_support import free_port, run_gloo_ranks

GROUP_TIMEOUT_S = 6.0
SLOW_PULL_S = 2.5 * GROUP_TIMEOUT_S


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    work = tmp_path_factory.mktemp("engine_wait")
    hf = make_tiny_qwen3(work / "hf", seed=8)
    cfg = dict(port=free_port(), hf_dir=hf, out_dir=str(work / "out"), disk_dir=str(work / "shared"),
               local_dir=str(work / "engine" / "ckpt"))
    seen, _ = run_gloo_ranks(__file__, cfg)
    return dict(cfg, seen=seen)


def test_an_engine_phase_longer_than_the_group_timeout_succeeds_on_every_rank(run):
    for seen in run["seen"]:
        assert seen["errors"] == [], seen["errors"]
        assert [s["version"] for s in seen["syncs"]] == [1, 2]
        # Rank 0's metrics, shared: the first pull really outlasted the training group's timeout.
        assert seen["syncs"][0]["pull_s"] > GROUP_TIMEOUT_S
    assert run["seen"][0]["serves"] == [1, 2]


def test_after_a_long_engine_phase_the_next_sync_works_and_the_engine_serves_the_trainers_bytes(run):
    r0 = run["seen"][0]
    assert r0["served_equals_published"] == {"1": True, "2": True}
    assert r0["syncs"][1]["changed_elements"] > 0  # v2 moved the weights: not a no-op sync
    for seen in run["seen"]:
        assert seen["training_group_after"] == 2  # the training group still works after both syncs


def test_the_training_group_alone_would_have_timed_out(run):
    # The same wait on the training group (rank 0 busy for longer than its timeout) fails.
    for seen in run["seen"]:
        assert seen["control_error"], "the short training-group timeout did not apply"


# --- the rank process ---------------------------------------------------------------------------


class HostEngine:
    """One engine host: the core's real pull onto its local checkpoint; a reload reads it back."""

    name = "engine0"

    def __init__(self, hf_dir: str, slow_pull_versions: dict[int, float]):
        self.hf_dir = hf_dir
        self.slow = slow_pull_versions
        self.served_version = 0
        self.served: dict = {}
        self.calls: list[str] = []

    def pull_weights(self, local_checkpoint_dir, source_dir, target_version):
        from weightsync import pull

        self.calls.append(f"pull {target_version}")
        time.sleep(self.slow.get(int(target_version), 0.0))
        result = pull(local_checkpoint_dir, self.hf_dir, source_dir, int(target_version))
        return {"success": True, "applied_version": result.applied_version, "action": result.action}

    def pause_generation(self, mode="retract"):
        self.calls.append("pause")
        return {"success": True}

    def update_weights_from_disk(self, model_path, weight_version=None, flush_cache=True):
        from testbed.tiny_qwen3 import read_state_dict

        self.calls.append(f"reload {weight_version}")
        self.served = read_state_dict(model_path)
        self.served_version = int(weight_version)
        return {"success": True}

    def update_weights_from_pulled(self, local_checkpoint_dir, target_version, flush_cache=True):
        raise AssertionError("the config asks for reloads")

    def continue_generation(self):
        self.calls.append("continue")
        return {"success": True}


def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from miles_updater.args import DiskDeltaConfig
    from miles_updater.gather import load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater

    init_distributed_cpu(rank, 2, cfg["port"], tp=2, timeout_s=GROUP_TIMEOUT_S)
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    config = DiskDeltaConfig(source_dir=cfg["disk_dir"], local_checkpoint_dir=cfg["local_dir"],
                             hf_checkpoint=cfg["hf_dir"], apply_mode="reload", pull_timeout_s=60.0,
                             engine_timeout_s=10.0, not_ready_retry_s=5.0)
    # The world passed explicitly, as a host trainer may: its wait group is agreed by every rank.
    updater = DiskDeltaWeightUpdater(config, [model], group=dist.group.WORLD)
    engine = HostEngine(cfg["hf_dir"], {1: SLOW_PULL_S})
    updater.connect_rollout_engines([engine], ["engine0"])
    seen: dict = {"syncs": [], "errors": [], "serves": [], "served_equals_published": {}}
    for step in (1, 2):
        if step == 2:
            with torch.no_grad():  # the same move on both TP ranks for replicated parameters
                for i, p in enumerate(model.parameters()):
                    g = torch.Generator().manual_seed(
                        100 * i + rank * int(bool(getattr(p, "tensor_model_parallel", False))))
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        try:
            m = updater.update_weights()
            seen["syncs"].append(m.as_dict())
        except Exception as e:  # noqa: BLE001 - recorded for the parent to show
            seen["errors"].append(f"v{step}: {type(e).__name__}: {e}")
            continue
        if rank == 0:
            seen["serves"].append(engine.served_version)
            published = updater.gatherer.owned_tensors()  # TP=2, PP=1: rank 0 owns every tensor
            same = sorted(published) == sorted(engine.served) and all(
                engine.served[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() == bytes(t.data)
                for n, t in published.items())
            seen["served_equals_published"][str(m.version)] = same
    box = [None, None]
    dist.all_gather_object(box, rank)  # the training group after both syncs
    seen["training_group_after"] = len([b for b in box if b is not None])
    # Control: rank 0 busy for longer than the training group's timeout before the same all-gather.
    if rank == 0:
        time.sleep(2 * GROUP_TIMEOUT_S)
    try:
        dist.all_gather_object(box, rank)
        seen["control_error"] = ""
    except RuntimeError as e:
        seen["control_error"] = str(e)[:300]
    (Path(cfg["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # the training group timed out on purpose: no orderly teardown


if __name__ == "__main__":
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
