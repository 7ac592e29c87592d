"""The run records its seed's per-tensor digests (issue 25 point 3): a pull from a wrong seed
dir is told so, not that the published delta is corrupt; a run without the record (an older
publisher's) pulls and fails as before. Real files, the real CLI and puller."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.cli import main

from core_support import marker_version, mutate, random_tensors, write_hf_checkpoint

SIZES = {"embed": ("float32", (64, 16)), "norm": ("float32", (16,))}


@pytest.fixture
def run(fast_tmp_path, rng):
    root = str(fast_tmp_path)
    t0 = random_tensors(rng, SIZES)
    seed, wrong, source = (os.path.join(root, n) for n in ("seed", "wrong-seed", "src"))
    write_hf_checkpoint(seed, t0)
    other = (t0["embed"].view(np.uint32) ^ np.uint32(1)).view(np.float32)
    write_hf_checkpoint(wrong, {**t0, "embed": other})  # another model, same layout
    pub = Publisher(source, workers=1)
    pub.seed_snapshot(t0)
    pub.publish(1, mutate(t0, rng, 0.05, ["embed"]))
    pub.close()
    return {"root": root, "seed": seed, "wrong": wrong, "source": source}


def test_a_pull_from_a_seed_dir_that_is_not_the_run_s_seed_says_so(run, capsys):
    local = os.path.join(run["root"], "local")
    with pytest.raises(errors.SeedDirMismatchError, match=r"is not the model the run .* started from: 1 tensor\(s\) differ.*embed") as info:
        pull(local, run["wrong"], run["source"], 1)
    assert info.value.mismatches[0][0] == "embed" and marker_version(local) is None
    assert main(["--json", "pull", os.path.join(run["root"], "local2"), "--seed-dir", run["wrong"],
                 "--source-dir", run["source"], "--version", "1"]) == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error_type"] == "seed_dir_mismatch"
    assert pull(local, run["seed"], run["source"], 1).applied_version == 1  # the right seed dir pulls


def test_without_a_seed_record_a_wrong_seed_dir_is_still_a_corrupt_artifact(run):
    path = os.path.join(run["source"], "weightsync-run.json")
    with open(path) as f:
        obj = json.load(f)
    del obj["seed"]  # as an older publisher wrote it
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(errors.CorruptArtifactError) as info:
        pull(os.path.join(run["root"], "local"), run["wrong"], run["source"], 1)
    assert not isinstance(info.value, errors.SeedDirMismatchError)
    assert pull(os.path.join(run["root"], "local-ok"), run["seed"], run["source"], 1).applied_version == 1


def test_a_pull_from_another_model_of_the_same_layout_is_refused_before_any_weight_file_is_written(fast_tmp_path, rng):
    # Every tensor differs (another initialisation of the same architecture): the run's smallest
    # recorded seed tensors already say so, before the seed copy writes a weight file.
    root = str(fast_tmp_path)
    t0 = random_tensors(rng, SIZES)
    seed, other, source = (os.path.join(root, n) for n in ("seed", "other", "src"))
    write_hf_checkpoint(seed, t0)
    write_hf_checkpoint(other, random_tensors(rng, SIZES))
    pub = Publisher(source, workers=1)
    pub.seed_snapshot(t0)
    pub.publish(1, mutate(t0, rng, 0.05, list(SIZES)))
    pub.close()
    local = os.path.join(root, "local")
    with pytest.raises(errors.SeedDirMismatchError, match=r"is not the model the run .* started from"):
        pull(local, other, source, 1)
    assert marker_version(local) is None
    assert not [f for f in os.listdir(local) if f.endswith(".safetensors")]
    assert pull(local, seed, source, 1).applied_version == 1
