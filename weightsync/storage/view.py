"""A read-only, host-local view of a bucket prefix for the commands that read a source dir's files
(``weightsync inspect``, ``verify``, ``prune``): they run unchanged on it, as a pull runs on its
mirror (``storage.mirror``).

The view has the bucket's layout, built from one LIST: the run file, every version and anchor
dir (committed or not: pruning judges an index-less dir too), each index and small side file
whole, and each shard as a sparse file of its listed size. What a shard holds in the view is
what the command reads of it, asked for explicitly:

- nothing (the versions table, pruning): a placeholder (``mirror.PLACEHOLDER_MAGIC``), which
  no header parser takes for a header;
- its header (``--tensors``, verify's digests, which deltas carry in their headers): the real
  header bytes, one ranged GET, the payload area left sparse;
- every byte (``--density``, verify against an upstream full version's bytes): a whole fetch,
  checked for its ETag and length.

A header-only shard's payload reads as zeros, so a command never reads payloads from one: the
callers fetch whole every shard whose payload they read (``fetch_whole``).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from typing import Iterable

from ..errors import WeightSyncError
from ..format.layout import INDEX_NAME
from ..fsio import write_bytes
from ..knobs import MAX_HEADER_NBYTES
from .mirror import _DIR_RE, _write_placeholder
from .source import BucketSource, ObjectInfo
from .url import BucketURL, parse_bucket_url

_FIRST_READ_NBYTES = 64 << 10  # most headers fit: one GET each


class BucketView:
    """A bucket prefix viewed as a directory (``root``), removed by ``close``."""

    def __init__(self, url: "str | BucketURL"):
        self.url = url if isinstance(url, BucketURL) else parse_bucket_url(url)
        self.source = BucketSource(self.url)
        self.root = tempfile.mkdtemp(prefix="weightsync-view-")
        self.listing: dict[str, ObjectInfo] = {}

    def __enter__(self) -> "BucketView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def named(self, text: str) -> str:
        """``text`` with the view's paths told as the bucket's URL (what the user named)."""
        return text.replace(self.root, str(self.url))

    @contextmanager
    def errors_named(self):
        """A typed error raised inside names the bucket's URL, not the view's temp dir."""
        try:
            yield self
        except WeightSyncError as e:
            e.args = tuple(self.named(a) if isinstance(a, str) else a for a in e.args)
            raise

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def key_of(self, path: str) -> str:
        return os.path.relpath(os.path.realpath(path), os.path.realpath(self.root)).replace(os.sep, "/")

    def load(self, headers_upto: "int | None" = None) -> "BucketView":
        """One LIST; small files whole, shards as placeholders, or with their real headers in the
        dirs of versions and anchors at or below ``headers_upto``."""
        self.listing = self.source.list()
        for k, o in sorted(self.listing.items()):
            d, _, name = k.partition("/")
            if not name:  # a top-level file: the run file, the writer lease
                if not k.startswith("."):
                    self._write_small(k)
                continue
            m = _DIR_RE.match(d)
            if m is None or "/" in name or name.startswith("."):
                continue
            os.makedirs(os.path.dirname(self.path(k)), exist_ok=True)
            if name == INDEX_NAME or not name.endswith(".safetensors"):
                self._write_small(k)
            elif headers_upto is not None and int(m.group(2)) <= headers_upto:
                self._write_header(o)
            else:
                _write_placeholder(self.path(k), o.size)
        return self

    def fetch_whole(self, keys: Iterable[str]) -> None:
        """These shards' every byte into the view (ranged GETs, ETag and length checked)."""
        for k in sorted(set(keys)):
            o = self.listing.get(k)
            if o is None:
                continue  # not in the bucket: the command finds it missing
            tmp = self.path(k) + ".fetching"
            self.source.fetch(o, tmp)
            os.replace(tmp, self.path(k))

    def fetch_dir(self, directory: str) -> None:
        """Every shard of one version or anchor dir of the view, whole."""
        d = self.key_of(directory)
        self.fetch_whole(k for k in self.listing if k.startswith(d + "/") and k.endswith(".safetensors"))

    def _write_small(self, key: str) -> None:
        try:
            write_bytes(self.path(key), self.source.read(key))
        except FileNotFoundError:
            pass  # deleted since the LIST: absent in the view too

    def _write_header(self, o: ObjectInfo) -> None:
        """The shard's header bytes at offset 0 of a sparse file of its size. A length prefix past
        the header limit or the object is written as is: the parser rejects it, as it would the
        real file's."""
        head = self.source.read_range(o.key, 0, min(o.size, _FIRST_READ_NBYTES)) if o.size else b""
        if len(head) >= 8:
            n = struct.unpack("<Q", head[:8])[0]
            want = 8 + n
            if len(head) < want <= o.size and n <= int(MAX_HEADER_NBYTES.get()):
                head = self.source.read_range(o.key, 0, want)
        fd = os.open(self.path(o.key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head)
            os.ftruncate(fd, o.size)
        finally:
            os.close(fd)

    def delete_dir(self, name: str) -> int:
        """A version or anchor dir deleted from the bucket, index first (it stops being published),
        then its other keys in bulk; the number of keys deleted."""
        index_key = f"{name}/{INDEX_NAME}"
        self.source.delete([index_key])
        rest = sorted(k for k in self.source.list(prefix=f"{name}/") if k != index_key)
        self.source.delete(rest)
        return len(rest) + 1


__all__ = ["BucketView"]
