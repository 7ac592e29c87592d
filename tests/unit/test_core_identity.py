"""A local state is bound to the seed it grew from and to the run that published its chain: a
pull never reports success over another model's or another run's bytes.

Markers are read and written as FORMAT.md spells them; the run file is the source dir's
``weightsync-run.json``."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from weightsync import Publisher, errors, pull

from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

SIZES = {"w1": ("float32", (32, 32)), "w2": ("float32", (32, 32)), "b": ("int16", (7,))}


def publish_run(source: str, t0, rng, versions: int, density: float = 0.05):
    """A fresh run of ``versions`` deltas from t0; returns the tensors of every version."""
    t = [t0]
    pub = Publisher(source, encoding="xor", workers=1)
    pub.seed_snapshot(t0)
    for v in range(1, versions + 1):
        t.append(mutate(t[-1], rng, density))
        pub.publish(v, t[v])
    pub.close()
    return t


def read_marker(local: str) -> dict:
    with open(os.path.join(local, ".weight_sync", "state.json")) as f:
        return json.load(f)


@pytest.fixture
def dirs(fast_tmp_path):
    root = str(fast_tmp_path)
    return {n: os.path.join(root, n) for n in ("model_a", "model_b", "src", "local")}


# --- the seed --------------------------------------------------------------------------------------


def test_engine_restarted_from_other_model_reseeds_at_v0(dirs, rng):
    a, b = random_tensors(rng, SIZES), random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    write_hf_checkpoint(dirs["model_b"], b)
    assert pull(dirs["local"], dirs["model_a"], dirs["src"], 0).action == "seed"
    assert pull(dirs["local"], dirs["model_a"], dirs["src"], 0).action == "noop"  # same model: nothing to do
    result = pull(dirs["local"], dirs["model_b"], dirs["src"], 0)  # the engine restarted from model B
    assert result.action == "seed" and "the seed dir changed" in result.reason
    assert_checkpoint_is(dirs["local"], tensor_bytes(b))


def test_model_replaced_in_place_with_the_same_sizes_and_mtimes_reseeds(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 0)
    weights = os.path.join(dirs["model_a"], "model.safetensors")
    st = os.stat(weights)
    other = random_tensors(rng, SIZES)  # same names, dtypes, shapes: the same header and size
    write_hf_checkpoint(dirs["model_a"], other)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # even the mtime kept (cp -p of another model)
    assert os.path.getsize(weights) == st.st_size
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 0)
    assert result.action == "seed"
    assert_checkpoint_is(dirs["local"], tensor_bytes(other))


def test_delta_of_one_model_is_never_reported_applied_over_another_model(dirs, rng):
    """The old failure: marker at v0 from model A, the engine restarts from model B, and v1
    (built on A) only checks the tensors it changes. Now the local state is B's v0, the delta
    does not verify on it, and the pull fails loud instead of naming v1 over B's bytes."""
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    t = publish_run(dirs["src"], a, rng, 1, density=0.01)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 0)
    b = dict(a, w1=random_tensors(rng, {"w1": SIZES["w1"]})["w1"])
    write_hf_checkpoint(dirs["model_b"], b)
    with pytest.raises(errors.CorruptArtifactError):
        pull(dirs["local"], dirs["model_b"], dirs["src"], 1)
    assert marker_version(dirs["local"]) in (None, 0)
    # With its own model the same delta pulls exactly.
    pull(dirs["local"], dirs["model_a"], dirs["src"], 1)
    assert_checkpoint_is(dirs["local"], tensor_bytes(t[1]))


def test_marker_without_a_seed_fingerprint_counts_as_no_local_state(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    publish_run(dirs["src"], a, rng, 2)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 1)
    marker = read_marker(dirs["local"])
    del marker["seed"]  # written by an older puller
    with open(os.path.join(dirs["local"], ".weight_sync", "state.json"), "w") as f:
        json.dump(marker, f)
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    assert result.action == "seed+chain" and "no seed fingerprint" in result.reason


# --- the run -------------------------------------------------------------------------------------


def test_new_run_in_same_source_dir_is_not_mistaken_for_old(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    old = publish_run(dirs["src"], a, rng, 2)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    old_run = read_marker(dirs["local"])["run"]
    shutil.rmtree(dirs["src"])  # what PublishError advises for a new run
    new = publish_run(dirs["src"], a, rng, 3)
    assert tensor_bytes(new[2]) != tensor_bytes(old[2])
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 2)  # the same number, another run
    assert result.action != "noop" and f"local state came from run {old_run}" in result.reason
    assert_checkpoint_is(dirs["local"], tensor_bytes(new[2]))
    assert read_marker(dirs["local"])["run"] != old_run


def test_lower_target_of_a_new_run_is_not_refused_as_backwards(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    publish_run(dirs["src"], a, rng, 3)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 3)
    shutil.rmtree(dirs["src"])
    new = publish_run(dirs["src"], a, rng, 1)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 1)  # not a BackwardPullError: another run's v1
    assert_checkpoint_is(dirs["local"], tensor_bytes(new[1]))


def test_restarted_publisher_keeps_the_run_identity(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    t = publish_run(dirs["src"], a, rng, 1)
    pull(dirs["local"], dirs["model_a"], dirs["src"], 1)
    pub = Publisher(dirs["src"], encoding="xor", workers=1)  # the trainer relaunched into the same run
    pub.seed_snapshot(t[1], version=1)
    t.append(mutate(t[1], rng, 0.05))
    pub.publish(2, t[2])
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    assert result.action == "chain"  # the same run: the local state is extended
    assert_checkpoint_is(dirs["local"], tensor_bytes(t[2]))


def test_upstream_source_without_a_run_file_is_known_by_its_path(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    t = publish_run(dirs["src"], a, rng, 2)
    os.unlink(os.path.join(dirs["src"], "weightsync-run.json"))  # as an upstream writer leaves it
    pull(dirs["local"], dirs["model_a"], dirs["src"], 1)
    assert "run" not in read_marker(dirs["local"])
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    assert result.action == "chain"
    assert_checkpoint_is(dirs["local"], tensor_bytes(t[2]))
    assert pull(dirs["local"], dirs["model_a"], dirs["src"], 2).action == "noop"


def test_run_file_appearing_under_a_known_path_means_a_new_run(dirs, rng):
    a = random_tensors(rng, SIZES)
    write_hf_checkpoint(dirs["model_a"], a)
    publish_run(dirs["src"], a, rng, 2)
    os.unlink(os.path.join(dirs["src"], "weightsync-run.json"))
    pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    shutil.rmtree(dirs["src"])
    new = publish_run(dirs["src"], a, rng, 2)  # our publisher, a new run, same path
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 2)
    assert result.action != "noop" and "the source dir now belongs to run" in result.reason
    assert_checkpoint_is(dirs["local"], tensor_bytes(new[2]))
