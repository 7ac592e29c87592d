"""Seed the local checkpoint: make it an exact copy of a full checkpoint (the seed dir for
version 0, or a published full version), then write the applied-version marker.

The marker is cleared before the first byte is copied and written only after every file is
copied, size-checked, header-checked and fsynced.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar
from typing import Callable

from .. import progress
from ..errors import InvalidRequestError, LocalStateError, SourceNotReadyError
from ..format.layout import INDEX_NAME, checked_inside, is_model_side_file, is_stale_local_file, state_path, sync_dir
from ..format.manifest import checkpoint_weight_files, encode_applied_state
from ..format.safetensors_io import read_header
from ..fsio import copy_file, drop_page_cache, fsync_dir, write_bytes
from .identity import Origin
from .plan import SeedSource

log = logging.getLogger(__name__)

# A source that fetched a seed's file into a host-local copy of its own (a bucket's mirror,
# ``storage.mirror``) may hand that copy over instead of it being copied a second time:
# ``fn(src, dst)`` moves ``src`` to ``dst`` (a new inode, fsynced) and returns its size, or
# returns None when ``src`` is not one it can give up. Set around a pull by the bucket's driver.
HAND_OVER: "ContextVar[Callable[[str, str], int | None] | None]" = ContextVar("weightsync_seed_hand_over", default=None)


def invalidate_marker(local_checkpoint_dir: str) -> None:
    """Clear the applied-version marker before the first in-place write."""
    try:
        os.unlink(state_path(local_checkpoint_dir))
    except FileNotFoundError:
        return
    fsync_dir(sync_dir(local_checkpoint_dir))


def write_marker(local_checkpoint_dir: str, version: int, origin: Origin) -> None:
    """The applied-version marker, bound to the origin (source dir, run, seed) of the bytes."""
    os.makedirs(sync_dir(local_checkpoint_dir), exist_ok=True)
    files = {n: os.path.getsize(os.path.join(local_checkpoint_dir, n)) for n in checkpoint_weight_files(local_checkpoint_dir)}
    state = encode_applied_state(version, origin.source_dir, origin.run, origin.seed, files)
    write_bytes(state_path(local_checkpoint_dir), state)
    fsync_dir(sync_dir(local_checkpoint_dir))


def _top_level_files(directory: str) -> dict[str, str]:
    return {
        e.name: e.path
        for e in os.scandir(directory)
        if e.is_file(follow_symlinks=True) and not e.name.startswith(".")
    }


def _model_side_files(directory: str) -> dict[str, str]:
    return {n: p for n, p in _top_level_files(directory).items() if is_model_side_file(n)}


def _label(source: SeedSource) -> str:
    return "side anchor" if source.kind == "anchor" else "full version"


def files_to_seed(source: SeedSource, seed_dir: str, weight_map_files: "list[str] | tuple[str, ...] | None") -> dict[str, str]:
    """name -> source path: exactly the weight files the seed's index names, its index, and the
    small non-weight files an engine needs (``layout.is_model_side_file``). The seed dir fills
    in the ones a full version (or a side anchor) lacks. Weights in other formats, other index
    files and a killed writer's temporary files are never copied."""
    if not os.path.isdir(seed_dir) and source.kind == "seed_dir":
        raise InvalidRequestError(f"seed dir {seed_dir} (the engine's own model) is not a directory")
    files: dict[str, str] = _model_side_files(seed_dir) if os.path.isdir(seed_dir) else {}
    if source.kind == "seed_dir":
        try:
            weight_files = checkpoint_weight_files(seed_dir)
        except FileNotFoundError as e:
            raise InvalidRequestError(f"the seed dir cannot be seeded from: {e}") from None
        for n in weight_files + ([INDEX_NAME] if os.path.exists(os.path.join(seed_dir, INDEX_NAME)) else []):
            files[n] = os.path.join(seed_dir, n)
        return files
    version_files = _top_level_files(source.path)
    files.update({n: p for n, p in version_files.items() if is_model_side_file(n)})
    for n in weight_map_files or []:
        if n not in version_files:
            raise SourceNotReadyError(f"{_label(source)} v{source.version} names shard {n}, which is not in {source.path} yet")
        files[n] = version_files[n]
    if INDEX_NAME in version_files:
        files[INDEX_NAME] = version_files[INDEX_NAME]
    for n, p in files.items():
        if p.startswith(source.path):
            checked_inside(source.path, p, f"{_label(source)} v{source.version}")
    return files


def seed_local_checkpoint(
    local_checkpoint_dir: str, source: SeedSource, seed_dir: str, origin: Origin,
    verify: "Callable[[str], None] | None" = None,
) -> tuple[int, int]:
    """Copy the seed into the local dir; returns (bytes copied, of which from the source dir).
    ``verify(local_checkpoint_dir)`` runs on the copy before the marker is written (a side
    anchor's digests): whatever it raises leaves no marker."""
    files = files_to_seed(source, seed_dir, source.shard_files)
    log.info("seeding %s from %s (v%d, %d files)", local_checkpoint_dir, source.path, source.version, len(files))
    os.makedirs(local_checkpoint_dir, exist_ok=True)
    invalidate_marker(local_checkpoint_dir)
    copied = from_source = 0
    bar = progress.stage(f"seed copy (v{source.version})", sum(os.path.getsize(p) for p in files.values()))
    hand_over = HAND_OVER.get()
    for name, src in sorted(files.items()):
        dst = os.path.join(local_checkpoint_dir, name)
        want = os.path.getsize(src)
        got = hand_over(src, dst) if hand_over is not None and source.kind != "seed_dir" else None
        if got is None:
            got = copy_file(src, dst, bar.advance if bar is not progress.SILENT else None)
            drop_page_cache(src)
        elif bar is not progress.SILENT:
            bar.advance(got)
        if got != want:
            raise LocalStateError(f"copying {src} -> {dst} gave {got} bytes, expected {want} (disk full?)")
        copied += got
        if source.kind != "seed_dir" and src.startswith(source.path):
            from_source += got
    for entry in os.scandir(local_checkpoint_dir):
        if entry.is_file() and is_stale_local_file(entry.name) and entry.name not in files:
            os.unlink(entry.path)
    # A truncated copy (a mount that shows metadata before bytes) must fail here, not serve.
    for fname in checkpoint_weight_files(local_checkpoint_dir):
        read_header(os.path.join(local_checkpoint_dir, fname))
    if verify is not None:
        verify(local_checkpoint_dir)
    fsync_dir(local_checkpoint_dir)
    write_marker(local_checkpoint_dir, source.version, origin)
    return copied, from_source
