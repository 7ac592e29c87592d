"""The source interface and its two implementations: a directory and a bucket.

The operations are the few the bucket paths need, named after what they do, so the mirror
(pull) and the upload (publish) never ask which kind of source they hold:

- ``list(prefix)``: every object under a prefix, with its size and a change tag (ETag, or
  the file's size and mtime for a directory);
- ``read(key)``: a small object (an index, the run file) whole;
- ``fetch(obj, dst)``: a whole object into a host-local file, checked for its tag and length;
- ``put_file(key, path)``: a file to a key (multipart above a size, for a bucket);
- ``create(key, data)``: a small object only if absent (``If-None-Match: *``); False when
  something is there already;
- ``delete(keys)``: in bulk.

Errors: a missing key raises ``FileNotFoundError`` (the pull's "not ready"); a bucket maps its
client's errors to the typed ones in ``weightsync.errors`` (``client.typed_error``).
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Protocol

import msgspec

from ..errors import BucketUnavailableError, SourceChangedError, SourceNotReadyError
from ..fsio import write_bytes
from .client import (
    FETCH_IN_FLIGHT,
    FETCH_RANGE_NBYTES,
    PUT_CHUNK_NBYTES,
    PUT_CONCURRENCY,
    TRANSIENT,
    Deadline,
    object_gone,
    open_store,
    same_etag,
    typed_error,
)
from .signed_get import Connections, SignedRanges
from .url import BucketURL, parse_bucket_url

Progress = Callable[[int, int], None]
CHUNK_NBYTES = 256 << 10  # a streamed body is written in chunks of about this size (cache-sized: measured
# on loopback, 256 KiB took ~0.9 client CPU-s/GB against ~1.2 for 4 MiB: the bytes stay in cache from
# the receive to the pwrite)


class ObjectInfo(msgspec.Struct, frozen=True):
    key: str  # relative to the source's root
    size: int
    tag: str  # ETag (bucket) or "size:mtime_ns" (directory): what "unchanged" is checked against


class Source(Protocol):
    name: str

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]: ...

    def read(self, key: str) -> bytes: ...

    def fetch(self, obj: ObjectInfo, dst: str, progress: "Progress | None" = None) -> int: ...

    def put_file(self, key: str, path: str) -> int: ...

    def create(self, key: str, data: bytes) -> bool: ...

    def delete(self, keys: Iterable[str]) -> None: ...


class DirectorySource:
    """A directory as a source (the same keys as a bucket's, '/' separated)."""

    def __init__(self, root: str):
        self.root = root
        self.name = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                p = os.path.join(dirpath, f)
                key = os.path.relpath(p, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    st = os.stat(p)
                    out[key] = ObjectInfo(key, st.st_size, f"{st.st_size}:{st.st_mtime_ns}")
        return out

    def read(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def fetch(self, obj: ObjectInfo, dst: str, progress: "Progress | None" = None) -> int:
        from ..fsio import copy_file

        got = copy_file(self._path(obj.key), dst)
        if got != obj.size:
            raise SourceChangedError(self.root, obj.key, f" ({got} bytes, listed {obj.size})")
        if progress is not None:
            progress(got, got)
        return got

    def put_file(self, key: str, path: str) -> int:
        from ..fsio import copy_file

        os.makedirs(os.path.dirname(self._path(key)), exist_ok=True)
        return copy_file(path, self._path(key))

    def create(self, key: str, data: bytes) -> bool:
        p = self._path(key)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def delete(self, keys: Iterable[str]) -> None:
        for k in keys:
            try:
                os.unlink(self._path(k))
            except FileNotFoundError:
                pass


class BucketSource:
    """A bucket prefix as a source, through obstore. Every call is bounded by ``deadline_s``:
    the client retries 5xx, throttling, timeouts and dropped connections with backoff, and a
    fetch re-requests a range that failed or came back short until the deadline."""

    def __init__(self, url: "str | BucketURL"):
        self.url = url if isinstance(url, BucketURL) else parse_bucket_url(url)
        self.name = str(self.url)
        self.store = open_store(self.url)
        self._signed: "SignedRanges | None" = None
        self._signed_decided = False  # at the first fetch: an unused source signs nothing

    # --- small objects ------------------------------------------------------------------

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        import obstore

        try:
            out: dict[str, ObjectInfo] = {}
            for batch in obstore.list(self.store, prefix=prefix or None, chunk_size=1000):
                for m in batch:
                    out[m["path"]] = ObjectInfo(m["path"], int(m["size"]), m.get("e_tag") or "")
            return out
        except Exception as e:
            raise typed_error(e, self.url, f"LIST {prefix or '/'}") from e

    def read(self, key: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self.store, key).bytes())
        except FileNotFoundError:
            raise
        except Exception as e:
            raise typed_error(e, self.url, f"GET {key}") from e

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (fewer if it is shorter): a shard's header."""
        import obstore

        try:
            return bytes(obstore.get_range(self.store, key, start=start, end=end))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise typed_error(e, self.url, f"GET {key} bytes {start}-{end}") from e

    def create(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self.store, key, data, mode="create")
            return True
        except (AlreadyExistsError, PreconditionError):
            return False
        except Exception as e:
            raise typed_error(e, self.url, f"PUT {key} (If-None-Match: *)") from e

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        """A small object whole, and its ETag (what ``replace`` is conditioned on)."""
        import obstore

        try:
            res = obstore.get(self.store, key)
            return bytes(res.bytes()), str(res.meta.get("e_tag") or "")
        except FileNotFoundError:
            raise
        except Exception as e:
            raise typed_error(e, self.url, f"GET {key}") from e

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        """A small object replaced only if its ETag is still ``tag`` (``If-Match``); False when
        another writer changed it since it was read."""
        import obstore
        from obstore.exceptions import PreconditionError

        try:
            obstore.put(self.store, key, data, mode={"e_tag": tag})  # type: ignore[typeddict-item]
            return True
        except (PreconditionError, FileNotFoundError):
            return False
        except Exception as e:
            raise typed_error(e, self.url, f"PUT {key} (If-Match: {tag})") from e

    def delete(self, keys: Iterable[str]) -> None:
        import obstore

        keys = list(keys)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            batch = keys[i:i + 1000]
            try:
                obstore.delete(self.store, batch)
            except FileNotFoundError:
                # Azure's bulk delete stops at a key already gone (S3's ignores it): the batch's
                # keys still there, found by one LIST, are deleted again; one by one if that races.
                there = set(self.list(os.path.commonprefix(batch).rsplit("/", 1)[0] if "/" in os.path.commonprefix(batch) else ""))
                left = [k for k in batch if k in there]
                try:
                    if left:
                        obstore.delete(self.store, left)
                except FileNotFoundError:
                    for key in left:
                        try:
                            obstore.delete(self.store, key)
                        except FileNotFoundError:
                            pass
                        except Exception as e:
                            raise typed_error(e, self.url, f"DELETE {key}") from e
                except Exception as e:
                    raise typed_error(e, self.url, f"DELETE {len(left)} key(s)") from e
            except Exception as e:
                raise typed_error(e, self.url, f"DELETE {len(keys)} key(s)") from e

    def put_file(self, key: str, path: str) -> int:
        """A file to ``key``: one PUT when small, else multipart (parts of PUT_CHUNK_NBYTES, a
        few in flight). An upload that fails leaves no object under ``key``."""
        import obstore

        size = os.path.getsize(path)
        try:
            # A Path: the client reads the file itself, outside the GIL.
            obstore.put(self.store, key, pathlib.Path(path), chunk_size=int(PUT_CHUNK_NBYTES.get()),
                        max_concurrency=int(PUT_CONCURRENCY.get()))
        except Exception as e:
            raise typed_error(e, self.url, f"PUT {key}") from e
        return size

    # --- whole objects into local files -------------------------------------------------

    def fetch(self, obj: ObjectInfo, dst: str, progress: "Progress | None" = None, deadline: "Deadline | None" = None) -> int:
        """``obj`` into ``dst`` (created or truncated): ranged GETs of FETCH_RANGE_NBYTES, up to
        FETCH_IN_FLIGHT at once, each with ``If-Match: <ETag>``, their bodies streamed in chunks
        and written with pwrite at their offsets (memory: in flight x one chunk, never a whole
        range or object). A range that breaks or comes back short (the server gone, a dropped
        connection) is asked again from where it stopped until the deadline, then
        ``BucketUnavailableError``; a changed object raises ``SourceChangedError``. Returns only
        once every byte of every range was written: never over partial bytes."""
        deadline = deadline or Deadline.from_knob()
        if not self._signed_decided:
            self._signed = SignedRanges.for_store(self.store, self.url)
            self._signed_decided = True
        rng = int(FETCH_RANGE_NBYTES.get())
        ranges = [(s, min(s + rng, obj.size)) for s in range(0, obj.size, rng)]
        done_lock = threading.Lock()
        done = [0]

        def wrote(n: int) -> None:
            with done_lock:
                done[0] += n
                if progress is not None:
                    progress(done[0], obj.size)

        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        conns = Connections()  # the signed path's kept-alive connections, closed when this object is done
        try:
            if obj.size:
                os.ftruncate(fd, obj.size)
            workers = max(1, min(int(FETCH_IN_FLIGHT.get()), len(ranges)))
            if workers == 1:
                for r in ranges:
                    self._fetch_range(fd, obj, r, deadline, wrote, conns)
            else:
                with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-fetch") as pool:
                    for f in [pool.submit(self._fetch_range, fd, obj, r, deadline, wrote, conns) for r in ranges]:
                        f.result()
        finally:
            conns.close()
            os.close(fd)
        if done[0] != obj.size:  # cannot happen: every range returns only when complete
            raise BucketUnavailableError(self.name, f"GET {obj.key}", f"{done[0]} of {obj.size} bytes written")
        return obj.size

    def _fetch_range(self, fd: int, obj: ObjectInfo, r: tuple[int, int], deadline: Deadline, wrote,
                     conns: Connections) -> None:
        """Range ``r`` of ``obj`` into ``fd``: asked again from where it stopped, with backoff,
        until it is whole or the deadline passes. Each attempt (signed, or obstore's stream)
        returns where its bytes stop and why, or raises a typed error no retry changes."""
        pos, end = r
        backoff = 0.1
        while True:
            if self._signed is not None:
                pos, why = self._signed.read_range(obj.key, obj.size, obj.tag, pos, end, fd, wrote, deadline, conns)
            else:
                pos, why = self._stream_range(fd, obj, pos, end, wrote)
            if pos >= end:
                return
            if deadline.expired():
                raise BucketUnavailableError(self.name, f"GET {obj.key}", f"{why}; gave up after {deadline.limit_s:.0f}s")
            time.sleep(min(backoff, max(0.0, deadline.left())))
            backoff = min(backoff * 2, 5.0)

    def _stream_range(self, fd: int, obj: ObjectInfo, pos: int, end: int, wrote) -> tuple[int, str]:
        """One attempt at bytes ``[pos, end)`` through obstore's stream: (where they stop, why)."""
        import obstore
        from obstore.exceptions import PreconditionError

        opts: dict = {"range": (pos, end)}
        if obj.tag:
            opts["if_match"] = obj.tag
        try:
            res = obstore.get(self.store, obj.key, options=opts)  # type: ignore[arg-type]
            tag = res.meta.get("e_tag")
            if obj.tag and tag and not same_etag(tag, obj.tag):
                raise SourceChangedError(self.name, obj.key, f" (ETag {tag}, planned {obj.tag})")
            if res.meta.get("size") is not None and int(res.meta["size"]) != obj.size:
                raise SourceChangedError(self.name, obj.key, f" (now {res.meta['size']} bytes, listed {obj.size})")
            for chunk in res.stream(min_chunk_size=CHUNK_NBYTES):
                view = memoryview(chunk)
                if len(view) > end - pos:
                    raise SourceChangedError(self.name, obj.key, f" (a body longer than the range ending at {end})")
                off = 0
                while off < len(view):
                    off += os.pwrite(fd, view[off:], pos + off)
                pos += len(view)
                wrote(len(view))
            return pos, "" if pos >= end else f"a short body: the range stopped at {pos} of {end}"
        except SourceNotReadyError:  # our own typed answer (changed): as it is
            raise
        except PreconditionError:
            raise SourceChangedError(self.name, obj.key) from None
        except FileNotFoundError:
            raise object_gone(self.name, obj.key) from None
        except Exception as e:
            typed = typed_error(e, self.url, f"GET {obj.key} bytes {pos}-{end}")
            if not isinstance(typed, TRANSIENT):
                raise typed from e
            return pos, str(e).splitlines()[0][:300]


def open_source(root: str) -> "Source":
    """A bucket URL or a directory, as a ``Source``."""
    from .url import is_bucket_url

    return BucketSource(root) if is_bucket_url(root) else DirectorySource(root)


def write_local(path: str, data: bytes) -> None:
    """A small file of a mirror or a staging copy (temp name, rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_bytes(path, data)
