"""The upstream design, written from its description, as the benchmark's baseline.

Publish: per tensor ``new XOR old`` over the whole tensor, zstd level 1, one frame per tensor,
xxh3-128 of the new bytes; one thread pool over tensors. Pull: per tensor, stream-decompress
the frame in 2 MiB blocks, XOR each block into an mmap of the local file, hash the new bytes,
compare with the digest; one thread pool over tensors; each pending version is applied and
verified in turn (no folding); pages are flushed to disk at the end.

It gets the same courtesies as ours where they are not part of the design (per-thread reused
buffers, one decompressor per thread), so the comparison is between designs, not allocators.
The files it writes are safetensors files of 1-D U8 tensors with the digests in
``__metadata__``, which is also what our ``xor`` encoding writes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
import zstandard

from weightsync.fsio import write_file
from weightsync.format.safetensors_io import iter_file_chunks, read_header

BLOCK = 2 << 20


class _Local(threading.local):
    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
        self.dctx = zstandard.ZstdDecompressor()
        self.xor: np.ndarray | None = None
        self.block = np.empty(BLOCK, np.uint8)

    def xor_buf(self, n: int) -> np.ndarray:
        if self.xor is None or self.xor.nbytes < n:
            self.xor = np.empty(n, np.uint8)
        return self.xor[:n]


_tls = _Local()


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def prepare(old: dict[str, np.ndarray], new: dict[str, np.ndarray], workers: int, pool: ThreadPoolExecutor | None = None):
    """{name: (frame | None, digest)} and seconds: diff, compress and checksum from host memory."""

    def one(name: str):
        o, n = _flat(old[name]), _flat(new[name])
        x = _tls.xor_buf(n.nbytes)
        np.bitwise_xor(o, n, out=x)
        frame = _tls.cctx.compress(x) if x.any() else None
        return name, frame, xxhash.xxh3_128(n).hexdigest()

    names = sorted(new, key=lambda k: -new[k].nbytes)
    t0 = time.perf_counter()
    own = pool is None
    pool = pool or ThreadPoolExecutor(workers)
    try:
        out = {name: (frame, digest) for name, frame, digest in pool.map(one, names)}
    finally:
        if own:
            pool.shutdown()
    return out, time.perf_counter() - t0


def write_delta(path: str, prepared: dict) -> int:
    entries = [(n, "U8", (len(f),), f) for n, (f, _) in sorted(prepared.items()) if f is not None]
    meta = {n: d for n, (f, d) in prepared.items() if f is not None}
    return write_file(path, iter_file_chunks(entries, meta))


def apply(local_file: str, delta_files: list[str], workers: int) -> float:
    """Apply each delta file in turn (each version verified), in place; returns seconds."""
    t0 = time.perf_counter()
    local = read_header(local_file)
    fh = open(local_file, "r+b")
    mm = mmap.mmap(fh.fileno(), 0)
    try:
        with ThreadPoolExecutor(workers) as pool:
            for path in delta_files:
                hdr = read_header(path)
                with open(path, "rb") as df:
                    dm = mmap.mmap(df.fileno(), 0, access=mmap.ACCESS_READ)
                    view = memoryview(dm)

                    def one(name: str) -> str | None:
                        e = hdr.tensors[name]
                        t = local.tensors[name]
                        region = np.ndarray((t.nbytes,), np.uint8, buffer=mm, offset=t.offset)
                        reader = _tls.dctx.stream_reader(view[e.offset : e.offset + e.nbytes])
                        h = xxhash.xxh3_128()
                        pos = 0
                        while pos < t.nbytes:
                            k = min(BLOCK, t.nbytes - pos)
                            blk = _tls.block[:k]
                            got = 0
                            while got < k:
                                r = reader.readinto(memoryview(blk)[got:])
                                if not r:
                                    raise ValueError(f"{name}: frame ended early")
                                got += r
                            dst = region[pos : pos + k]
                            np.bitwise_xor(dst, blk, out=dst)
                            h.update(dst)
                            pos += k
                        reader.close()
                        del region
                        return None if h.hexdigest() == hdr.metadata[name] else name

                    names = sorted(hdr.tensors, key=lambda n: -hdr.tensors[n].nbytes)
                    bad = [b for b in pool.map(one, names) if b]
                    del view
                    dm.close()
                if bad:
                    raise ValueError(f"baseline verify failed for {bad[:3]}")
        mm.flush()
        os.fsync(fh.fileno())
    finally:
        mm.close()
        fh.close()
    return time.perf_counter() - t0
