"""Delta encodings: a registry of codecs, each turning (old bytes, new bytes) into one payload
and applying a payload to a region of the local checkpoint in place.

- ``xor`` (upstream): payload = zstd(new XOR old) over the whole tensor; an involution.
- ``overwrite`` (upstream): zstd(u32 count, count ascending u32 byte positions, count new bytes).
- ``sparse-v1`` (ours, opt-in for upstream readers): see ``codec_sparse``.
- ``sparse-v2`` (ours): the changed elements, Rice / Exp-Golomb coded per class of the old
  element's exponent; see ``codec_sparse2``.

Codecs are byte-level. ``itemsize`` (the element width of the tensor's dtype) is passed so a
codec may work on elements; xor and overwrite ignore it.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from .errors import OverwriteTooLargeError, PayloadBoundError, UnsupportedFormatError
from .zstd_frames import ExactReader, check_frame, compress, decompress_exact, frame_nbytes

UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Encoded(tuple):
    """(payload, changed_bytes, changed_elements)."""

    __slots__ = ()

    def __new__(cls, payload: bytes, changed_bytes: int, changed_elements: int):
        return super().__new__(cls, (payload, changed_bytes, changed_elements))

    payload = property(lambda self: self[0])
    changed_bytes = property(lambda self: self[1])
    changed_elements = property(lambda self: self[2])


class Scratch(threading.local):
    """Per-thread reusable buffers: a fresh large allocation per tensor costs page faults."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
            self._bufs[key] = buf
        return buf[:nbytes]


SCRATCH = Scratch()


class Codec(Protocol):
    """One delta encoding. A pull proves each payload once, at load (``check_structure``), and
    keeps what that returned (the payload's *structure*: a size, a parsed table) instead of
    the payload: the shard is closed until the apply reopens it. ``check_fit`` then judges the
    payload against the local tensor from the structure alone, and ``apply`` takes it back."""

    name: str

    def encode(self, old: np.ndarray, new: np.ndarray, itemsize: int, level: int, tensor: str) -> Encoded | None:
        """The compressed payload and change counts, or None when nothing changed."""

    def check_structure(self, payload, tensor: str) -> object:
        """Everything about the payload alone (frames, sizes, tables), without bulk
        decompression; returns the structure ``check_fit`` and ``apply`` take."""

    def check_fit(self, structure, nbytes: int, itemsize: int, tensor: str) -> None:
        """The payload fits a local tensor of ``nbytes`` bytes (from the structure alone)."""

    def check(self, payload, nbytes: int, itemsize: int, tensor: str) -> None:
        """Cheap bounds check before any write: sizes only, no bulk decompression."""

    def apply(self, region: np.ndarray, payload, itemsize: int, tensor: str, chunk_nbytes: int, structure=None) -> None:
        """Apply one payload to ``region`` (a writable uint8 view of the tensor's bytes)."""


class PayloadDensity(NamedTuple):
    """What one payload changes, for ``weightsync inspect --density``. A field is None when
    neither the payload nor the reference the caller passed can tell it."""

    tensor_nbytes: int | None
    tensor_elements: int | None
    changed_elements: int | None
    changed_bytes: int | None


class DensityCodec(Protocol):
    """A codec that can say how much of its tensor one payload changes (every registered codec)."""

    def density(self, payload, nbytes: int | None, itemsize: int | None, tensor: str) -> PayloadDensity:
        """Count the changes of one payload; ``nbytes`` and ``itemsize`` come from a reference
        checkpoint when the caller has one (a full version or the seed dir), else None."""


def _elements(nbytes: int | None, itemsize: int | None) -> int | None:
    if nbytes is None or not itemsize or nbytes % itemsize:
        return None
    return nbytes // itemsize


@runtime_checkable
class ChainCodec(Protocol):
    """A codec that applies several payloads of one tensor segment-major (every payload's
    changes to one segment, then the segment is hashed while in cache) and can split a chain
    by segment ranges across workers (``sparse-v1``, ``sparse-v2``)."""

    def apply_chain(
        self, region: np.ndarray, payloads: list, structures: list, tensor: str, chunk_nbytes: int, hasher,
        seg_range: tuple[int, int] | None = None,
    ) -> None:
        """Apply ``payloads`` (oldest first; ``structures``: what ``check_structure`` returned
        for each) in place; feed ``hasher`` the final bytes when given (never with a range)."""

    def chain_segment_count(self, structures: list) -> int | None:
        """The segment count when every payload segments the tensor alike (then a chain may be
        split by segment ranges), else None. From the structures alone."""


class SegmentedCodec(Codec, Protocol):
    """A codec that can encode one tensor as independent segment ranges (on several workers)
    and join the parts into the payload a whole encode would give (``sparse-v1``)."""

    def segment_count(self, nbytes: int, itemsize: int) -> int:
        """How many segments a tensor of ``nbytes`` splits into."""

    def encode_part(
        self, old: np.ndarray, new: np.ndarray, itemsize: int, level: int, tensor: str, seg_range: tuple[int, int] | None
    ) -> tuple:
        """Segments [a, b) of the tensor (all when None), in the form ``join`` takes."""

    def join(self, parts: list, nbytes: int, itemsize: int) -> Encoded | None:
        """One payload from the parts of a tensor, in segment order; None when nothing changed."""


def count_changed(old: np.ndarray, new: np.ndarray, itemsize: int, xor: np.ndarray | None = None) -> tuple[int, int]:
    """(changed bytes, changed elements) between two equal-length uint8 arrays."""
    x = xor if xor is not None else np.bitwise_xor(old, new)
    changed_bytes = int(np.count_nonzero(x))
    if itemsize == 1 or changed_bytes == 0:
        return changed_bytes, changed_bytes
    wide = UINT_OF_WIDTH.get(itemsize)
    if wide is None or x.nbytes % itemsize:
        return changed_bytes, changed_bytes
    return changed_bytes, int(np.count_nonzero(x.view(wide)))


class XorCodec:
    name = "xor"

    def encode(self, old, new, itemsize, level, tensor):
        x = SCRATCH.get("xor", new.nbytes)
        np.bitwise_xor(old, new, out=x)
        changed_bytes, changed_elements = count_changed(old, new, itemsize, xor=x)
        if changed_bytes == 0:
            return None
        return Encoded(compress(x, level), changed_bytes, changed_elements)

    def check_structure(self, payload, tensor) -> int:
        """The tensor length the frame declares."""
        return check_frame(payload, None, tensor)

    def check_fit(self, structure: int, nbytes, itemsize, tensor):
        if structure != nbytes:
            raise PayloadBoundError(tensor, f"zstd frame declares {structure} bytes, expected {nbytes}")

    def check(self, payload, nbytes, itemsize, tensor):
        check_frame(payload, nbytes, tensor)

    def apply(self, region, payload, itemsize, tensor, chunk_nbytes, structure=None):
        apply_xor_chain(region, [payload], tensor, chunk_nbytes, hasher=None)

    def density(self, payload, nbytes, itemsize, tensor):
        """Streams the XOR mask chunk by chunk: memory stays bounded by the chunk."""
        content = check_frame(payload, nbytes, tensor)
        width = itemsize if itemsize in UINT_OF_WIDTH else None
        step = (1 << 20) * (width or 1)
        buf = np.empty(min(step, max(content, 1)), np.uint8)
        reader = ExactReader(payload, content, tensor)
        changed_bytes = changed_elements = 0
        for pos in range(0, content, step):
            chunk = buf[: min(step, content - pos)]
            reader.readinto(chunk.data)
            changed_bytes += int(np.count_nonzero(chunk))
            if width is not None and chunk.nbytes % width == 0:
                changed_elements += int(np.count_nonzero(chunk.view(UINT_OF_WIDTH[width])))
        elements = _elements(content, width)
        return PayloadDensity(content, elements, changed_elements if elements is not None else None, changed_bytes)


def apply_xor_chain(region: np.ndarray, payloads: list, tensor: str, chunk_nbytes: int, hasher) -> None:
    """XOR several payloads into region chunk by chunk: each byte of the tensor is read and
    written once however long the chain, and hashed while the chunk is still in cache."""
    nbytes = region.nbytes
    readers = [ExactReader(p, nbytes, tensor, slot=i) for i, p in enumerate(payloads)]
    buf = SCRATCH.get("xor-apply", min(chunk_nbytes, max(nbytes, 1)))
    pos = 0
    while pos < nbytes:
        k = min(buf.nbytes, nbytes - pos)
        view = region[pos : pos + k]
        chunk = buf[:k]
        for r in readers:
            r.readinto(chunk.data)
            np.bitwise_xor(view, chunk, out=view)
        if hasher is not None:
            hasher.update(view)
        pos += k


class OverwriteCodec:
    name = "overwrite"
    # Payloads up to this size are decompressed in one piece; larger ones are streamed
    # through two readers (positions, then values) so memory stays bounded.
    one_shot_nbytes = 8 << 20  # x workers stays well inside the puller's memory budget

    def encode(self, old, new, itemsize, level, tensor):
        if new.nbytes > 0xFFFFFFFF:
            raise OverwriteTooLargeError(tensor, new.nbytes)
        x = SCRATCH.get("xor", new.nbytes)
        np.bitwise_xor(old, new, out=x)
        positions = np.flatnonzero(x)
        if positions.size == 0:
            return None
        _, changed_elements = count_changed(old, new, itemsize, xor=x)
        body = np.empty(4 + 5 * positions.size, dtype=np.uint8)
        body[:4] = np.frombuffer(np.uint32(positions.size).astype("<u4").tobytes(), np.uint8)
        body[4 : 4 + 4 * positions.size] = positions.astype("<u4").view(np.uint8)
        body[4 + 4 * positions.size :] = new[positions]
        return Encoded(compress(body, level), int(positions.size), changed_elements)

    def check_structure(self, payload, tensor) -> int:
        """The change count the payload declares, after proving its frame and size."""
        content = check_frame(payload, None, tensor)
        if content < 4 or (content - 4) % 5:
            raise PayloadBoundError(tensor, f"overwrite payload of {content} bytes is not 4 + 5 x count")
        return (content - 4) // 5

    def check_fit(self, structure: int, nbytes, itemsize, tensor):
        if structure > nbytes:
            raise PayloadBoundError(tensor, f"overwrite of {structure} positions into a {nbytes}-byte tensor")

    def check(self, payload, nbytes, itemsize, tensor):
        self.check_fit(self.check_structure(payload, tensor), nbytes, itemsize, tensor)

    def apply(self, region, payload, itemsize, tensor, chunk_nbytes, structure=None):
        nbytes = region.nbytes
        _, content = frame_nbytes(payload, tensor)
        count = (content - 4) // 5
        if content <= self.one_shot_nbytes:
            body = np.frombuffer(decompress_exact(payload, content, tensor), np.uint8)
            declared = int(body[:4].view("<u4")[0])
            if declared != count:
                raise PayloadBoundError(tensor, f"overwrite count {declared} disagrees with payload size ({count})")
            positions = body[4 : 4 + 4 * count].view("<u4")
            _check_positions(positions, -1, nbytes, tensor)
            region[positions] = body[4 + 4 * count :]
            return
        pos_reader = ExactReader(payload, content, tensor)
        val_reader = ExactReader(payload, content, tensor, slot=1)
        head = np.empty(4, np.uint8)
        pos_reader.readinto(head.data)
        if int(head.view("<u4")[0]) != count:
            raise PayloadBoundError(tensor, "overwrite count disagrees with payload size")
        step = max(1, chunk_nbytes // 4)
        val_reader.skip(4 + 4 * count, SCRATCH.get("skip", min(chunk_nbytes, 4 + 4 * count)).data)
        pbuf = SCRATCH.get("ow-pos", 4 * step).view("<u4")
        vbuf = SCRATCH.get("ow-val", step)
        last = -1
        done = 0
        while done < count:
            k = min(step, count - done)
            p, v = pbuf[:k], vbuf[:k]
            pos_reader.readinto(p.data.cast("B"))
            val_reader.readinto(v.data)
            _check_positions(p, last, nbytes, tensor)
            region[p] = v
            last = int(p[-1])
            done += k

    def density(self, payload, nbytes, itemsize, tensor):
        """Each position is a changed byte; elements need the reference's element width, and the
        tensor's length is not in the payload at all."""
        count = self.check_structure(payload, tensor)
        elements = _elements(nbytes, itemsize)
        changed_elements = None
        if elements is not None and itemsize:
            body = np.frombuffer(decompress_exact(payload, 4 + 5 * count, tensor), np.uint8)
            positions = body[4 : 4 + 4 * count].view("<u4")
            changed_elements = int(np.unique(positions // np.uint32(itemsize)).size)
        return PayloadDensity(nbytes, elements, changed_elements, count)


def _check_positions(positions: np.ndarray, previous: int, nbytes: int, tensor: str) -> None:
    if positions.size == 0:
        return
    if int(positions[0]) <= previous or (positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1]))):
        raise PayloadBoundError(tensor, "overwrite positions are not strictly ascending")
    if int(positions[-1]) >= nbytes:
        raise PayloadBoundError(tensor, f"overwrite position {int(positions[-1])} is past the {nbytes}-byte tensor")


_CODECS: dict[str, Codec] = {"xor": XorCodec(), "overwrite": OverwriteCodec()}
UPSTREAM_ENCODINGS = ("xor", "overwrite")


def register_codec(codec: Codec) -> None:
    _CODECS[codec.name] = codec


def supported_encodings() -> list[str]:
    _load_optional_codecs()
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    _load_optional_codecs()
    try:
        return _CODECS[name]
    except KeyError:
        raise UnsupportedFormatError("delta_encoding", name, sorted(_CODECS)) from None


_optional_loaded = False


def _load_optional_codecs() -> None:
    global _optional_loaded
    if _optional_loaded:
        return
    _optional_loaded = True
    try:
        from . import codec_sparse, codec_sparse2  # noqa: F401  (register themselves)
    except ImportError:
        pass
