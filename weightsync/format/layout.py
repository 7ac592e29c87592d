"""The one module that spells paths: version dirs, index and shard names, the local sync dir.

Nobody else formats ``weight_v{N:06d}``. Layout of a source dir and a local checkpoint dir::

    source_dir/
    ├── weightsync-run.json                the run's identity, written once by our publisher
    ├── weight_v000001/                    a delta version
    │   ├── model.safetensors.index.json   written last: the commit point
    │   └── delta-r00000-00001.safetensors
    ├── weight_v000002/                    a full version (an ordinary HF checkpoint)
    │   ├── config.json
    │   ├── model.safetensors.index.json
    │   └── model-r00000-00001.safetensors
    └── anchor_v000009/                    a side anchor: v9's full bytes beside its delta
        ├── model.safetensors.index.json   (upstream readers look only at weight_v*)
        └── model-r00000-00001.safetensors

    local_checkpoint_dir/                  a complete HF checkpoint
    ├── config.json, *.safetensors, ...
    └── .weight_sync/
        ├── lock                           per-host flock
        ├── state.json                     {"version": "000002", ...}: the applied-version marker
        └── verified.json                  only while a deferred flush runs (advisory)
"""

from __future__ import annotations

import os
import re

from ..errors import UnsafeNameError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
SYNC_DIR = ".weight_sync"
LOCK_NAME = "lock"
STATE_NAME = "state.json"
VERIFIED_NAME = "verified.json"
RUN_NAME = "weightsync-run.json"
VERSION_DIR_RE = re.compile(r"^weight_v(\d{6,})$")
ANCHOR_DIR_RE = re.compile(r"^anchor_v(\d{6,})$")


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def version_dir(source_dir: str, version: int) -> str:
    return os.path.join(source_dir, version_dir_name(version))


def anchor_dir_name(version: int) -> str:
    return f"anchor_v{version:06d}"


def anchor_dir(source_dir: str, version: int) -> str:
    """A side anchor: the full bytes of version ``version``, which stays a delta in the chain."""
    return os.path.join(source_dir, anchor_dir_name(version))


def run_path(source_dir: str) -> str:
    """The run identity file our publisher writes once into a source dir."""
    return os.path.join(source_dir, RUN_NAME)


def index_path(directory: str) -> str:
    return os.path.join(directory, INDEX_NAME)


def format_version(version: int) -> str:
    """Index and marker spelling: zero-padded to 6 digits."""
    return f"{version:06d}"


def parse_version_dir_name(name: str) -> int | None:
    m = VERSION_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def _list_numbered(source_dir: str, pattern: "re.Pattern[str]") -> list[int]:
    try:
        names = os.listdir(source_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


def list_versions(source_dir: str) -> list[int]:
    """Version numbers present as directories (for inspect/prune, never for pulling)."""
    return _list_numbered(source_dir, VERSION_DIR_RE)


def list_anchors(source_dir: str) -> list[int]:
    """Versions that have a side anchor directory (complete or not: the caller reads its index)."""
    return _list_numbered(source_dir, ANCHOR_DIR_RE)


def delta_shard_name(rank: int, part: int, content: str = "") -> str:
    """Deterministic per rank, so several ranks never race on a listing to number shards.
    ``content`` (ours: a hash of what the shard holds) makes the name one that a writer of
    other bytes cannot produce, so no writer's shard ever replaces another's."""
    return f"delta-r{rank:05d}-{part:05d}{'-' + content if content else ''}.safetensors"


def full_shard_name(rank: int, part: int, content: str = "") -> str:
    return f"model-r{rank:05d}-{part:05d}{'-' + content if content else ''}.safetensors"


def sync_dir(local_checkpoint_dir: str) -> str:
    return os.path.join(local_checkpoint_dir, SYNC_DIR)


def lock_path(local_checkpoint_dir: str) -> str:
    return os.path.join(local_checkpoint_dir, SYNC_DIR, LOCK_NAME)


def state_path(local_checkpoint_dir: str) -> str:
    return os.path.join(local_checkpoint_dir, SYNC_DIR, STATE_NAME)


def verified_path(local_checkpoint_dir: str) -> str:
    """Advisory note of a deferred pull: verified in the page cache, flush still running."""
    return os.path.join(local_checkpoint_dir, SYNC_DIR, VERIFIED_NAME)


def tmp_name(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name == INDEX_NAME


# The small files an engine loads beside the weights: config and generation config, tokenizer
# (json, sentencepiece ``.model``, tiktoken, vocab and merges ``.txt``), chat templates
# (``.jinja``), remote code (``.py``). Everything else in a model dir is left behind: weights
# in other formats, other index files, a killed writer's temporary files.
MODEL_SIDE_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt", ".py")
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz", ".pkl")
_TMP_RE = re.compile(r"\.tmp\.\d+$")


def is_temporary_file(name: str) -> bool:
    """A file under ``tmp_name``'s spelling: a writer's, never part of a checkpoint."""
    return _TMP_RE.search(name) is not None


def is_model_side_file(name: str) -> bool:
    """A non-weight file a seed copies (config, tokenizer, generation config, chat template)."""
    return (
        not name.startswith(".")
        and not is_temporary_file(name)
        and name.endswith(MODEL_SIDE_SUFFIXES)
        and not name.endswith(".index.json")  # another format's weight index (pytorch_model.bin.index.json)
    )


def is_stale_local_file(name: str) -> bool:
    """A local file no seed would copy that an engine could mistake for weights, or a leftover."""
    return (
        is_weight_file(name) or name.endswith(OTHER_WEIGHT_SUFFIXES) or name.endswith(".index.json")
        or is_temporary_file(name)
    )


def checked_file_name(name: object, where: str) -> str:
    """A plain file name that stays inside its directory, or UnsafeNameError."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or os.sep in name
        or any(ord(c) < 32 for c in name)
    ):
        raise UnsafeNameError(str(name), where)
    return name


def checked_join(directory: str, name: object, where: str) -> str:
    return os.path.join(directory, checked_file_name(name, where))


def checked_inside(directory: str, path: str, where: str) -> str:
    """``path`` itself, if it resolves (symlinks included) to a place inside ``directory``."""
    root = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise UnsafeNameError(os.path.relpath(path, directory), f"{where} (resolves to {real}, outside {root})")
    return path
