"""A shard cut short while a pull, the CLI or a positions read uses it is a typed error, never a
SIGBUS (issue 18, point 7). The source dir's shards are read with pread, never mapped: a map
of a file truncated under it kills the process at the first access past the new end, where
no Python handler can resume. Each case runs in a child process (``core_truncate_child.py``)
that really truncates every delta shard of the chain (to its header) just before the first payload
is used, after the pull checked and opened them; a retry once the shards are whole again
pulls the exact bytes."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest

from weightsync import Publisher, pull

from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
# Four tensors so a pull still has payloads to read after the cut (workers=1: one at a time).
SIZES = {f"w{i}": ("float32", (256, 256)) for i in range(4)}


@pytest.fixture
def world(fast_tmp_path, rng, request):
    encoding = request.param
    root = str(fast_tmp_path)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t = [random_tensors(rng, SIZES)]
    write_hf_checkpoint(seed, t[0])
    # No side anchor (a dense delta would get one, and the pull would seed from it instead)
    # and no fallback to full: the chain of deltas is what is read.
    pub = Publisher(source, encoding=encoding, workers=1, anchor_fraction=0, anchor_max_deltas=0, fallback_fraction=100.0,
                    full_above_changed_fraction=1.0)
    pub.seed_snapshot(t[0])
    for v in (1, 2):
        t.append(mutate(t[-1], rng, 0.3))
        pub.publish(v, t[v], full=False)
    pub.close()
    pull(local, seed, source, 0)
    shards = {p: open(p, "rb").read() for p in glob.glob(os.path.join(source, "weight_v*", "*.safetensors"))}
    return seed, source, local, t, shards


def run_child(mode: str, seed: str, source: str, local: str, target: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(os.path.dirname(HERE))]))
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "core_truncate_child.py"), mode, local, seed, source, str(target)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def restore(shards: dict[str, bytes]) -> None:
    for path, data in shards.items():
        with open(path, "r+b") as f:
            f.write(data)


def assert_typed_not_a_signal(out: subprocess.CompletedProcess, expected_rc: int) -> None:
    assert out.returncode != -signal.SIGBUS, "the child died of SIGBUS"
    assert out.returncode >= 0, f"the child died of signal {-out.returncode}: {out.stderr[-2000:]}"
    assert out.returncode == expected_rc, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])


ENCODINGS = ["xor", "overwrite", "sparse-v1", "sparse-v2"]


@pytest.mark.parametrize("world", ENCODINGS, indirect=True)
def test_a_shard_truncated_during_a_library_pull_is_a_typed_error_and_a_retry_pulls_exactly(world):
    seed, source, local, t, shards = world
    out = run_child("library", seed, source, local, 2)
    assert_typed_not_a_signal(out, 3)
    assert out.stdout.startswith(("typed ShardShrunkError", "typed SourceNotReadyError")), out.stdout
    assert marker_version(local) in (None, 0)  # the marker never names bytes it did not verify
    restore(shards)
    pull(local, seed, source, 2)
    assert_checkpoint_is(local, tensor_bytes(t[2]))


@pytest.mark.parametrize("world", ["xor", "sparse-v2"], indirect=True)
def test_a_shard_truncated_during_a_cli_pull_exits_with_the_not_ready_code(world):
    seed, source, local, t, shards = world
    out = run_child("cli", seed, source, local, 2)
    assert_typed_not_a_signal(out, 3)  # the CLI's code for SourceNotReadyError: retry
    assert '"error_type": "source_not_ready"' in out.stdout, out.stdout
    restore(shards)
    pull(local, seed, source, 2)
    assert_checkpoint_is(local, tensor_bytes(t[2]))


@pytest.mark.parametrize("world", ["xor", "overwrite", "sparse-v1"], indirect=True)
def test_a_shard_truncated_while_its_positions_are_read_is_a_typed_error(world):
    seed, source, local, _, _ = world
    out = run_child("positions", seed, source, local, 2)
    assert_typed_not_a_signal(out, 3)
    assert out.stdout.startswith(("typed ShardShrunkError", "typed SourceNotReadyError")), out.stdout


@pytest.mark.parametrize("world", ["xor", "overwrite"], indirect=True)
def test_loading_a_frame_only_delta_reads_its_frames_without_copying_a_payload(world, monkeypatch):
    """xor and overwrite payloads can be as large as their tensors: the load walks each frame
    with small preads (3 bytes a block) instead of copying the payload into memory."""
    import weightsync.puller.apply as apply_mod
    from weightsync.format.manifest import read_version_index

    _, source, _, _, _ = world
    copies: list[int] = []
    real = apply_mod.read_range
    monkeypatch.setattr(apply_mod, "read_range", lambda fd, at, n, path: copies.append(n) or real(fd, at, n, path))
    loaded = apply_mod.load_delta(read_version_index(source, 1))
    assert loaded.tensors and copies == []
