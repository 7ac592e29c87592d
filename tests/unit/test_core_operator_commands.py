"""The operator commands tell the truth: ``weightsync verify`` fails a local checkpoint that lacks
tensors, naming them, and ``weightsync inspect --density`` reports tensor bytes and changed
elements for every registered encoding (each codec counts through ``codecs.DensityCodec``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightsync import Publisher, pull
from weightsync.cli import main
from weightsync.codecs import supported_encodings

from core_support import mutate, random_tensors, write_hf_checkpoint

SIZES = {"a": ("float32", (64, 8)), "b": ("int16", (40, 8)), "c": ("uint8", (100,))}


@pytest.fixture
def world(fast_tmp_path):
    root = str(fast_tmp_path)
    rng = np.random.default_rng(11)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t0 = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, t0)
    return {"seed": seed, "source": source, "local": local, "t0": t0, "rng": rng}


def publish(world, version: int, old, new, encoding: str) -> None:
    pub = Publisher(world["source"], encoding=encoding, workers=1)
    pub.seed_snapshot(old, version=version - 1)
    assert pub.publish(version, new, full=False).kind == "delta"
    pub.close()


def drop_local_tensor(local: str, name: str) -> None:
    """Rewrite the local single-file checkpoint without one tensor (its marker stays)."""
    from safetensors.numpy import load_file

    path = os.path.join(local, "model.safetensors")
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path)


def run_cli(argv, capsys) -> tuple[int, dict]:
    code = main(["--json", *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("with_seed_dir", [True, False])
def test_verify_fails_a_local_dir_that_lacks_tensors_and_names_them(world, capsys, with_seed_dir):
    t1 = mutate(world["t0"], world["rng"], 0.1, names=["a"])
    publish(world, 1, world["t0"], t1, "xor")
    pull(world["local"], world["seed"], world["source"], 1)
    code, report = run_cli(["verify", world["local"], "--source-dir", world["source"], "--version", "1",
                            *(["--seed-dir", world["seed"]] if with_seed_dir else [])], capsys)
    assert code == 0 and report["missing"] == []
    # "a" is changed by v1 (known from the delta alone); "b" only from the seed dir
    lost = ["a", "b"] if with_seed_dir else ["a"]
    for name in lost:
        drop_local_tensor(world["local"], name)
    code, report = run_cli(["verify", world["local"], "--source-dir", world["source"], "--version", "1",
                            *(["--seed-dir", world["seed"]] if with_seed_dir else [])], capsys)
    assert code == 1
    assert report["missing"] == lost
    assert main(["verify", world["local"], "--source-dir", world["source"], "--version", "1", "--seed-dir", world["seed"]]) == 1
    assert f"missing from the local checkpoint: {', '.join(lost)}" in capsys.readouterr().out


def expected_counts(old: np.ndarray, new: np.ndarray) -> tuple[int, int, int]:
    """(tensor bytes, changed elements, changed bytes), computed with numpy alone."""
    as_uint = np.dtype(f"u{old.dtype.itemsize}")  # compare bits: random bytes hold NaNs
    changed_elements = int(np.count_nonzero(old.reshape(-1).view(as_uint) != new.reshape(-1).view(as_uint)))
    changed_bytes = int(np.count_nonzero(old.reshape(-1).view(np.uint8) != new.reshape(-1).view(np.uint8)))
    return old.nbytes, changed_elements, changed_bytes


@pytest.mark.parametrize("encoding", supported_encodings())
def test_inspect_density_reports_tensor_bytes_and_changed_elements_for_every_encoding(world, capsys, encoding):
    t1 = mutate(world["t0"], world["rng"], 0.05)
    publish(world, 1, world["t0"], t1, encoding)
    code, summary = run_cli(["inspect", world["source"], "--version", "1", "--tensors", "--density",
                             "--seed-dir", world["seed"]], capsys)
    assert code == 0
    rows = {t["name"]: t for t in summary["tensor_details"]}
    assert set(rows) == set(SIZES)
    for name, row in rows.items():
        nbytes, elements, changed_bytes = expected_counts(world["t0"][name], t1[name])
        assert row["tensor_nbytes"] == nbytes, (encoding, name)
        assert row["changed_elements"] == elements, (encoding, name)
        assert row["changed_bytes"] in (None, changed_bytes), (encoding, name)  # sparse cannot know bytes
    assert summary["changed_elements"] == sum(r["changed_elements"] for r in rows.values())
    assert summary["tensor_nbytes"] == sum(t.nbytes for t in world["t0"].values())
    main(["inspect", world["source"], "--version", "1", "--density", "--seed-dir", world["seed"]])
    table = capsys.readouterr().out
    expected = 100 * summary["changed_elements"] / sum(t.size for t in world["t0"].values())
    assert f"{expected:.3f}%" in table


def test_inspect_density_takes_element_widths_from_a_preceding_full_version(world, capsys):
    t1 = mutate(world["t0"], world["rng"], 0.05)
    t2 = mutate(t1, world["rng"], 0.05)
    pub = Publisher(world["source"], encoding="xor", workers=1)
    pub.seed_snapshot(world["t0"], version=0)
    pub.publish(1, t1, full=True)
    pub.publish(2, t2, full=False)
    pub.close()
    code, summary = run_cli(["inspect", world["source"], "--version", "2", "--tensors", "--density"], capsys)
    assert code == 0
    rows = {t["name"]: t for t in summary["tensor_details"]}
    for name, row in rows.items():
        assert row["changed_elements"] == expected_counts(t1[name], t2[name])[1]
