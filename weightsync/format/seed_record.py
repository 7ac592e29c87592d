"""The run's seed record: per-tensor digests (and layout) of version 0, in ``weightsync-run.json``.

Our publisher adds it once, when it commits v1 as a delta (FORMAT.md, "The run identity"). The
publisher checks a delta's base against it for tensors unchanged since v0; a pull whose replay
still fails after a fresh seed asks it whether the seed dir is the run's seed at all, so a wrong
``--seed-dir`` is told as such instead of "the published delta is corrupt".
"""

from __future__ import annotations

import json
import os

import msgspec

from .checksum import new_hasher
from .layout import run_path


class SeedRecord(msgspec.Struct, frozen=True):
    """The seed's per-tensor digests and layout (``weightsync-run.json`` key ``seed``)."""

    checksum_format: str
    digests: dict[str, str]
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (safetensors dtype, shape)


class _RunFile(msgspec.Struct):
    run_id: str
    created_unix_s: float = 0.0
    seed: SeedRecord | None = None


def read_seed_record(source_dir: str) -> SeedRecord | None:
    """The run's seed record, or None (no run file, an older one without it, unreadable)."""
    try:
        with open(run_path(source_dir), "rb") as f:
            raw = f.read(1 << 26)
        return msgspec.json.decode(raw, type=_RunFile).seed
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def encode_run_file_with_seed(source_dir: str, seed: SeedRecord) -> bytes | None:
    """The run file's bytes with ``seed`` added (every other key kept), or None when the run
    file is absent, unreadable or already records a seed (it is recorded once)."""
    try:
        with open(run_path(source_dir), "rb") as f:
            obj = json.loads(f.read(1 << 26))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("run_id"), str) or "seed" in obj:
        return None
    obj["seed"] = msgspec.to_builtins(seed)
    return json.dumps(obj, separators=(",", ":")).encode()


def seed_dir_differences(source_dir: str, seed_dir: str, names: "list[str] | None" = None) -> list[tuple[str, str, str]]:
    """(tensor, recorded digest, seed dir's digest) of each tensor (of ``names``, default all)
    whose bytes in ``seed_dir`` differ from the run's seed record; a tensor the seed dir lacks
    has digest "missing". Empty when the run records no seed or the seed dir cannot be read."""
    from .manifest import checkpoint_weight_files
    from .safetensors_io import local_tensor_table

    record = read_seed_record(source_dir)
    if record is None:
        return []
    try:
        table = local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir))
    except Exception:  # noqa: BLE001 - an unreadable seed dir is reported by the pull itself
        return []
    out = []
    for name in sorted(names if names is not None else record.digests):
        recorded = record.digests.get(name)
        if recorded is None:
            continue
        if name not in table:
            out.append((name, recorded, "missing"))
            continue
        path, entry = table[name]
        h = new_hasher(record.checksum_format)
        with open(path, "rb") as f:
            f.seek(entry.offset)
            left = entry.nbytes
            while left > 0:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
        actual = h.hexdigest()
        if actual != recorded:
            out.append((name, recorded, actual))
    return out


def seed_dir_sample_differences(source_dir: str, seed_dir: str, k: int = 4) -> list[tuple[str, str, str]]:
    """``seed_dir_differences`` of the ``k`` smallest tensors the run recorded: cheap enough to run
    before every pull writes anything (a few norm vectors), and another model (or another seed of
    the same architecture) differs in them. A seed dir that passes is still verified in full by
    the pull; this only refuses the common mistake before the local checkpoint is touched."""
    from .manifest import checkpoint_weight_files
    from .safetensors_io import local_tensor_table

    record = read_seed_record(source_dir)
    if record is None or not record.digests:
        return []
    try:
        table = local_tensor_table(seed_dir, checkpoint_weight_files(seed_dir))
    except Exception:  # noqa: BLE001 - an unreadable seed dir is reported by the pull itself
        return []
    missing = [(n, record.digests[n], "missing") for n in sorted(record.digests) if n not in table]
    if missing:
        return missing
    smallest = sorted(record.digests, key=lambda n: (table[n][1].nbytes, n))[:k]
    return seed_dir_differences(source_dir, seed_dir, smallest)


__all__ = ["SeedRecord", "read_seed_record", "encode_run_file_with_seed", "seed_dir_differences",
           "seed_dir_sample_differences"]
