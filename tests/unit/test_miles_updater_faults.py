"""The real updater on real gloo ranks under publish faults, and across restarts.

Two Megatron ranks (TP=1 x PP=2: two source ranks, one per stage) run ``DiskDeltaWeightUpdater``
on a tiny Qwen3 and move their weights before each sync. A small fake passed into the updater
makes one step fail once: encode (prepare) on rank 1, rank 1's shard write, the barrier
collective on every rank, rank 0's index write (ENOSPC). Then a write fails on every attempt, so
the sync fails on both ranks; the next sync publishes that version first. Then the updater is
restarted: with the same run id, then twice with fresh ids (pruning the oldest run dir). Last,
two runs with ``--update-weight-delta-encoding auto``, on a slow and on a fast declared link,
after Adam-like steps (rank 1's encoding sample fails once in the slow run).

The parent pulls every version with the core's ``pull`` onto a local checkpoint, as an engine
host would, and compares every tensor with the digests the ranks recorded for that version.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from megatron_support import free_port, move_weights, run_gloo_ranks


FAULTS = ["prepare@1", "write@1", "barrier@all", "commit@0"]  # versions 1..4, one failure each


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    work = tmp_path_factory.mktemp("updater_faults")
    hf = make_tiny_qwen3(work / "hf", seed=4)
    cfg = dict(world=2, port=free_port(), hf_dir=hf, out_dir=str(work / "out"), disk_dir=str(work / "shared"))
    seen, logs = run_gloo_ranks(__file__, cfg)
    return dict(cfg, seen=seen, logs=logs, work=work)


def _digests_at(run, key: str) -> dict:
    merged = {}
    for seen in run["seen"]:
        merged.update(seen["digests"][key])
    return merged


def _assert_pulls_to(run, local: Path, source_dir: str, version: int, key: str | None = None) -> str:
    import xxhash

    from testbed.tiny_qwen3 import read_state_dict
    from weightsync import pull

    result = pull(str(local), run["hf_dir"], source_dir, version)
    assert result.applied_version == version
    local_state = read_state_dict(local)
    expected = _digests_at(run, key or str(version))
    assert sorted(expected) == sorted(local_state)
    for name, digest in expected.items():
        got = xxhash.xxh3_128_hexdigest(local_state[name].contiguous().view(-1).view(__import__("torch").uint8).numpy())
        assert got == digest, f"v{version}: {name} differs from what the trainer published"
    return result.action


def test_a_failed_publish_step_is_retried_and_the_version_published(run, tmp_path):
    r0, r1 = run["seen"]
    source = r0["first_run_copy"]
    # Each of the first four versions met one fault and needed exactly one retry, on both ranks.
    for i, fault in enumerate(FAULTS):
        v = i + 1
        assert r0["syncs"][i]["version"] == r1["syncs"][i]["version"] == v, fault
        assert r0["syncs"][i]["publish_attempts"] == 2, fault
        assert r0["syncs"][i]["kind"] == r1["syncs"][i]["kind"] == "delta", fault
    assert r0["fault_hits"] == {"prepare@1": 0, "write@1": 0, "barrier@all": 1, "commit@0": 1}
    assert r1["fault_hits"] == {"prepare@1": 1, "write@1": 1, "barrier@all": 1, "commit@0": 0}
    # Every version holds exactly the bytes the trainer had, and each delta chains from the last.
    local = tmp_path / "ckpt"
    for v in range(1, 6):
        assert _assert_pulls_to(run, local, source, v) == ("seed+chain" if v == 1 else "chain")
    assert r0["syncs"][4]["publish_attempts"] == 1  # the next sync chained with no retry


def test_a_publish_failing_every_attempt_fails_every_rank_and_the_next_sync_publishes_it_first(run, tmp_path):
    r0, r1 = run["seen"]
    for seen in (r0, r1):
        assert "publishing v6 failed 3 time(s)" in seen["persistent_error"]
        assert "rank 1: write" in seen["persistent_error"]
        assert seen["version_after_failure"] == 5
    # The next sync published v6 with the bytes staged when it first failed, then v7.
    assert [s["version"] for s in r0["syncs"][5:7]] == [7, 8]
    assert r0["history_versions"][:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    source = r0["first_run_copy"]
    local = tmp_path / "ckpt"
    for v in range(1, 9):
        _assert_pulls_to(run, local, source, v)


def test_restart_with_the_same_run_id_continues_the_numbering_with_a_full_version(run, tmp_path):
    r0 = run["seen"][0]
    first, reopened = r0["source_dirs"][0], r0["source_dirs"][1]
    assert reopened == first
    copy = r0["first_run_copy"]  # taken before a later run pruned the first run's dir
    restart = r0["restarts"][0]
    assert restart["start"]["newest_version"] == 8 and restart["start"]["reopened"]
    assert [s["version"] for s in restart["syncs"]] == [9, 10]
    assert [s["kind"] for s in restart["syncs"]] == ["full", "delta"]
    assert "stable run id" in restart["syncs"][0]["reason"]
    # The crashed trainer's unpublished v9 dir was removed before the new v9 was written.
    assert restart["start"]["removed"] == [os.path.join(first, "weight_v000009")]
    # An engine host at v8 of this run takes v9 (seeds from the full version) and chains v10.
    local = tmp_path / "ckpt"
    _assert_pulls_to(run, local, copy, 8)
    assert _assert_pulls_to(run, local, copy, 9) == "seed"
    assert _assert_pulls_to(run, local, copy, 10) == "chain"


def test_restart_with_a_fresh_run_id_continues_the_numbering_and_prunes_old_runs(run, tmp_path):
    r0 = run["seen"][0]
    second, third = r0["restarts"][1], r0["restarts"][2]
    assert [s["version"] for s in second["syncs"]] == [11]
    assert [s["version"] for s in third["syncs"]] == [12]
    assert second["syncs"][0]["kind"] == third["syncs"][0]["kind"] == "full"
    assert "an earlier run" in second["syncs"][0]["reason"]
    # keep_runs=2: after the third run's first version, the first run dir is gone, the second stays.
    first_dir, second_dir, third_dir = r0["source_dirs"][0], r0["source_dirs"][2], r0["source_dirs"][3]
    assert not os.path.exists(first_dir)
    assert os.path.isdir(second_dir) and os.path.isdir(third_dir)
    # An engine host that followed the first run moves on to the newer runs, never backwards.
    local = tmp_path / "ckpt"
    assert _assert_pulls_to(run, local, second_dir, 11) == "seed"
    assert _assert_pulls_to(run, local, third_dir, 12) == "seed"


def test_encoding_auto_gives_every_rank_the_one_encoding_their_summed_samples_choose(run, tmp_path):
    r0, r1 = run["seen"]
    slow, fast = r0["auto"]
    assert [s["version"] for s in slow["syncs"]] == [13, 14] and [s["version"] for s in fast["syncs"]] == [15, 16]
    for r in (r0, r1):  # the metrics every rank returns (rank 0's, shared)
        assert [(s["kind"], s["encoding"]) for a in r["auto"] for s in a["syncs"]] == [
            ("full", ""), ("delta", "sparse-v2"), ("full", ""), ("delta", "sparse-v1")]
    assert slow["syncs"][1]["publish_attempts"] == 2  # the failed sample was retried, choosing the same
    assert r1["auto_sample_hits"] == 1 and r0["auto_sample_hits"] == 0
    local = tmp_path / "ckpt"
    for a, v, encoding in ((slow, 14, "sparse-v2"), (fast, 16, "sparse-v1")):
        index = json.loads((Path(a["source_dir"]) / f"weight_v{v:06d}" / "model.safetensors.index.json").read_text())
        assert index["metadata"]["delta_encoding"] == encoding
        assert sorted({f.split("-")[1] for f in index["weight_map"].values()}) == ["r00000", "r00001"]  # both ranks wrote
        _assert_pulls_to(run, local, a["source_dir"], v - 1)
        assert _assert_pulls_to(run, local, a["source_dir"], v) == "chain"


def test_reconnecting_engines_does_not_leak_threads(run):
    assert run["seen"][0]["leaked_engine_threads"] == 0


# --- the rank process ---------------------------------------------------------------------------


class Faults:
    """Fail a named step on this rank the first ``times`` times it runs (a fake passed in)."""

    def __init__(self):
        self.armed: dict[str, int] = {}
        self.hits: dict[str, int] = {f: 0 for f in FAULTS}

    def wrap(self, name: str, fn, exc_factory):
        def wrapper(*args, **kwargs):
            if self.armed.get(name, 0) > 0:
                self.armed[name] -= 1
                self.hits[name] = self.hits.get(name, 0) + 1
                raise exc_factory()
            return fn(*args, **kwargs)

        return wrapper


def _adam_like_step(model, step: int, lr: float = 2e-5) -> None:
    """Every element moves by about ``lr`` (a sign and a log-normal size): after the bf16 cast
    small weights change more often than large ones, the data sparse-v2 is for."""
    import torch

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(20_000 * step + i)
            p += lr * torch.sign(torch.randn(p.shape, generator=g)) * torch.exp(0.5 * torch.randn(p.shape, generator=g))


def _worker(rank: int, cfg: dict) -> None:
    import errno
    import threading

    import xxhash

    from miles_updater.args import DiskDeltaConfig
    from miles_updater.engines import SGLangEngineClient
    from miles_updater.gather import load_hf_checkpoint
    from miles_updater.megatron_cpu import build_gpt_model, init_distributed_cpu
    from miles_updater.updater import DiskDeltaWeightUpdater, WeightSyncFailed

    init_distributed_cpu(rank, cfg["world"], cfg["port"], tp=1, pp=2)
    model = build_gpt_model(cfg["hf_dir"])
    load_hf_checkpoint([model], cfg["hf_dir"])
    # keep_versions=64: the parent pulls every version of the first run afterwards (the core's
    # default retention would prune the oldest of them, as it should in a long run).
    config = DiskDeltaConfig(source_dir=cfg["disk_dir"], local_checkpoint_dir="/nonexistent/local",
                             hf_checkpoint=cfg["hf_dir"], publish_retry_backoff_s=0.0, keep_runs=2, keep_versions=64)
    seen: dict = {"syncs": [], "digests": {}, "source_dirs": [], "restarts": []}
    faults = Faults()

    def make_updater(run_id=None):
        u = DiskDeltaWeightUpdater(config, [model], run_id=run_id)
        if u.publisher is not None:
            u.publisher.prepare = faults.wrap("prepare@1" if rank == 1 else "-", u.publisher.prepare,
                                              lambda: MemoryError("encode ran out of memory"))
            u.publisher.write = faults.wrap("write@1" if rank == 1 else "-", u.publisher.write,
                                            lambda: OSError(errno.EIO, "shard write failed"))
            u.publisher.commit = faults.wrap("commit@0", u.publisher.commit,
                                             lambda: OSError(errno.ENOSPC, "No space left on device"))
            u.publisher.write = faults.wrap("write@every", u.publisher.write,
                                            lambda: OSError(errno.EIO, "shard write failed again"))
        plain = u._gather_objects

        def gather_objects(out, obj, step):
            if step == "barrier":
                return faults.wrap("barrier@all", plain, lambda: RuntimeError("gloo: barrier timed out"))(out, obj, step)
            return plain(out, obj, step)

        u._gather_objects = gather_objects
        seen["source_dirs"].append(u.source_dir)
        return u

    def record(m, key=None):
        seen["digests"][key or str(m.version)] = {
            n: xxhash.xxh3_128_hexdigest(t.data) for n, t in updater.gatherer.owned_tensors().items()}
        return dict(version=m.version, kind=m.kind, reason=m.reason, publish_attempts=m.publish_attempts)

    # Reconnecting rank 0's engines ends the previous group's threads (the calls fail: no server).
    updater = make_updater()
    if rank == 0:
        before = set(threading.enumerate())
        for _ in range(3):
            updater.connect_rollout_engines([SGLangEngineClient("http://127.0.0.1:9", timeout_s=1)])
            updater.engine_sync.start_baseline()
            updater.engine_sync.finish_baseline()  # logged, not raised
        updater.connect_rollout_engines([SGLangEngineClient("http://127.0.0.1:9", timeout_s=1)])
        updater.engine_sync.close()
        updater.engine_sync = None
        seen["leaked_engine_threads"] = len([t for t in set(threading.enumerate()) - before if t.is_alive()])
    updater.start()
    step = 0
    for fault in FAULTS + [None]:
        step += 1
        move_weights(model, step)
        if fault is not None:
            faults.armed[fault] = 1
        seen["syncs"].append(record(updater.update_weights(update_engines=False)))
    # Every attempt at v6 fails on rank 1's write: both ranks raise, v6 stays pending.
    step += 1
    move_weights(model, step)
    faults.armed["write@every"] = 3 if rank == 1 else 0
    try:
        updater.update_weights(update_engines=False)
        seen["persistent_error"] = ""
    except WeightSyncFailed as e:
        seen["persistent_error"] = str(e)
    seen["version_after_failure"] = updater.version
    seen["digests"]["6"] = {n: xxhash.xxh3_128_hexdigest(t.data) for n, t in updater.gatherer.owned_tensors().items()}
    for _ in range(2):
        step += 1
        move_weights(model, step)
        seen["syncs"].append(record(updater.update_weights(update_engines=False)))
    seen["history_versions"] = [m.version for m in updater.history]
    seen["fault_hits"] = {k: faults.hits[k] for k in FAULTS}
    run_id = updater.run_id
    updater.close()

    # A crashed trainer left an unpublished v9 (shards, no index); the restart reopens the run.
    stale = Path(cfg["disk_dir"]) / f"run-{run_id}" / "weight_v000009"
    if rank == 0:
        stale.mkdir()
        (stale / "delta-r00000-00001.safetensors").write_bytes(b"torn")
    import torch.distributed as dist

    dist.barrier()
    for i, run in enumerate((run_id, None, None)):
        if i == 2 and rank == 0:  # the parent checks the first run, which this run prunes
            import shutil

            seen["first_run_copy"] = os.path.join(cfg["out_dir"], "first-run-copy")
            shutil.copytree(seen["source_dirs"][0], seen["first_run_copy"])
        updater = make_updater(run)
        updater.start()
        syncs = []
        for _ in range(2 if run else 1):
            step += 1
            move_weights(model, step)
            syncs.append(record(updater.update_weights(update_engines=False)))
        start = updater.run_start
        seen["restarts"].append({"start": dict(newest_version=start.newest_version, reopened=start.reopened,
                                               removed=start.removed), "syncs": syncs})
        updater.close()
    # Encoding auto, a slow then a fast declared link (fresh runs, every run dir kept).
    import dataclasses

    seen["auto"] = []
    for link in (1e3, 1e15):
        auto = dataclasses.replace(config, encoding="auto", link_bytes_per_s=link, keep_runs=0)
        updater = DiskDeltaWeightUpdater(auto, [model])
        if updater.publisher is not None and link == 1e3:
            updater.publisher.sample_encodings = faults.wrap(
                "sample@1", updater.publisher.sample_encodings, lambda: MemoryError("sample ran out of memory"))
        updater.start()
        syncs = []
        for _ in range(2):
            step += 1
            _adam_like_step(model, step)
            if link == 1e3 and rank == 1:
                faults.armed["sample@1"] = 1
            m = updater.update_weights(update_engines=False)
            syncs.append(dict(record(m), encoding=m.encoding))
        seen["auto"].append({"source_dir": updater.source_dir, "syncs": syncs})
        updater.close()
    seen["auto_sample_hits"] = faults.hits.get("sample@1", 0)
    (Path(cfg["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
