"""Read and write safetensors files without the safetensors package, with bounds checked.

Layout: little-endian u64 header length N, N bytes of JSON, then the data area. The JSON maps
tensor name -> {dtype, shape, data_offsets: [begin, end]} (offsets relative to the data area)
plus an optional ``__metadata__`` of str -> str. Readers here refuse a header larger than the
knob allows, offsets past the end of the file, overlapping tensors, and a byte length that does
not match dtype x shape.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable, Iterator, Mapping, Sequence

import msgspec

from .. import knobs
from ..errors import MalformedHeaderError, ShardShrunkError

DTYPE_NBYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
METADATA_KEY = "__metadata__"
_ALIGN = 8


class TensorEntry(msgspec.Struct, frozen=True):
    """Where one tensor's bytes live: ``offset`` is absolute within the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SafetensorsHeader(msgspec.Struct, frozen=True):
    path: str
    header_nbytes: int
    data_offset: int
    file_nbytes: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str, *, check_dtype_sizes: bool = True) -> SafetensorsHeader:
    """Parse and bound-check a safetensors header (reads only the header bytes)."""
    try:
        with open(path, "rb") as f:
            file_nbytes = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise MalformedHeaderError(path, f"file is {file_nbytes} bytes, shorter than the 8-byte length prefix")
            (n,) = struct.unpack("<Q", head)
            limit = int(knobs.MAX_HEADER_NBYTES.get())
            if n > limit:
                raise MalformedHeaderError(path, f"header length {n} exceeds the limit {limit}")
            if 8 + n > file_nbytes:
                raise MalformedHeaderError(path, f"header length {n} runs past the end of the {file_nbytes}-byte file (truncated?)")
            raw = f.read(n)
    except FileNotFoundError:
        raise
    return parse_header(path, raw, file_nbytes, check_dtype_sizes=check_dtype_sizes)


def parse_header(path: str, raw: bytes, file_nbytes: int, *, check_dtype_sizes: bool = True) -> SafetensorsHeader:
    n = len(raw)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedHeaderError(path, f"header is not valid JSON ({e})") from None
    except RecursionError:
        # A small header can nest deeper than the interpreter recurses; no real header nests.
        raise MalformedHeaderError(path, "header nests too deeply to be a safetensors header") from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "header is not a JSON object")
    data_offset = 8 + n
    data_nbytes = file_nbytes - data_offset
    metadata = obj.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise MalformedHeaderError(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in obj.items():
        if not isinstance(info, dict):
            raise MalformedHeaderError(path, f"entry {name!r} is not an object")
        dtype = info.get("dtype")
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype not in DTYPE_NBYTES:
            raise MalformedHeaderError(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise MalformedHeaderError(path, f"tensor {name!r} has a bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise MalformedHeaderError(path, f"tensor {name!r} has bad data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_nbytes:
            raise MalformedHeaderError(
                path, f"tensor {name!r} spans [{begin}, {end}) outside the {data_nbytes}-byte data area (truncated?)"
            )
        nbytes = end - begin
        if check_dtype_sizes:
            expected = math.prod(shape) * DTYPE_NBYTES[dtype]
            if nbytes != expected:
                raise MalformedHeaderError(
                    path, f"tensor {name!r} holds {nbytes} bytes, but {dtype} x {shape} needs {expected}"
                )
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_offset + begin, nbytes)
        spans.append((begin, end, name))
    _check_no_overlap(path, spans)
    return SafetensorsHeader(path, n, data_offset, file_nbytes, tensors, dict(metadata))


def _check_no_overlap(path: str, spans: list[tuple[int, int, str]]) -> None:
    """No two non-empty tensors share a byte. Each span is compared with the furthest end seen
    so far, not only with its neighbour: an empty tensor sorted between two overlapping ones
    would otherwise hide the overlap."""
    reach, reach_name = 0, ""
    for begin, end, name in sorted(s for s in spans if s[1] > s[0]):
        if begin < reach:
            raise MalformedHeaderError(path, f"tensors {reach_name!r} and {name!r} overlap")
        if end > reach:
            reach, reach_name = end, name


def build_header(entries: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included, padded to 8) and each entry's data-area offset."""
    header: dict[str, object] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


def as_byte_view(buf) -> memoryview:
    """A flat byte view of any C-contiguous buffer. ``memoryview.cast`` refuses shapes with a
    zero in them ((0, 3): a legal, empty tensor), so those become an empty view."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return memoryview(b"")
    return mv.cast("B")


def iter_file_chunks(
    entries: Sequence[tuple[str, str, tuple[int, ...], object]], metadata: Mapping[str, str] | None
) -> Iterator[bytes | memoryview]:
    """Chunks of a safetensors file: header, then each entry's buffer in order."""
    views = [as_byte_view(buf) for _, _, _, buf in entries]
    head, _ = build_header(((n, d, s, v.nbytes) for (n, d, s, _), v in zip(entries, views)), metadata)
    yield head
    yield from views


def local_tensor_table(checkpoint_dir: str, weight_files: Iterable[str]) -> dict[str, tuple[str, TensorEntry]]:
    """name -> (file path, entry) over the given files; a duplicate name is malformed."""
    table: dict[str, tuple[str, TensorEntry]] = {}
    for fname in weight_files:
        path = os.path.join(checkpoint_dir, fname)
        hdr = read_header(path)
        for name, entry in hdr.tensors.items():
            if name in table:
                raise MalformedHeaderError(path, f"tensor {name!r} also appears in {table[name][0]}")
            table[name] = (path, entry)
    return table


def read_range(fd: int, offset: int, nbytes: int, path: str) -> bytearray:
    """Exactly ``nbytes`` at ``offset`` of an open file, copied into memory. Shards of the
    source dir are read this way, never through a map: a file cut short while mapped kills the
    process with SIGBUS, a short pread is a ``ShardShrunkError``."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    try:
        while got < nbytes:
            k = os.preadv(fd, [view[got:]], offset + got)
            if k == 0:
                raise ShardShrunkError(path, offset + nbytes, os.fstat(fd).st_size)
            got += k
    finally:
        view.release()
    return buf


class RangeStream:
    """A file-like reader of ``[offset, offset + nbytes)`` of an open file, by pread: what a
    streaming decoder takes for a payload too large to copy whole (bounded memory), with the
    same typed error as ``read_range`` when the file shrinks under it."""

    def __init__(self, fd: int, offset: int, nbytes: int, path: str):
        self.fd, self.offset, self.nbytes, self.path = fd, offset, nbytes, path
        self.pos = 0

    def read(self, size: int = -1) -> bytes:
        left = self.nbytes - self.pos
        k = left if size is None or size < 0 else min(size, left)
        if k <= 0:
            return b""
        data = os.pread(self.fd, k, self.offset + self.pos)
        if not data:
            raise ShardShrunkError(self.path, self.offset + self.nbytes, os.fstat(self.fd).st_size)
        self.pos += len(data)
        return data

    def pread(self, at: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``at`` of the range (fewer only at its end)."""
        k = max(0, min(size, self.nbytes - at))
        data = os.pread(self.fd, k, self.offset + at) if k else b""
        if len(data) < k:
            raise ShardShrunkError(self.path, self.offset + self.nbytes, os.fstat(self.fd).st_size)
        return data
