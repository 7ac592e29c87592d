"""Publish a chain of weight versions of a tiny checkpoint, and check what a pull left behind.

Role: engine-side and trainer-side tests need a real source dir written by the core's
``Publisher`` and the exact tensors each version must hold. ``VersionFeed`` perturbs the previous
version's tensors deterministically, publishes with any encoding per version (a fresh
``Publisher`` seeded with the previous version each time, so encodings can alternate and a
version can be republished), and remembers the expected tensors of every version.

Helpers: ``assert_checkpoint_equals`` (bit-exact), ``dir_fingerprint`` (what "nothing touched"
means: every file's size and hash, the host lock file excluded), ``corrupt_delta`` (flip one
payload byte of a published delta shard), ``shard_nbytes`` (a version's shard files),
``corrupt_local_tensor`` (flip one byte of a tensor in a local checkpoint, as a bad disk would).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .tiny_qwen3 import perturb_state_dict, read_state_dict, to_raw_tensors


class VersionFeed:
    """A source dir fed with versions 1, 2, ... of the checkpoint in ``model_dir`` (version 0)."""

    def __init__(self, model_dir: str | os.PathLike, source_dir: str | os.PathLike, *, seed: int = 0) -> None:
        self.model_dir = str(model_dir)
        self.source_dir = str(source_dir)
        self.seed = seed
        self.expected: dict[int, dict] = {0: read_state_dict(self.model_dir)}
        os.makedirs(self.source_dir, exist_ok=True)

    def publish(
        self, version: int, *, encoding: str = "xor", full: bool | None = None, fraction: float = 0.05, names=None
    ):
        """Publish ``version`` (a perturbation of ``version - 1``, of ``names`` only when given);
        returns the core's PublishResult."""
        from weightsync import Publisher

        previous = self.expected[version - 1]
        tensors = perturb_state_dict(previous, version, fraction=fraction, seed=self.seed, names=names)
        publisher = Publisher(self.source_dir, encoding=encoding, template_dir=self.model_dir)
        try:
            publisher.seed_snapshot(to_raw_tensors(previous), version=version - 1)
            result = publisher.publish(version, to_raw_tensors(tensors), full=full)
        finally:
            publisher.close()
        self.expected[version] = tensors
        return result

    def version_dir(self, version: int) -> str:
        from weightsync.format.layout import version_dir

        return version_dir(self.source_dir, version)

    def unpublish(self, version: int) -> None:
        shutil.rmtree(self.version_dir(version))
        self.expected.pop(version, None)


def corrupt_delta(version_dir: str | os.PathLike, *, offset_from_end: int = 16) -> str:
    """Flip one byte near the end of the first delta shard's data area; returns the file."""
    shards = sorted(p for p in Path(version_dir).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no .safetensors shard in {version_dir}")
    path = shards[0]
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - offset_from_end)
        byte = f.read(1)
        f.seek(size - offset_from_end)
        f.write(bytes([byte[0] ^ 0xFF]))
    return str(path)


def shard_nbytes(version_dir: str | os.PathLike) -> int:
    """Bytes of a version's shard files (what a pull reads of it from the source dir)."""
    return sum(os.path.getsize(path) for path in Path(version_dir).glob("*.safetensors"))


def corrupt_local_tensor(checkpoint_dir: str | os.PathLike, name: str) -> str:
    """Flip the first byte of tensor ``name`` in the checkpoint's shard that holds it; returns the file."""
    import json
    import struct

    root = Path(checkpoint_dir)
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "r+b") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            entry = json.loads(f.read(header_len)).get(name)
            if entry is None:
                continue
            offset = 8 + header_len + entry["data_offsets"][0]
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        return str(path)
    raise KeyError(f"tensor {name!r} is in no shard of {checkpoint_dir}")


def changed_tensor_names(before: dict, after: dict) -> list[str]:
    """Names of the tensors whose bytes differ between two state dicts (sorted)."""
    import torch

    return sorted(name for name in after if not torch.equal(before[name], after[name]))


def assert_checkpoint_equals(checkpoint_dir: str | os.PathLike, expected: dict) -> None:
    """Every tensor in ``checkpoint_dir`` equals ``expected`` bit for bit (and no tensor is missing)."""
    import torch

    actual = read_state_dict(checkpoint_dir)
    assert sorted(actual) == sorted(expected), f"tensor names differ: {sorted(set(actual) ^ set(expected))[:5]}"
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
        got_bytes = got.contiguous().reshape(-1).view(torch.uint8)
        want_bytes = want.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got_bytes, want_bytes), f"{checkpoint_dir}: tensor {name} differs from the expected bytes"


def dir_fingerprint(directory: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """relative path -> (size, sha256) of every file under ``directory`` (the pull lock excluded)."""
    out: dict[str, tuple[int, str]] = {}
    root = Path(directory)
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != "lock":
            data = path.read_bytes()
            out[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return out
