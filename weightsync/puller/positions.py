"""Which elements of each tensor a chain of delta versions changed, read from the payloads.

An engine that patches its live weights in place (sglang_patch's live apply) needs, for a
chain ``from_version -> to_version``, every changed element of every changed tensor. Diffing
whole tensors to find them costs more than the reload it would replace; the payloads already
say it:

- ``xor``: the nonzero bytes of the decompressed stream (decoded chunk by chunk);
- ``overwrite``: the byte-position stream only (the values stream is not read);
- ``sparse-v1``: the gap streams only (values, signs and large-value planes are not read).

Byte positions become element positions (``byte // itemsize``); a tensor's positions over the
chain are the sorted union of each version's. Memory: 8 bytes per changed element of the tensor
being decoded, plus one decode chunk; a caller that keeps positions keeps what it chose to.

Invariants: a chain with a full version in it has no element positions (the caller reloads;
``ChangeChain.full_version`` names it); payloads are checked as ``pull`` checks them (index,
shards, structure, bounds) before anything is decoded, and a position past the tensor raises
``PayloadBoundError``. Torch-free, like the rest of the core.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import msgspec
import numpy as np

from ..codecs.base import SCRATCH
from ..codecs.zstd_frames import ExactReader, decompress_exact, frame_nbytes
from ..errors import InvalidRequestError, LocalTensorMismatchError, PayloadBoundError, PositionsUnavailableError
from ..format.layout import format_version, state_path, verified_path
from ..format.manifest import VersionIndex, checkpoint_weight_files, parse_version_number, read_applied_state, read_version_index
from ..format.safetensors_io import DTYPE_NBYTES, TensorEntry, local_tensor_table
from ..fsio import is_pid_alive
from .apply import _open_shard, load_delta, read_payload

DECODE_CHUNK_NBYTES = 8 << 20


class ChangeChain(msgspec.Struct, frozen=True):
    """The versions between two versions of one source dir: deltas only, or the first full one."""

    from_version: int
    to_version: int
    deltas: list[int]
    full_version: int | None  # the newest full version in (from, to]: no element positions then

    @property
    def is_deltas_only(self) -> bool:
        return self.full_version is None


class HeldVersion(msgspec.Struct, frozen=True):
    """The version a local checkpoint dir holds verified, and where it came from: the source dir,
    the run that published its chain and the fingerprint of the seed it grew from (as the
    marker or the note records them; None where they do not)."""

    version: int
    source_dir: str | None
    how: str  # "marker" or "verified note" (deferred durability: pages still being flushed)
    run: str | None = None
    seed: str | None = None


def plan_change_chain(source_dir: str, from_version: int, to_version: int) -> tuple[ChangeChain, dict[int, VersionIndex]]:
    """The chain ``from_version -> to_version`` (reads index files only) and the indexes read.

    Raises:
        InvalidRequestError: ``to_version`` is not above ``from_version``.
        VersionMissingError, ChainBrokenError: a version of the chain is not published.
    """
    if to_version <= from_version:
        raise InvalidRequestError(f"a change chain goes forward: v{from_version} -> v{to_version}")
    indexes: dict[int, VersionIndex] = {}
    for v in range(to_version, from_version, -1):
        idx = read_version_index(source_dir, v)
        indexes[v] = idx
        if idx.kind == "full":
            return ChangeChain(from_version, to_version, [], v), indexes
    return ChangeChain(from_version, to_version, list(range(from_version + 1, to_version + 1)), None), indexes


def iter_changed_elements(
    local_checkpoint_dir: str,
    source_dir: str,
    chain: ChangeChain,
    indexes: dict[int, VersionIndex] | None = None,
    *,
    skip: frozenset[str] = frozenset(),
    windows: Mapping[str, tuple[int, int]] | None = None,
) -> Iterator[tuple[str, TensorEntry, np.ndarray]]:
    """``(tensor name, its local entry, sorted unique int64 element positions)`` per changed tensor.

    The local checkpoint supplies each tensor's dtype and byte length (its headers only; no
    tensor bytes are read). Tensors come in name order. Tensors named in ``skip`` are not
    decoded (a pipeline stage or expert rank that holds none of their elements). ``windows``:
    per tensor, the (first, last) elements the caller needs; positions outside may come too
    (see ``changed_elements``).

    Raises:
        PositionsUnavailableError: the chain has a full version, or a sparse-v2 payload whose
            positions depend on the old bytes' magnitude classes (reload instead).
        LocalTensorMismatchError: a changed tensor is not in the local checkpoint.
        PayloadBoundError, MalformedHeaderError, ShardMismatchError: a payload is malformed.
    """
    if not chain.is_deltas_only:
        raise PositionsUnavailableError(f"v{chain.full_version} is a full version: the chain has no element positions")
    table = local_tensor_table(local_checkpoint_dir, checkpoint_weight_files(local_checkpoint_dir))
    loaded = [load_delta(indexes[v] if indexes and v in indexes else read_version_index(source_dir, v)) for v in chain.deltas]
    fds: dict[str, int] = {}  # shard path -> its descriptor (re-checked to be the loaded file)

    def payload_of(ref):
        fd = fds.get(ref.path)
        if fd is None:
            fd = fds[ref.path] = _open_shard(ref.path, ref.file_id)
        return read_payload(fd, ref)  # copied with pread: a shard cut short is a typed error, not SIGBUS

    try:
        names = sorted({name for d in loaded for name in d.tensors})
        for name in names:
            if name not in table:
                raise LocalTensorMismatchError(name, "the chain changes it, but the local checkpoint has no such tensor")
            if name in skip:
                continue
            entry = table[name][1]
            itemsize = DTYPE_NBYTES[entry.dtype]
            parts = []
            for d in loaded:
                if name not in d.tensors:
                    continue
                view = payload_of(d.tensors[name].ref)
                try:
                    window = windows.get(name) if windows else None
                    parts.append(changed_elements(d.index.delta_encoding or "", view, entry.nbytes, itemsize, name, window))
                finally:
                    view.release()
            yield name, entry, parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))
    finally:
        for fd in fds.values():
            os.close(fd)


def changed_elements(
    encoding: str, payload, nbytes: int, itemsize: int, tensor: str, window: tuple[int, int] | None = None
) -> np.ndarray:
    """Sorted unique int64 element positions one payload changes in a tensor of ``nbytes``.

    ``window`` (first, last element, inclusive): every changed position inside it is returned;
    positions outside it may be too. A sparse-v1 payload then decodes only the segments that
    overlap it (a TP rank's rows of a row-split tensor); the other encodings decode everything.
    """
    decode = _DECODERS.get(encoding)
    if decode is None:
        raise PositionsUnavailableError(
            f"no position decoder for delta encoding {encoding!r}; known: {sorted(_DECODERS)}", tensor=tensor, encoding=encoding
        )
    return decode(payload, nbytes, itemsize, tensor, window)


def _bytes_to_elements(byte_positions: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return byte_positions.astype(np.int64, copy=False)
    elements = byte_positions.astype(np.int64) // itemsize
    # ascending bytes give ascending elements; drop the repeats of multi-byte elements
    if elements.size > 1:
        keep = np.empty(elements.size, dtype=bool)
        keep[0] = True
        np.not_equal(elements[1:], elements[:-1], out=keep[1:])
        elements = elements[keep]
    return elements


def _xor_positions(payload, nbytes: int, itemsize: int, tensor: str, window: tuple[int, int] | None = None) -> np.ndarray:
    del window  # one zstd stream: every chunk is decoded to reach the next
    _, content = frame_nbytes(payload, tensor)
    if content != nbytes:
        raise PayloadBoundError(tensor, f"xor stream of {content} bytes for a {nbytes}-byte tensor")
    reader = ExactReader(payload, nbytes, tensor)
    buf = SCRATCH.get("positions-xor", min(DECODE_CHUNK_NBYTES, max(nbytes, 1)))
    found = []
    pos = 0
    while pos < nbytes:
        k = min(buf.nbytes, nbytes - pos)
        chunk = buf[:k]
        reader.readinto(chunk.data)
        if itemsize in (2, 4, 8) and pos % itemsize == 0 and k % itemsize == 0:
            wide = chunk.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
            hits = np.flatnonzero(wide)
            if hits.size:
                found.append(hits.astype(np.int64) + pos // itemsize)
        else:
            hits = np.flatnonzero(chunk)
            if hits.size:
                found.append(_bytes_to_elements(hits.astype(np.int64) + pos, itemsize))
        pos += k
    if not found:
        return np.empty(0, dtype=np.int64)
    out = np.concatenate(found)
    return np.unique(out) if itemsize not in (1, 2, 4, 8) else out


def _overwrite_positions(
    payload, nbytes: int, itemsize: int, tensor: str, window: tuple[int, int] | None = None
) -> np.ndarray:
    del window  # one stream of positions
    _, content = frame_nbytes(payload, tensor)
    if content < 4 or (content - 4) % 5:
        raise PayloadBoundError(tensor, f"overwrite payload of {content} bytes is not 4 + 5 x count")
    count = (content - 4) // 5
    reader = ExactReader(payload, content, tensor)
    head = np.empty(4, np.uint8)
    reader.readinto(head.data)
    if int(head.view("<u4")[0]) != count:
        raise PayloadBoundError(tensor, "overwrite count disagrees with payload size")
    positions = np.empty(count, dtype="<u4")
    if count:
        reader.readinto(positions.view(np.uint8).data)
        if np.any(positions[1:] <= positions[:-1]):
            raise PayloadBoundError(tensor, "overwrite positions are not strictly ascending")
        if int(positions[-1]) >= nbytes:
            raise PayloadBoundError(tensor, f"overwrite position {int(positions[-1])} is past the {nbytes}-byte tensor")
    return _bytes_to_elements(positions, itemsize)


def _sparse_positions(payload, nbytes: int, itemsize: int, tensor: str, window: tuple[int, int] | None = None) -> np.ndarray:
    from ..codecs.sparse_v1 import parse

    parsed = parse(payload, nbytes, tensor)
    wanted = np.flatnonzero(parsed.counts)
    if window is not None and wanted.size:
        # the segments (of ``seg_elements`` units of ``width`` bytes) holding the window's bytes
        first = window[0] * itemsize // parsed.width // parsed.seg_elements
        last = ((window[1] + 1) * itemsize - 1) // parsed.width // parsed.seg_elements
        wanted = wanted[(wanted >= first) & (wanted <= last)]
    # one int64 array for the whole payload, each segment's positions cumulated straight into
    # its slice (a 5% change of a large tensor is tens of millions of positions: every extra
    # int64 pass over them costs as much as the decompression)
    units = np.empty(int(parsed.counts[wanted].sum(dtype=np.int64)), dtype=np.int64)
    at = 0
    for s in wanted:
        seg = parsed.segment(payload, int(s))
        count = seg.nchanged
        if count == 0:
            continue
        planes = [np.frombuffer(decompress_exact(frame, count, tensor), np.uint8) for frame in seg.gap_frames]
        if len(planes) == 1:
            steps = planes[0].astype(np.uint16)  # gap - 1 < 256: the step fits 16 bits
        else:
            steps = planes[0].astype(np.int64)
            for j, plane in enumerate(planes[1:], start=1):
                steps |= plane.astype(np.int64) << (8 * j)
        steps += 1
        out = units[at : at + count]
        np.cumsum(steps, dtype=np.int64, out=out)
        out += seg.start - 1
        if int(out[-1]) >= seg.start + seg.length:
            raise PayloadBoundError(tensor, f"sparse-v1 position {int(out[-1])} is past its segment")
        at += count
    if parsed.width == itemsize:
        return units
    return _bytes_to_elements(units * parsed.width, itemsize)


def _sparse2_positions(payload, nbytes: int, itemsize: int, tensor: str, window: tuple[int, int] | None = None) -> np.ndarray:
    del window  # not used yet: every segment is decoded
    # A class is a range of the *old* element's magnitude: with several classes in a segment
    # the positions are ranks among elements of the old version, which this host no longer
    # holds once the chain is applied. One class spans the whole segment: plain positions.
    # A range-coded segment (bitstream 3) takes every decision in the context of the old bytes.
    from ..codecs.sparse_v2 import CodedSegment, _decode_mask, parse

    parsed = parse(payload, nbytes, tensor)
    found = []
    for index, seg in enumerate(parsed.segments):
        if seg.nchanged == 0:
            continue
        if isinstance(seg, CodedSegment):
            raise PositionsUnavailableError(
                f"sparse-v2 segment {index} of {tensor} is range coded in the context of the old bytes, which are "
                "not on this host after the pull", tensor=tensor, encoding="sparse-v2",
            )
        if len(seg.classes) != 1:
            raise PositionsUnavailableError(
                f"sparse-v2 segment {index} of {tensor} codes its changes in {len(seg.classes)} magnitude classes of the "
                "old bytes, which are not on this host after the pull", tensor=tensor, encoding="sparse-v2",
            )
        found.append(_decode_mask(seg.classes[0], tensor, index, 0) + seg.start)
    if not found:
        return np.empty(0, dtype=np.int64)
    units = np.concatenate(found)
    if parsed.width == itemsize:
        return units
    return _bytes_to_elements(units * parsed.width, itemsize)


_DECODERS = {
    "xor": _xor_positions,
    "overwrite": _overwrite_positions,
    "sparse-v1": _sparse_positions,
    "sparse-v2": _sparse2_positions,
}


def held_version(local_checkpoint_dir: str) -> HeldVersion | None:
    """What the local checkpoint dir holds verified: its marker, else a live pull's verified note.

    The note exists while a pull with deferred durability flushes the verified pages (the bytes
    are final; only the marker is not written yet). None: unknown (no marker, torn state).
    """
    held = _marked_version(local_checkpoint_dir)
    if held is not None:
        return held
    noted = _noted_version(local_checkpoint_dir)
    if noted is not None:
        return noted
    # A deferred flush writes the marker before it removes its note: a flush that finished between
    # our two reads left the marker, not nothing (without this second look the reader would call a
    # verified checkpoint unverified).
    return _marked_version(local_checkpoint_dir)


def _marked_version(local_checkpoint_dir: str) -> HeldVersion | None:
    state = read_applied_state(state_path(local_checkpoint_dir))
    if state is None:
        return None
    try:
        version = parse_version_number(state.version, "version", state_path(local_checkpoint_dir))
    except Exception:
        return None
    return HeldVersion(version, state.source_dir, "marker", state.run, state.seed)


def _noted_version(local_checkpoint_dir: str) -> HeldVersion | None:
    try:
        with open(verified_path(local_checkpoint_dir), "rb") as f:
            note = json.loads(f.read(1 << 12))
        version = parse_version_number(note["version"], "version", verified_path(local_checkpoint_dir))
        pid = note.get("pid")
        if not isinstance(pid, int) or not is_pid_alive(pid) or note["version"] != format_version(version):
            return None
        run, seed = note.get("run"), note.get("seed")
        return HeldVersion(version, note.get("source_dir"), "verified note",
                           run if isinstance(run, str) else None, seed if isinstance(seed, str) else None)
    except Exception:  # missing, torn or foreign: no claim
        return None


__all__ = ["ChangeChain", "HeldVersion", "plan_change_chain", "iter_changed_elements", "changed_elements", "held_version"]
