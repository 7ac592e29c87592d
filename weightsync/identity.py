"""Where a local state came from: the seed dir it grew from and the run that published its chain.

The applied-version marker records both, and a pull trusts a marker only when they still hold:
a local dir seeded from one model must not be taken for another model's version 0, and a chain
from one run must not be extended with (or mistaken for) another run's versions under the same
source dir path.

- The *seed fingerprint* is an xxh3-128 digest over the seed dir's index bytes (or, without an
  index, the names of its weight files) and, for each weight file the checkpoint names, its
  name, size, mtime_ns and four sampled 4 KiB ranges (start, 1/3, 2/3, end). The start range
  holds the safetensors header (every tensor's name, dtype, shape and offsets); the others
  sample the data. Cost: one stat and four small reads per weight file, on every pull.
  A model replaced in place changes its mtime, its sizes or its header; a copy that keeps
  mtimes still differs in the header or the sampled bytes unless it is the same model. A
  touched file only costs one needless reseed (the safe side).
- The *run id* is a random id that our publisher writes once into a fresh source dir
  (``weightsync-run.json``). A source dir without it (an upstream writer's) is known by its
  real path alone.
"""

from __future__ import annotations

import os

import msgspec

from .checksum import new_hasher
from .layout import INDEX_NAME, SINGLE_FILE_NAME, checked_join, index_path, run_path
from .manifest import AppliedState, checkpoint_weight_files, read_run_id

SAMPLE_NBYTES = 4096
NO_SEED = "none"  # the fingerprint of a seed dir that is not a readable checkpoint


class Origin(msgspec.Struct, frozen=True):
    """What a local state must match to be extended: the source (path, run) and the seed."""

    source_dir: str  # real path
    run: str | None
    seed: str


def seed_fingerprint(seed_dir: str) -> str:
    """A cheap digest that changes when the seed dir holds another model (see the module doc)."""
    h = new_hasher("xxh3-128")
    try:
        files = checkpoint_weight_files(seed_dir)
        ipath = index_path(seed_dir)
        if os.path.exists(ipath):
            with open(ipath, "rb") as f:
                h.update(f.read())
        else:
            h.update(SINGLE_FILE_NAME.encode())
        for name in files:
            path = checked_join(seed_dir, name, f"{seed_dir}/{INDEX_NAME}")
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                h.update(f"\0{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
                for at in _sample_offsets(st.st_size):
                    f.seek(at)
                    h.update(f.read(SAMPLE_NBYTES))
    except (OSError, ValueError):
        return NO_SEED
    return h.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    last = max(0, size - SAMPLE_NBYTES)
    return sorted({0, size // 3, 2 * size // 3, last})


def source_origin(source_dir: str, seed_dir: str) -> Origin:
    return Origin(os.path.realpath(source_dir), read_run_id(run_path(source_dir)), seed_fingerprint(seed_dir))


def mismatch(state: AppliedState, applied: int, origin: Origin) -> str | None:
    """Why a marker does not describe a state this pull may extend, or None when it does.

    Version 0 is the seed dir itself, so only the seed must match there. A marker written
    before markers carried a seed fingerprint cannot prove its seed: it counts as no state.
    """
    if applied > 0:
        if state.source_dir is not None and state.source_dir != origin.source_dir:
            return f"local state came from another source dir ({state.source_dir})"
        if state.run != origin.run:
            if origin.run is None:
                return f"local state came from run {state.run}; the source dir no longer names a run (a new run in its place)"
            if state.run is None:
                return f"the source dir now belongs to run {origin.run}; the local state came from a run without an id"
            return f"local state came from run {state.run}, the source dir now holds run {origin.run} (a new run)"
    if state.seed != origin.seed:
        if state.seed is None:
            return "the marker records no seed fingerprint (written by an older puller)"
        return "the seed dir changed since this local state was seeded (another model, or replaced in place)"
    return None


__all__ = ["Origin", "seed_fingerprint", "source_origin", "mismatch", "NO_SEED"]
