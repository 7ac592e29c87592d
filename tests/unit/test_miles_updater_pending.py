"""The Megatron updater on real gloo ranks: one contract for a version whose publish failed.

Two ranks (TP=1 x PP=2, two source ranks) run ``DiskDeltaWeightUpdater`` on a tiny Qwen3 and
move their weights before each sync. The rule (the same as ``TorchWeightSync``'s and the
core's): after a failed publish of vN, the next sync first finishes vN with the bytes staged
for it (or counts vN as published when its index had landed and only a later step failed),
then publishes the new weights as vN+1, a delta; a version nothing was written for is published
with the next weights. Three cases, each failing on every attempt:
- v1's index write (ENOSPC on rank 0, the real index write of the core);
- the pruning after v3's index landed (rank 0);
- rank 1's encode of v5 (nothing written anywhere).
The parent pulls every version with the core's ``pull`` and compares every tensor with what the
ranks gathered at the step that published it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from megatron_support import free_port, move_weights, run_gloo_ranks


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    work = tmp_path_factory.mktemp("updater_pending")
    hf = make_tiny_qwen3(work / "hf", seed=5)
    cfg = dict(world=2, port=free_port(), hf_dir=hf, out_dir=str(work / "out"), disk_dir=str(work / "shared"))
    seen, logs = run_gloo_ranks(__file__, cfg)
    return dict(cfg, seen=seen, logs=logs)


def _assert_pulls_to(run, local: Path, version: int) -> str:
    import torch
    import xxhash

    from testbed.tiny_qwen3 import read_state_dict
    from weightsync import pull

    result = pull(str(local), run["hf_dir"], run["seen"][0]["source_dir"], version)
    assert result.applied_version == version
    state = read_state_dict(local)
    expected = {}
    for seen in run["seen"]:
        expected.update(seen["digests"][str(version)])
    assert sorted(expected) == sorted(state)
    for name, digest in expected.items():
        got = xxhash.xxh3_128_hexdigest(state[name].contiguous().view(-1).view(torch.uint8).numpy())
        assert got == digest, f"v{version}: {name} is not what the trainer had at the step that published it"
    return result.action


def test_after_every_index_write_failed_the_next_sync_finishes_the_version_with_its_staged_bytes_then_a_delta(run, tmp_path):
    for seen in run["seen"]:
        case = seen["cases"]["index"]
        assert "publishing v1 failed 2 time(s)" in case["error"] and "No space left" in case["error"]
        assert case["version_after_failure"] == 0
        # The next sync finished v1 (a delta from the seed) before publishing v2, a delta from v1.
        assert case["next"] == [[1, "delta"], [2, "delta"]]
    local = tmp_path / "ckpt"
    assert _assert_pulls_to(run, local, 1) == "seed+chain"  # v1 holds the step-1 weights, not step 2's
    assert _assert_pulls_to(run, local, 2) == "chain"


def test_after_every_prune_failed_the_version_whose_index_landed_counts_as_published(run, tmp_path):
    for seen in run["seen"]:
        case = seen["cases"]["prune"]
        assert "publishing v3 failed 2 time(s)" in case["error"] and "while pruning" in case["error"]
        assert case["version_after_failure"] == 2
        assert case["next"] == [[3, "delta"], [4, "delta"]]
    assert run["seen"][0]["cases"]["prune"]["index_written_once"]
    local = tmp_path / "ckpt"
    _assert_pulls_to(run, local, 2)
    assert _assert_pulls_to(run, local, 3) == "chain"
    assert _assert_pulls_to(run, local, 4) == "chain"


def test_a_version_nothing_was_written_for_is_published_with_the_next_weights(run, tmp_path):
    for seen in run["seen"]:
        case = seen["cases"]["encode"]
        assert "publishing v5 failed 2 time(s)" in case["error"] and "rank 1: prepare" in case["error"]
        assert case["next"] == [[5, "delta"]]
    local = tmp_path / "ckpt"
    _assert_pulls_to(run, local, 4)
    assert _assert_pulls_to(run, local, 5) == "chain"  # digests "5": the weights of the step after the failure


# --- the rank process ---------------------------------------------------------------------------


def _worker(rank: int, cfg: dict) -> None:
    import errno
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective shows its stack, not only a timeout

    import torch.distributed as dist
    import xxhash

    import weightsync.publisher.publish as publish_mod
    from miles_updater.args import DiskDeltaConfig
    from miles_updater.gather import load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater, WeightSyncFailed

    init_distributed_cpu(rank, cfg["world"], cfg["port"], tp=1, pp=2)
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    config = DiskDeltaConfig(source_dir=cfg["disk_dir"], local_checkpoint_dir="/nonexistent/local",
                             hf_checkpoint=cfg["hf_dir"], publish_attempts=2, publish_retry_backoff_s=0.0,
                             keep_versions=64)
    updater = DiskDeltaWeightUpdater(config, [model])
    updater.start()
    seen: dict = {"digests": {}, "cases": {}, "source_dir": updater.source_dir}
    pub = updater.publisher
    real_write_bytes, real_prune, real_encode = publish_mod.write_bytes, pub.retention.prune, pub.encoder.prepare
    index_writes: dict[str, int] = {}

    def record(version: int) -> None:
        seen["digests"][str(version)] = {
            n: xxhash.xxh3_128_hexdigest(t.data) for n, t in updater.gatherer.owned_tensors().items()}

    def failing_sync(case: str, version: int) -> None:
        try:
            updater.update_weights(update_engines=False)
            error = ""
        except WeightSyncFailed as e:
            error = str(e)
        record(version)  # the gather of the failed sync: the bytes that version was given
        seen["cases"][case] = {"error": error, "version_after_failure": updater.version}

    def next_sync(case: str, version: int) -> None:
        before = len(updater.history)
        updater.update_weights(update_engines=False)
        record(version)
        seen["cases"][case]["next"] = [(m.version, m.kind) for m in updater.history[before:]]

    def index_failing(path, data, **kw):
        index_writes[path] = index_writes.get(path, 0) + 1
        if path.endswith(os.path.join("weight_v000001", "model.safetensors.index.json")) and disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write_bytes(path, data, **kw)

    disk = {"full": rank == 0}
    publish_mod.write_bytes = index_failing
    move_weights(model, 1)
    failing_sync("index", 1)
    disk["full"] = False  # the disk recovered
    move_weights(model, 2)
    next_sync("index", 2)

    def prune_failing():
        raise OSError(errno.EIO, "Input/output error while pruning")

    if rank == 0:
        pub.retention.prune = prune_failing
    move_weights(model, 3)
    failing_sync("prune", 3)
    pub.retention.prune = real_prune
    move_weights(model, 4)
    next_sync("prune", 4)
    v3_index = os.path.join(updater.source_dir, "weight_v000003", "model.safetensors.index.json")
    seen["cases"]["prune"]["index_written_once"] = index_writes.get(v3_index) == 1

    def encode_failing(*a, **kw):
        raise MemoryError("encoder ran out of memory")

    if rank == 1:
        pub.encoder.prepare = encode_failing
    move_weights(model, 5)
    failing_sync("encode", 5)
    pub.encoder.prepare = real_encode
    move_weights(model, 6)
    next_sync("encode", 5)
    (Path(cfg["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(seen))
    updater.close()
    dist.barrier()


if __name__ == "__main__":
    try:
        _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
