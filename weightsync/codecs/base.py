"""What every delta encoding shares: the codec protocols, the ``Encoded`` result, per-thread
scratch buffers and the change counts. The registry is the package's ``__init__``; each encoding
is one module beside this one.

Codecs are byte-level. ``itemsize`` (the element width of the tensor's dtype) is passed so a
codec may work on elements; xor and overwrite ignore it.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


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


def element_count(nbytes: int | None, itemsize: int | None) -> int | None:
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
