"""A bucket URL where the trainers take a dir: ``TorchWeightSync``'s disk dir and the Megatron
updater's ``--update-weight-disk-dir`` (run numbering, leftovers and retention read from the
bucket's listing), against a real S3 server on loopback (SeaweedFS ``weed mini``)."""

from __future__ import annotations

import uuid

import pytest
import torch

from miles_updater.runs import list_runs, plan_run_start, prune_runs, remove_unpublished_above, run_dir
from miles_updater.torch_publish import TorchWeightSync
from weightsync.storage.source import BucketSource

from bucket_support import s3_env, s3_server_fixture  # noqa: F401 (fixtures)
from trainer_support import assert_pulls_to

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("hf") / "ckpt", seed=3)


@pytest.fixture
def disk_url(s3_env):
    return s3_env.url(f"trainer/{uuid.uuid4().hex[:10]}")


def _perturb(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {n: (t.float() + 1e-2 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in state.items()}


def test_torch_weight_sync_publishes_to_a_bucket_url_and_engines_pull_the_published_bytes(hf, disk_url, tmp_path):
    from testbed.tiny_qwen3 import read_state_dict

    base = {n: t.to(torch.bfloat16) for n, t in read_state_dict(hf).items()}
    sync = TorchWeightSync(disk_url, hf, run_id="r1")
    assert sync.source_dir == f"{disk_url}/run-r1"
    for k in (1, 2):
        state = _perturb(base, k)
        m = sync.publish(state)
        assert m.version == k
        assert assert_pulls_to(tmp_path / "local", hf, sync.source_dir, k, state) in ("seed+chain", "chain", "seed")
    sync.close()
    assert f"run-r1/weight_v000002/{INDEX}" in BucketSource(disk_url).list()


def test_a_restarted_torch_sync_on_a_bucket_continues_the_numbering_and_prunes_old_runs(hf, disk_url, tmp_path):
    from testbed.tiny_qwen3 import read_state_dict

    base = {n: t.to(torch.bfloat16) for n, t in read_state_dict(hf).items()}
    first = TorchWeightSync(disk_url, hf, run_id="a", keep_runs=1)
    first.publish(_perturb(base, 1))
    first.publish(_perturb(base, 2))
    first.close()
    again = TorchWeightSync(disk_url, hf, run_id="b", keep_runs=1)
    state = _perturb(base, 3)
    m = again.publish(state)
    assert (m.version, m.kind) == (3, "full") and "an earlier run" in m.reason
    again.close()
    keys = BucketSource(disk_url).list()
    assert not [k for k in keys if k.startswith("run-a/")], "the older run is removed from the bucket"
    assert assert_pulls_to(tmp_path / "local", hf, again.source_dir, 3, state) == "seed"


def test_the_updaters_run_planning_on_a_bucket_removes_unpublished_leftovers_and_counts_published_versions(disk_url):
    src = BucketSource(disk_url)
    src.create(f"run-old/weight_v000004/{INDEX}", b"{}")
    src.create("run-old/weight_v000004/model-00001-of-00001.safetensors", b"x")
    src.create(f"run-job/weight_v000002/{INDEX}", b"{}")
    src.create("run-job/weight_v000003/model-00001-of-00001.safetensors", b"x")  # a crashed write: no index
    own = run_dir(disk_url, "job")
    assert [v for v, _ in list_runs(disk_url)] == [2, 4]
    start = plan_run_start(disk_url, own)
    assert start.newest_version == 4 and start.reopened and start.first_is_full
    assert start.removed == [f"{own}/weight_v000003"]
    assert "run-job/weight_v000003/model-00001-of-00001.safetensors" not in src.list()
    assert remove_unpublished_above(own, 2) == []
    assert prune_runs(disk_url, 1, own) == [f"{disk_url}/run-old"]
    assert sorted(src.list()) == [f"run-job/weight_v000002/{INDEX}"]


def test_the_updaters_disk_dir_takes_a_bucket_url_and_refuses_one_that_names_more_than_a_bucket_and_prefix(tmp_path):
    import argparse

    from miles_updater.args import UpdateWeightArgsError, add_update_weight_arguments, validate_update_weight_args

    (tmp_path / "hf").mkdir()

    def validate(disk_dir: str):
        argv = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", disk_dir,
                "--update-weight-local-checkpoint-dir", str(tmp_path / "local"), "--hf-checkpoint", str(tmp_path / "hf")]
        return validate_update_weight_args(add_update_weight_arguments(argparse.ArgumentParser()).parse_args(argv))

    assert validate("s3://wsync/runs/").source_dir == "s3://wsync/runs"
    with pytest.raises(UpdateWeightArgsError, match="update-weight-disk-dir"):
        validate("s3://wsync/runs?endpoint=http://elsewhere")
