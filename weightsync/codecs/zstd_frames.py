"""zstd helpers that never trust a frame: exact content size, no trailing bytes, bounded output.

python-zstandard's defaults accept trailing data and trust the declared content size; a
payload here must be exactly one frame whose declared content size is what the reader expects.
The frame walk reads only block headers (3 bytes per block), so checking every payload of a
chain before the first write costs almost nothing.
"""

from __future__ import annotations

import threading

import zstandard

from ..errors import PayloadBoundError

_MAGIC = b"\x28\xb5\x2f\xfd"


def frame_nbytes(payload, tensor: str) -> tuple[int, int]:
    """(compressed size of the single frame, declared content size), or PayloadBoundError.

    ``payload`` is a buffer, or a reader of a file range with ``nbytes`` and ``pread(at,
    size)`` (``safetensors_io.RangeStream``): the walk then reads 3 bytes a block, never the
    whole payload."""
    if hasattr(payload, "pread"):
        n, read_at = payload.nbytes, payload.pread
    else:
        mv = memoryview(payload).cast("B")
        n = mv.nbytes

        def read_at(at: int, size: int) -> bytes:
            return bytes(mv[at : at + size])

    head = read_at(0, 18)
    if n < 6 or head[:4] != _MAGIC:
        raise PayloadBoundError(tensor, "payload is not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(head)
        pos = zstandard.frame_header_size(head)
    except zstandard.ZstdError as e:
        raise PayloadBoundError(tensor, f"bad zstd frame header ({e})") from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN or params.content_size < 0:
        raise PayloadBoundError(tensor, "zstd frame does not declare its content size")
    while True:
        if pos + 3 > n:
            raise PayloadBoundError(tensor, f"zstd frame truncated at byte {pos} of {n}")
        h = read_at(pos, 3)
        b = h[0] | (h[1] << 8) | (h[2] << 16)
        last, btype, bsize = b & 1, (b >> 1) & 3, b >> 3
        pos += 3
        if btype == 3:
            raise PayloadBoundError(tensor, "zstd block of reserved type")
        pos += 1 if btype == 1 else bsize
        if last:
            break
    if params.has_checksum:
        pos += 4
    if pos > n:
        raise PayloadBoundError(tensor, f"zstd frame truncated: needs {pos} bytes, has {n}")
    if pos != n:
        raise PayloadBoundError(tensor, f"{n - pos} trailing bytes after the zstd frame")
    return pos, params.content_size


def check_frame(payload, expected_content_nbytes: int | None, tensor: str, *, max_content_nbytes: int | None = None) -> int:
    _, content = frame_nbytes(payload, tensor)
    if expected_content_nbytes is not None and content != expected_content_nbytes:
        raise PayloadBoundError(tensor, f"zstd frame declares {content} bytes, expected {expected_content_nbytes}")
    if max_content_nbytes is not None and content > max_content_nbytes:
        raise PayloadBoundError(tensor, f"zstd frame declares {content} bytes, more than the bound {max_content_nbytes}")
    return content


class ThreadCodecs(threading.local):
    """One compressor and a few decompressors per thread: sharing one corrupts data.

    A ``ZstdDecompressor`` holds one decoding context, and every stream reader made from it
    uses that context; two readers alive at once (one per stream of a payload) need one
    decompressor each, hence the slots.
    """

    def __init__(self) -> None:
        self.level: int | None = None
        self.cctx: zstandard.ZstdCompressor | None = None
        self.dctx = zstandard.ZstdDecompressor()
        self.slots: list[zstandard.ZstdDecompressor] = [self.dctx]

    def decompressor(self, slot: int) -> zstandard.ZstdDecompressor:
        while len(self.slots) <= slot:
            self.slots.append(zstandard.ZstdDecompressor())
        return self.slots[slot]

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        if self.cctx is None or self.level != level:
            self.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
            self.level = level
        return self.cctx


_local = ThreadCodecs()


def compress(data, level: int) -> bytes:
    return _local.compressor(level).compress(data)


def decompress_exact(payload, nbytes: int, tensor: str) -> bytes:
    """Whole-frame decompression to exactly nbytes (the caller checked the frame first)."""
    try:
        out = _local.dctx.decompress(payload, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        _raise_memory_error_of(e)
        raise PayloadBoundError(tensor, f"zstd data is corrupt ({e})") from None
    if len(out) != nbytes:
        raise PayloadBoundError(tensor, f"zstd frame decompressed to {len(out)} bytes, expected {nbytes}")
    return out


def _raise_memory_error_of(e: zstandard.ZstdError) -> None:
    """An allocation failure inside zstd is the host's memory, not a corrupt payload."""
    if "memory" in str(e).lower() or "allocation" in str(e).lower():
        raise MemoryError(f"zstd could not allocate ({e})") from e


class ExactReader:
    """Streams exactly ``nbytes`` out of one frame into caller buffers (bounded memory).

    Readers alive at the same time in one thread must use different ``slot`` numbers.
    """

    def __init__(self, payload, nbytes: int, tensor: str, slot: int = 0):
        self.tensor = tensor
        self.remaining = nbytes
        self._reader = _local.decompressor(slot).stream_reader(payload, read_across_frames=False)

    def readinto(self, buf: memoryview) -> None:
        want = buf.nbytes
        if want > self.remaining:
            raise PayloadBoundError(self.tensor, "read past the declared content size")
        got = 0
        try:
            while got < want:
                k = self._reader.readinto(buf[got:])
                if not k:
                    raise PayloadBoundError(self.tensor, f"zstd frame ended {want - got} bytes early")
                got += k
        except zstandard.ZstdError as e:
            _raise_memory_error_of(e)
            raise PayloadBoundError(self.tensor, f"zstd data is corrupt ({e})") from None
        self.remaining -= want

    def skip(self, nbytes: int, scratch: memoryview) -> None:
        while nbytes:
            k = min(nbytes, scratch.nbytes)
            self.readinto(scratch[:k])
            nbytes -= k
