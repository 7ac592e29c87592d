"""Shared helpers of the core's unit tests: real checkpoints on disk, read back independently.

Role: build tiny HF safetensors checkpoints with the ``safetensors`` package (not our writer),
read any local checkpoint back through ``safetensors`` and ``json`` (not our reader), flip
bytes in place, and publish version chains whose exact bytes the test keeps. Everything the
tests compare against comes from these independent readers, so a bug in our own safetensors
code cannot hide itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Iterable, Iterator, Mapping

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
# The hypothesis profile (registered in conftest.py): "thorough" runs longer stateful tests.
THOROUGH = os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE", "fast") == "thorough"
SINGLE = "model.safetensors"
ST_OF_NP = {
    "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
}


def random_tensors(rng: np.random.Generator, sizes: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """name -> array of the given numpy dtype name and shape, random bytes."""
    out = {}
    for name, (dtype, shape) in sizes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out[name] = np.frombuffer(rng.bytes(nbytes), dtype=dtype).reshape(shape).copy()
    return out


def mutate(
    tensors: Mapping[str, np.ndarray], rng: np.random.Generator, density: float, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """A copy with about ``density`` of the bytes of ``names`` (default: all) replaced."""
    out = {k: v.copy() for k, v in tensors.items()}
    for name in names if names is not None else list(out):
        flat = out[name].reshape(-1).view(np.uint8)
        if flat.size == 0 or density <= 0:
            continue
        k = max(1, int(round(density * flat.size)))
        pos = rng.choice(flat.size, size=min(k, flat.size), replace=False)
        flat[pos] ^= rng.integers(1, 256, size=pos.size, dtype=np.uint8)  # never zero: a real change
    return out


def tensor_bytes(tensors: Mapping[str, np.ndarray]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in tensors.items()}


def write_hf_checkpoint(
    directory: str, tensors: Mapping[str, np.ndarray], *, shards: int = 1, extra_files: Mapping[str, str] | None = None
) -> None:
    """An ordinary HF checkpoint written with the safetensors package: config, tokenizer, weights."""
    os.makedirs(directory, exist_ok=True)
    files = {"config.json": json.dumps({"model_type": "toy"}), "tokenizer.json": "{}"}
    files.update(extra_files or {})
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    names = sorted(tensors)
    if shards <= 1:
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, os.path.join(directory, SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f)


def publish_one_sparse2_delta(root: str) -> tuple[str, str, str, str, int]:
    """A seed checkpoint and a source holding v1 (full) and v2 (a sparse-v2 delta, in the
    bitstream the knob names) of one fp32 tensor ``w``, for a test that damages the delta:
    ``(seed, source, local, v2's delta shard, the offset of w's payload in it)``."""
    from weightsync import Publisher
    from weightsync.format.layout import version_dir
    from weightsync.format.safetensors_io import read_header

    rng = np.random.default_rng(7)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t0 = {"w": rng.standard_normal(4096).astype(np.float32)}
    write_hf_checkpoint(seed, t0)
    pub = Publisher(source, encoding="sparse-v2")
    pub.seed_snapshot(t0)
    t1 = {"w": t0["w"] + np.float32(1e-3) * (rng.random(4096) < 0.1)}
    pub.publish(1, t1, full=True)
    pub.publish(2, {"w": t1["w"] + np.float32(1e-3) * (rng.random(4096) < 0.1)}, full=False)
    pub.close()
    shard = shard_path(version_dir(source, 2), "w")
    return seed, source, local, shard, read_header(shard).tensors["w"].offset


def checkpoint_files(directory: str) -> list[str]:
    ipath = os.path.join(directory, INDEX)
    if os.path.exists(ipath):
        with open(ipath) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return [SINGLE]


def shard_path(directory: str, tensor: str | None = None) -> str:
    """The shard the index of a version (or anchor) dir maps ``tensor`` to (default: its first
    shard by name). Our shard names end in a hash of their content, so tests look them up."""
    with open(os.path.join(directory, INDEX)) as f:
        wmap = json.load(f)["weight_map"]
    return os.path.join(directory, wmap[tensor] if tensor is not None else sorted(wmap.values())[0])


def read_checkpoint_bytes(directory: str) -> dict[str, bytes]:
    """name -> raw bytes of every tensor of an HF checkpoint, through the safetensors package."""
    out: dict[str, bytes] = {}
    for fname in checkpoint_files(directory):
        with safe_open(os.path.join(directory, fname), framework="numpy") as f:
            for name in f.keys():
                assert name not in out, f"{name} appears in two files of {directory}"
                out[name] = np.ascontiguousarray(f.get_tensor(name)).tobytes()
    return out


def marker_version(local_dir: str) -> int | None:
    """The applied-version marker as FORMAT.md spells it, or None when absent."""
    path = os.path.join(local_dir, ".weight_sync", "state.json")
    try:
        with open(path) as f:
            return int(json.load(f)["version"])
    except FileNotFoundError:
        return None


def raw_header(path: str) -> tuple[int, dict]:
    """(data area offset, header JSON) of a safetensors file, parsed by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def tensor_location(directory: str, name: str) -> tuple[str, int, int]:
    """(file path, absolute offset, nbytes) of one tensor in a checkpoint."""
    for fname in checkpoint_files(directory):
        path = os.path.join(directory, fname)
        data_off, hdr = raw_header(path)
        if name in hdr:
            b, e = hdr[name]["data_offsets"]
            return path, data_off + b, e - b
    raise KeyError(name)


def flip_local_byte(directory: str, name: str, pos: int, mask: int = 0x5A) -> None:
    """XOR one byte of one tensor in place (a bit flip on the local disk)."""
    path, off, nbytes = tensor_location(directory, name)
    assert 0 <= pos < nbytes
    with open(path, "r+b") as f:
        f.seek(off + pos)
        b = f.read(1)[0]
        f.seek(off + pos)
        f.write(bytes([b ^ mask]))


def diff_names(actual: Mapping[str, bytes], expected: Mapping[str, bytes]) -> list[str]:
    names = set(actual) | set(expected)
    return sorted(n for n in names if actual.get(n) != expected.get(n))


def assert_checkpoint_is(directory: str, expected: Mapping[str, bytes]) -> None:
    actual = read_checkpoint_bytes(directory)
    bad = diff_names(actual, expected)
    assert not bad, f"{directory}: tensors differ from the expected version: {bad[:10]}"


@contextlib.contextmanager
def serving(www: str) -> Iterator:
    """A static HTTP server over ``www`` on a loopback port (``benchmarks.fleet.origin``), stopped on exit."""
    from benchmarks.fleet.origin import OriginServer

    server = OriginServer(www, ("127.0.0.1", 0))
    server.start_in_thread()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
