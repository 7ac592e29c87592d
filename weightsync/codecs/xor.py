"""``xor`` (upstream): payload = zstd(new XOR old) over the whole tensor; an involution."""

from __future__ import annotations

import numpy as np

from ..errors import PayloadBoundError
from .base import SCRATCH, UINT_OF_WIDTH, Encoded, PayloadDensity, count_changed, element_count
from .zstd_frames import ExactReader, check_frame, compress


class XorCodec:
    name = "xor"
    # check_structure walks the frame only: a load may pass a file range, not the payload's bytes
    structure_from_frame = True

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
        elements = element_count(content, width)
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


CODEC: XorCodec = XorCodec()
