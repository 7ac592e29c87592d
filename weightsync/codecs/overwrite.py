"""``overwrite`` (upstream): zstd(u32 count, count ascending u32 byte positions, count new bytes)."""

from __future__ import annotations

import numpy as np

from ..errors import OverwriteTooLargeError, PayloadBoundError
from .base import SCRATCH, Encoded, PayloadDensity, count_changed, element_count
from .zstd_frames import ExactReader, check_frame, compress, decompress_exact, frame_nbytes


class OverwriteCodec:
    name = "overwrite"
    structure_from_frame = True  # as xor's: check_structure walks the frame only
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
        elements = element_count(nbytes, itemsize)
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


CODEC: OverwriteCodec = OverwriteCodec()
