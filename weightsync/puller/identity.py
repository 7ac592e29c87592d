"""Where a local state came from: the seed dir it grew from and the run that published its chain.

The applied-version marker records both, and a pull trusts a marker only when they still hold:
a local dir seeded from one model must not be taken for another model's version 0, and a chain
from one run must not be extended with (or mistaken for) another run's versions under the same
source dir path.

- The *seed fingerprint* is an xxh3-128 digest over the seed dir's index bytes (or, without an
  index, the names of its weight files) and, for the index and each weight file the checkpoint
  names: its name, size, mtime_ns, inode and ctime_ns; for a weight file also its whole
  safetensors header and samples of every tensor (its first, middle and last
  ``TENSOR_SAMPLE_NBYTES`` bytes), read in one pass in file order, nearby samples joined into one
  read. Any write a user can make without root moves the ctime (``os.utime`` puts back the mtime,
  never the ctime) and a copy or a rename-over gets a new inode, so an in-place edit anywhere
  reseeds; the header and the per-tensor samples also catch a model replaced by a file system
  that keeps both (a restored snapshot of another model). Cost: one stat and about
  ``tensors x 3 x 64`` bytes read per weight file, about two reads a tensor once neighbours
  are joined, on every pull: 30 shards of 1,000 tensors (150 GiB) take 60k preads, 0.5-0.7 s
  from the page cache on the 2-core CI box (a cold network mount pays its latency per read).
  A touched, chmod'ed or hard-linked file costs one needless reseed (the safe side), and so
  does a seed dir re-extracted to new inodes.
- On a memory filesystem (tmpfs, ramfs, hugetlbfs) a write through a shared writable mapping
  keeps inode, size, mtime and ctime (no page_mkwrite hook moves the times), so there every
  byte of each weight file is hashed instead of the samples (``_hash_whole``).
- The *run id* is a random id that our publisher writes once into a fresh source dir
  (``weightsync-run.json``). A source dir without it (an upstream writer's) is known by its
  real path alone.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Callable

import msgspec

from .. import knobs
from ..errors import MalformedHeaderError
from ..format.checksum import new_hasher
from ..format.layout import INDEX_NAME, SINGLE_FILE_NAME, checked_join, index_path, run_path
from ..format.manifest import AppliedState, checkpoint_weight_files, read_run_id
from ..format.safetensors_io import parse_header
from ..fsio import find_memory_filesystem

SAMPLE_NBYTES = 4096
TENSOR_SAMPLE_NBYTES = 64
JOIN_GAP_NBYTES = 4096
MAX_JOINED_NBYTES = 1 << 18
FULL_HASH_CHUNK_NBYTES = 1 << 20
NO_SEED = "none"  # the fingerprint of a seed dir that is not a readable checkpoint


class Origin(msgspec.Struct, frozen=True):
    """What a local state must match to be extended: the source (path, run) and the seed."""

    source_dir: str  # real path
    run: str | None
    seed: str


def seed_fingerprint(seed_dir: str) -> str:
    """A cheap digest that changes when the seed dir holds another model or a file of it was
    written to (see the module doc); ``NO_SEED`` when it is not a complete, readable checkpoint
    (``explain_seed_dir`` says why)."""
    try:
        return _fingerprint(seed_dir)
    except (OSError, ValueError, RecursionError):
        return NO_SEED


def seed_fingerprint_started(seed_dir: str) -> "Callable[[], str] | None":
    """The seed fingerprint as a call that waits for it. Where it hashes every byte (a seed on a
    memory filesystem, ~0.3-0.5 s per 512 MiB) it runs in a thread, so a pull through a mirror
    overlaps it with its fetch (inside the same host lock, as the pull's own reading of it would
    be); elsewhere (samples: cheap) it is computed at once. What makes the seed dir unusable
    (not a checkpoint, a file missing) is found before this returns (None), so a pull still
    refuses such a seed before it writes anything; a read failing midway gives ``NO_SEED`` at the
    wait."""
    try:
        files = checkpoint_weight_files(seed_dir)
        paths = [checked_join(seed_dir, name, f"{seed_dir}/{INDEX_NAME}") for name in files]
        whole = any(find_memory_filesystem(p) is not None for p in paths)
        for p in paths:
            os.stat(p)
    except (OSError, ValueError, RecursionError):
        return None
    if not whole:
        value = seed_fingerprint(seed_dir)
        return (lambda: value) if value != NO_SEED else None
    out: list[str] = []
    worker = threading.Thread(target=lambda: out.append(seed_fingerprint(seed_dir)),
                              name="weightsync-seed-fingerprint", daemon=True)
    worker.start()

    def wait() -> str:
        worker.join()
        return out[0] if out else NO_SEED

    return wait


def explain_seed_dir(seed_dir: str) -> str | None:
    """Why the seed dir has no fingerprint (not a dir, an index naming a missing shard, a
    header that does not parse), or None when it has one."""
    if not os.path.isdir(seed_dir):
        return "it is not a directory" + ("" if os.path.exists(seed_dir) else " (it does not exist)")
    try:
        _fingerprint(seed_dir)
    except (OSError, ValueError, RecursionError) as e:
        return str(e)
    return None


def _fingerprint(seed_dir: str) -> str:
    h = new_hasher("xxh3-128")
    files = checkpoint_weight_files(seed_dir)
    ipath = index_path(seed_dir)
    if os.path.exists(ipath):
        with open(ipath, "rb") as f:
            h.update(_stat_line(INDEX_NAME, os.fstat(f.fileno())))
            h.update(f.read())
    else:
        h.update(SINGLE_FILE_NAME.encode())
    for name in files:
        path = checked_join(seed_dir, name, f"{seed_dir}/{INDEX_NAME}")
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            h.update(_stat_line(name, st))
            if find_memory_filesystem(path) is not None:
                _hash_whole(h, f.fileno(), st.st_size)
            else:
                _hash_samples(h, f.fileno(), path, st.st_size)
    return h.hexdigest()


def _hash_whole(h, fd: int, size: int) -> None:
    """Every byte of a file on a memory filesystem (tmpfs, ramfs, hugetlbfs): a write through a
    shared writable mapping there moves neither mtime nor ctime, and may land anywhere, so no
    sample can stand for the file. Read with pread into one reused buffer, never mapped (a file
    cut short under a map is a SIGBUS): 512 MiB took 0.3-0.5 s on the shared 2-core CI box
    (about 1.5 GiB/s; xxh3 alone ran at 2.9 GiB/s there)."""
    buf = bytearray(min(FULL_HASH_CHUNK_NBYTES, max(size, 1)))
    view = memoryview(buf)
    at = 0
    try:
        while at < size:
            k = os.preadv(fd, [view[: min(len(buf), size - at)]], at)
            if k == 0:
                break
            h.update(view[:k])
            at += k
    finally:
        view.release()


def _stat_line(name: str, st: os.stat_result) -> bytes:
    # No st_dev: a network mount's device number may change across remounts, and the path,
    # inode and ctime already name the file.
    return f"\0{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}\0".encode()


def _hash_samples(h, fd: int, path: str, size: int) -> None:
    """The file's header and every tensor's first, middle and last bytes, plus four 4 KiB
    ranges of the file (bytes outside every tensor, and files whose header does not parse)."""
    head = os.pread(fd, 8, 0)
    h.update(head)
    ranges = [(at, SAMPLE_NBYTES) for at in _sample_offsets(size)]
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= int(knobs.MAX_HEADER_NBYTES.get()) and 8 + n <= size:
            raw = os.pread(fd, n, 8)
            h.update(raw)
            try:
                tensors = list(parse_header(path, raw, size, check_dtype_sizes=False).tensors.values())
            except MalformedHeaderError:
                tensors = []  # its raw header is in the digest; the seed itself will fail typed
            for e in tensors:
                for at in _tensor_sample_offsets(e.offset, e.nbytes):
                    ranges.append((at, min(TENSOR_SAMPLE_NBYTES, e.offset + e.nbytes - at)))
    for at, nbytes in _joined(ranges):
        h.update(os.pread(fd, nbytes, at))


def _sample_offsets(size: int) -> list[int]:
    last = max(0, size - SAMPLE_NBYTES)
    return sorted({0, size // 3, 2 * size // 3, last})


def _tensor_sample_offsets(offset: int, nbytes: int) -> set[int]:
    if nbytes == 0:
        return set()
    last = offset + max(0, nbytes - TENSOR_SAMPLE_NBYTES)
    return {offset, offset + max(0, nbytes // 2 - TENSOR_SAMPLE_NBYTES // 2), last}


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges sorted, and those less than a page apart read as one (one syscall, one page), up
    to ``MAX_JOINED_NBYTES`` a read (a file of many small tensors stays a few bounded reads)."""
    out: list[tuple[int, int]] = []
    for at, nbytes in sorted(ranges):
        if out and at <= out[-1][0] + out[-1][1] + JOIN_GAP_NBYTES and at + nbytes - out[-1][0] <= MAX_JOINED_NBYTES:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][1], at + nbytes - start))
        else:
            out.append((at, nbytes))
    return out


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


__all__ = ["Origin", "seed_fingerprint", "seed_fingerprint_started", "explain_seed_dir", "source_origin", "mismatch", "NO_SEED"]
