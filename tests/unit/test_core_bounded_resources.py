"""Descriptors and decompressors do not grow with the chain, and running out of an OS resource
is a typed error that leaves the marker honest.

A chain of 300+ deltas (xor, sparse-v1 and overwrite runs, two seed shards) is pulled by child
processes under a descriptor limit of 256: a fresh catch-up, and a reseed replay after a
flipped local byte. A real EMFILE (the child exhausts its own limit mid-apply) surfaces as
``HostResourceError`` with no marker, and the next pull recovers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from weightsync import Publisher, errors

from core_support import assert_checkpoint_is, flip_local_byte, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

# An upstream-style chain: no side anchors, nothing pruned, so a pull replays every delta.
NO_ANCHORS = dict(anchor_fraction=0, anchor_max_deltas=0, prune=False)

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "core_rlimit_child.py")
SIZES = {f"layers.{i}.weight": ("float32", (32, 32)) for i in range(6)} | {"norm": ("float32", (32,))}
# (encoding, versions): long runs of each, so the xor fold and the sparse chain see 100+ payloads
RUNS = [("xor", 150), ("sparse-v1", 150), ("overwrite", 4), ("xor", 1)]
LIMIT = 256


@pytest.fixture(scope="module")
def chain(fast_module_tmp):
    root = str(fast_module_tmp)
    rng = np.random.default_rng(4)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    tensors = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, tensors, shards=2)
    expected = {0: tensor_bytes(tensors)}
    version = 0
    for encoding, count in RUNS:
        pub = Publisher(source, encoding=encoding, workers=1, **NO_ANCHORS)
        pub.seed_snapshot(tensors, version=version)
        for _ in range(count):
            version += 1
            tensors = mutate(tensors, rng, 0.02, names=[n for n in tensors if rng.random() < 0.8] or ["norm"])
            assert pub.publish(version, tensors, full=False).kind == "delta"
            expected[version] = tensor_bytes(tensors)
        pub.close()
    return {"root": root, "seed": seed, "source": source, "expected": expected, "latest": version}


def run_child(mode: str, local: str, chain, target: int, *, nofile: int = LIMIT, workers: int = 4) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.getcwd(), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, CHILD, mode, str(nofile), local, chain["seed"], chain["source"], str(target), str(workers)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["nofile"] == nofile
    return out


def test_catch_up_of_300_versions_needs_no_more_descriptors_than_a_short_one(chain):
    local = os.path.join(chain["root"], "fresh")
    target = chain["latest"] - 1
    assert target >= 300
    out = run_child("pull", local, chain, target)
    assert out["action"] == "seed+chain" and out["deltas"] == target and out["marker"] == target
    assert_checkpoint_is(local, chain["expected"][target])


def test_reseed_replay_after_a_flipped_byte_recovers_under_the_same_limit(chain):
    local = os.path.join(chain["root"], "flipped")
    target = chain["latest"] - 1
    run_child("pull", local, chain, target)
    flip_local_byte(local, "norm", 5)  # the last delta changes "norm": the pull verifies it
    out = run_child("pull", local, chain, chain["latest"])
    assert out["reseeded"] and out["deltas"] == chain["latest"] and out["marker"] == chain["latest"]
    assert_checkpoint_is(local, chain["expected"][chain["latest"]])


def test_descriptor_exhaustion_mid_apply_is_a_typed_error_and_the_next_pull_recovers(chain):
    local = os.path.join(chain["root"], "exhausted")
    run_child("pull", local, chain, 20)
    target = chain["latest"] - 1  # a chain longer than the shard maps kept open: later tensors open more
    out = run_child("exhaust", local, chain, target, nofile=128, workers=2)
    assert out["hoarded"] > 0
    assert out["first"] == "HostResourceError", out
    assert out["error_type"] == "host_resource_exhausted" and out["errno_name"] == "EMFILE"
    assert "ran out of file descriptors" in out["message"] and "ulimit -n" in out["message"]
    assert out["marker_after_failure"] is None  # cleared before the first write; never names unverified bytes
    assert out["action"] == "seed+chain" and out["marker"] == target
    assert_checkpoint_is(local, chain["expected"][target])


def test_live_decompressors_per_worker_do_not_grow_with_an_xor_chain(chain, fast_tmp_path, monkeypatch):
    from weightsync import knobs, pull
    from weightsync.codecs import zstd_frames

    slots: list[int] = []
    decompressor = zstd_frames.ThreadCodecs.decompressor

    def counting(self, slot):
        slots.append(slot)
        return decompressor(self, slot)

    monkeypatch.setattr(zstd_frames.ThreadCodecs, "decompressor", counting)
    local = str(fast_tmp_path / "local")
    pull(local, chain["seed"], chain["source"], 150, workers=2)  # 150 xor deltas folded per tensor
    assert_checkpoint_is(local, chain["expected"][150])
    assert slots and max(slots) < knobs.PAYLOADS_PER_PASS.get()  # one live stream per payload of a pass


@pytest.mark.parametrize("errno_name, resource", [("EMFILE", "file descriptors"), ("ENFILE", "file descriptors"),
                                                   ("ENOMEM", "memory"), ("ENOSPC", "disk space")])
def test_every_os_resource_failure_maps_to_one_typed_error(errno_name, resource):
    import errno

    code = getattr(errno, errno_name)
    typed = errors.host_resource_error(OSError(code, os.strerror(code), "/local/x"))
    assert isinstance(typed, errors.HostResourceError) and isinstance(typed, OSError)
    assert typed.errno_name == errno_name and typed.resource == resource and "/local/x" in str(typed)
    assert typed.http_status == 503 and typed.retryable
    assert errors.host_resource_error(OSError(errno.EACCES, "denied")) is None
    assert isinstance(errors.host_resource_error(MemoryError()), errors.HostResourceError)
