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
from weightsync.puller import identity

from core_support import (
    assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, tensor_location, write_hf_checkpoint,
)

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
    # The run records its seed's digests: the pull says the seed dir is another model (issue 25.3).
    with pytest.raises(errors.SeedDirMismatchError, match=r"w1: run records"):
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


BIG = {"w1": ("float32", (256, 512)), "w2": ("float32", (256, 512)), "b": ("int16", (7,))}


def edit_unsampled_bytes_in_place(model_dir: str, name: str) -> None:
    """Rewrite 16 bytes of tensor ``name`` in place, size and mtime kept (``os.utime`` back, as
    rsync -t would), at a quarter of the tensor: away from the four 4 KiB ranges the old
    fingerprint sampled and from the tensor's own start, middle and end samples."""
    path, off, nbytes = tensor_location(model_dir, name)
    st = os.stat(path)
    at = off + nbytes // 4
    old_ranges = [(x, x + identity.SAMPLE_NBYTES) for x in identity._sample_offsets(st.st_size)]
    new_ranges = [(x, x + identity.TENSOR_SAMPLE_NBYTES) for x in identity._tensor_sample_offsets(off, nbytes)]
    assert all(at + 16 <= a or at >= b for a, b in old_ranges + new_ranges), "the edit must miss every sample"
    with open(path, "r+b") as f:
        f.seek(at)
        before = f.read(16)
        f.seek(at)
        f.write(bytes(x ^ 0xA5 for x in before))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def read_tensors(model_dir: str) -> dict[str, bytes]:
    from safetensors.numpy import load_file

    return tensor_bytes(load_file(os.path.join(model_dir, "model.safetensors")))


def test_a_tensor_edited_in_place_with_size_and_mtime_kept_reseeds_at_v0(dirs, rng):
    write_hf_checkpoint(dirs["model_a"], random_tensors(rng, BIG))
    assert pull(dirs["local"], dirs["model_a"], dirs["src"], 0).action == "seed"
    edit_unsampled_bytes_in_place(dirs["model_a"], "w2")
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 0)
    assert result.action == "seed" and "the seed dir changed" in result.reason
    assert_checkpoint_is(dirs["local"], read_tensors(dirs["model_a"]))
    assert pull(dirs["local"], dirs["model_a"], dirs["src"], 0).action == "noop"  # and it stays put


def test_a_new_runs_v1_that_skips_an_edited_seed_tensor_does_not_chain_onto_the_old_bytes(dirs, rng):
    """The host seeded the old model; the model dir is edited in place (w2); a new run built on
    the edited model publishes v1 changing w1 only. The delta verifies only w1, so a host that
    kept its old w2 would report v1 with bytes that were never published."""
    write_hf_checkpoint(dirs["model_a"], random_tensors(rng, BIG))
    pull(dirs["local"], dirs["model_a"], dirs["src"], 0)
    edit_unsampled_bytes_in_place(dirs["model_a"], "w2")
    from safetensors.numpy import load_file

    t0 = load_file(os.path.join(dirs["model_a"], "model.safetensors"))
    pub = Publisher(dirs["src"], encoding="xor", workers=1)
    pub.seed_snapshot(t0)
    t1 = mutate(t0, rng, 0.01, names=["w1"])
    pub.publish(1, t1)
    pub.close()
    result = pull(dirs["local"], dirs["model_a"], dirs["src"], 1)
    assert result.action.startswith("seed")
    assert_checkpoint_is(dirs["local"], tensor_bytes(t1))


def test_the_seed_fingerprint_samples_every_tensor_of_every_shard(fast_tmp_path, rng, monkeypatch):
    """With the file's stat fields held equal (a file system that keeps them, or root), the
    fingerprint still sees a change at the start, middle or end of any tensor, in any shard."""
    model = str(fast_tmp_path / "m")
    write_hf_checkpoint(model, random_tensors(rng, BIG), shards=2)
    monkeypatch.setattr(identity, "_stat_line", lambda name, st: name.encode())
    base = identity.seed_fingerprint(model)
    for name in BIG:
        path, off, nbytes = tensor_location(model, name)
        for at in sorted(identity._tensor_sample_offsets(off, nbytes)):
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 1]))
            assert identity.seed_fingerprint(model) != base, (name, at)
            with open(path, "r+b") as f:
                f.seek(at)
                f.write(b)
            assert identity.seed_fingerprint(model) == base


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
