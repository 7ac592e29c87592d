"""A read-only HTTP(S) source: a run dir served by any static server, or by a caching tier
(nginx ``proxy_cache``, a CDN) in front of the trainer's dir or bucket. docs/FLEET.md.

``pull(local, seed, "http://cache:8080/runs/r1", v)`` pulls as a source dir does, through the
same host-local mirror as a bucket (``storage.mirror``): the objects the plan reads are fetched
into local files with ranged GETs, then today's pull (plan, seed, apply, verification) runs on
them unchanged.

What makes it safe behind a cache:

- version paths are immutable (FORMAT.md), so a cache may keep a shard for ever;
- the index (the commit point) and the run file are always read from the *origin*:
  ``WEIGHTSYNC_HTTP_ORIGIN`` (``http://origin:8000``: the source URL's scheme and host are
  replaced by it, its path kept), from the operator's environment, never from a request. Without
  it the source URL is the origin, and those reads carry ``Cache-Control: no-cache`` (the nginx
  template never caches ``*.index.json`` nor the run file);
- every payload file is checked against its index's ``file_digests`` (size and xxh3-128,
  ``format.file_digests``) before its bytes are used; a copy that is stale, torn or cut short
  is fetched again from the origin, never applied. A file the index gives no digest for (an
  upstream writer's, an older publisher's) is read from the origin only: a cache cannot be
  checked for it. The per-tensor digests stay the end-to-end proof either way.

No listing: a static server has none, so ``list`` walks the versions down from the target
(one index read per version, as the planner walks) to the local version, a full version or v1,
and probes each one's side anchor.

Client: ``http.client`` from the standard library, one keep-alive connection per thread and
host. Why not obstore's HTTP store: the core must reach a plain web server without the bucket
extra, and the source needs exact control of each request (``Range``, ``Cache-Control``, which
host) and of each answer (206 and its ``Content-Range`` against the planned size).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable
from urllib.parse import quote

import msgspec
import xxhash

from ..errors import (
    BucketUnavailableError,
    HttpSourceUnavailableError,
    HttpSourceURLError,
    MalformedHeaderError,
    PayloadFileMismatchError,
    SourceChangedError,
    SourceNotReadyError,
)
from ..format.file_digests import FileDigest, read_file_digests
from ..format.layout import INDEX_NAME, RUN_NAME, anchor_dir_name, version_dir_name
from ..knobs import MAX_INDEX_NBYTES, Knob
from .client import Deadline
from .source import ObjectInfo

log = logging.getLogger(__name__)

ORIGIN_ENV = "WEIGHTSYNC_HTTP_ORIGIN"
HTTP_RANGE_NBYTES = Knob("WEIGHTSYNC_HTTP_RANGE_NBYTES", 16 << 20, "bytes per ranged GET of an HTTP source")
HTTP_IN_FLIGHT = Knob("WEIGHTSYNC_HTTP_IN_FLIGHT", 4, "ranged GETs in flight per object of an HTTP source")
HTTP_CACHE_RETRY_S = Knob("WEIGHTSYNC_HTTP_CACHE_RETRY_S", 5, "seconds a failing cache is asked again before the origin")
HTTP_TIMEOUT_S = Knob("WEIGHTSYNC_HTTP_TIMEOUT_S", 60, "seconds an HTTP source may stay silent on one request")

_URL_RE = re.compile(r"^(https?)://([^/]+)(/.*)?$")
_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+)(:[0-9]{1,5})?$")
NO_CACHE = {"Cache-Control": "no-cache", "Pragma": "no-cache"}


class HttpURL(msgspec.Struct, frozen=True):
    scheme: str
    netloc: str  # host[:port]
    path: str  # "" or "/a/b" (no trailing slash)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.path}"

    def url_of(self, key: str) -> str:
        return f"{self}/{key}"


def is_http_url(value: object) -> bool:
    return isinstance(value, str) and (value.startswith("http://") or value.startswith("https://"))


def parse_http_url(url: str, *, what: str = "source") -> HttpURL:
    """The canonical form of an HTTP(S) source URL; ``HttpSourceURLError`` for anything else."""
    if not isinstance(url, str):
        raise HttpSourceURLError(repr(url), "not a string")
    m = _URL_RE.match(url)
    if m is None:
        raise HttpSourceURLError(url, f"the {what} must start with http:// or https:// and name a host")
    if any(c in url for c in "?#@\\") or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise HttpSourceURLError(url, "a query, fragment, user info, backslash, space or control character is not allowed")
    scheme, netloc, path = m.group(1), m.group(2), m.group(3) or ""
    if not _HOST_RE.match(netloc):
        raise HttpSourceURLError(url, f"{netloc!r} is not a host[:port]")
    inner = path.split("/")[1:] if path else []
    if inner and inner[-1] == "":
        inner = inner[:-1]
    if any(p in ("", ".", "..") for p in inner):
        raise HttpSourceURLError(url, "the path has an empty, '.' or '..' segment")
    return HttpURL(scheme, netloc, "".join("/" + p for p in inner))


def origin_of(url: HttpURL) -> HttpURL:
    """Where the index and checked refetches go: ``WEIGHTSYNC_HTTP_ORIGIN``'s scheme and host
    (and path prefix) with ``url``'s path, else ``url`` itself."""
    raw = os.environ.get(ORIGIN_ENV, "").strip()
    if not raw:
        return url
    base = parse_http_url(raw, what=ORIGIN_ENV)
    return HttpURL(base.scheme, base.netloc, base.path + url.path)


def _monotonic(progress: "Callable[[int, int], None] | None") -> "Callable[[int, int], None] | None":
    """``progress`` told only of bytes beyond what it was told already: a file fetched again
    from the origin after a bad cached copy does not move it backwards."""
    if progress is None:
        return None
    told = [0]

    def report(done: int, total: int) -> None:
        if done > told[0]:
            told[0] = done
            progress(done, total)

    return report


class _Answer(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes


class _Transient(Exception):
    """A failure worth asking again within the deadline (refused, reset, timeout, 5xx, short body)."""


class HttpSource:
    """A run dir over HTTP(S), read-only, with a checked path past any cache to the origin."""

    def __init__(self, url: "str | HttpURL"):
        self.url = url if isinstance(url, HttpURL) else parse_http_url(url)
        self.origin = origin_of(self.url)
        self.name = str(self.url)
        self.target: int | None = None  # the walk's top (set by the pull before the mirror lists)
        self.floor: int | None = None  # the walk stops above this version (the local one)
        self.digests: dict[str, FileDigest] = {}  # key -> what the index records for that file
        self._indexes: dict[str, bytes] = {}  # key -> index bytes read by the last list()
        self._local = threading.local()

    # --- the Source operations the mirror uses ------------------------------------------

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """The committed versions (and side anchors) the pull may read, from the origin's
        indexes: the target, then down while each is a delta, to the local version, a full
        version or v1. Keys: each index and each payload file it names (size and tag from its
        ``file_digests``; a HEAD to the origin for a file without one)."""
        if self.target is None:
            raise ValueError("HttpSource.list needs .target (the version the pull wants)")
        out: dict[str, ObjectInfo] = {}
        self._indexes = {}
        self.digests = {}
        try:
            run = self.read(RUN_NAME)
            out[RUN_NAME] = ObjectInfo(RUN_NAME, len(run), xxhash.xxh3_128_hexdigest(run))
        except FileNotFoundError:
            pass
        v = self.target
        while v >= 1 and (self.floor is None or v > self.floor):
            obj = self._list_dir(version_dir_name(v), out)
            self._list_dir(anchor_dir_name(v), out)
            if obj is None:
                break  # not published (the target: the pull says "not ready"), or pruned below
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            if not isinstance(meta, dict) or "delta_encoding" not in meta:
                break  # a full version: no chain crosses it
            v -= 1
        return {k: o for k, o in out.items() if k.startswith(prefix)}

    def _list_dir(self, d: str, out: dict[str, ObjectInfo]) -> "dict | None":
        key = f"{d}/{INDEX_NAME}"
        try:
            data = self._get(self.origin, key, NO_CACHE, max_body=int(MAX_INDEX_NBYTES.get())).body
        except FileNotFoundError:
            return None
        self._indexes[key] = data
        out[key] = ObjectInfo(key, len(data), xxhash.xxh3_128_hexdigest(data))
        try:
            obj = json.loads(data)
        except ValueError:
            return None  # incomplete or malformed: the planner judges the index itself
        wmap = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(wmap, dict):
            return None
        recorded = read_file_digests(obj)
        for fname in sorted({f for f in wmap.values() if isinstance(f, str)}):
            if "/" in fname or fname in ("", ".", ".."):
                continue  # the planner refuses such a name before opening anything
            k = f"{d}/{fname}"
            fd = recorded.get(fname)
            if fd is not None:
                self.digests[k] = fd
                out[k] = ObjectInfo(k, fd.nbytes, fd.digest)
            else:
                size = self._head_size(k)
                if size is not None:
                    out[k] = ObjectInfo(k, size, f"size:{size}")
        return obj

    def read(self, key: str) -> bytes:
        """A small object (an index, the run file) from the origin, past any cache."""
        if key in self._indexes:
            return self._indexes[key]  # the bytes the listing planned from
        return self._get(self.origin, key, NO_CACHE, max_body=int(MAX_INDEX_NBYTES.get())).body

    def fetch(self, obj: ObjectInfo, dst: str, progress: "Callable[[int, int], None] | None" = None,
              deadline: "Deadline | None" = None) -> int:
        """``obj`` into ``dst``: through the source URL (the cache) when the index records its
        digest, checked; a copy that fails the check (or the size, or the cache's answer) is
        fetched again from the origin and checked again. Never returns over unchecked bytes
        when a digest is recorded."""
        deadline = deadline or Deadline.from_knob()
        try:
            return self._fetch_checked(obj, dst, _monotonic(progress), deadline)
        except FileNotFoundError:
            raise SourceNotReadyError(
                f"{self.origin}/{obj.key} is not on the origin, though its index names it (pruned while the pull "
                "was reading it?); nothing local changed. Retry the pull: it plans from what is published now."
            ) from None

    def _fetch_checked(self, obj: ObjectInfo, dst: str, progress, deadline: Deadline) -> int:
        expected = self.digests.get(obj.key)
        if expected is None:
            log.info("%s: %s has no file digest in its index: read from the origin %s", self.name, obj.key, self.origin)
            return self._fetch_from(self.origin, obj, dst, progress, deadline, NO_CACHE)
        if self.origin != self.url:
            try:
                # A cache that fails is passed over quickly: the origin is the sound path.
                cache_deadline = Deadline(max(0.0, min(float(HTTP_CACHE_RETRY_S.get()), deadline.left())))
                self._fetch_from(self.url, obj, dst, progress, cache_deadline, {})
                why = self._mismatch(dst, expected)
            except (BucketUnavailableError, SourceChangedError, OSError) as e:
                why = f"the cache failed: {str(e).splitlines()[0][:200]}"
            if why is None:
                return obj.size
            log.warning("%s: the cache's copy of %s %s: fetching it from the origin %s", self.name, obj.key, why, self.origin)
        self._fetch_from(self.origin, obj, dst, progress, deadline, NO_CACHE)
        why = self._mismatch(dst, expected)
        if why is not None:
            raise PayloadFileMismatchError(str(self.origin), obj.key,
                                           f"{expected.nbytes} bytes, xxh3-128 {expected.digest}", why)
        return obj.size

    # --- checks -------------------------------------------------------------------------

    @staticmethod
    def _mismatch(path: str, expected: FileDigest) -> str | None:
        from ..format.file_digests import digest_file

        got = digest_file(path)
        if got.nbytes != expected.nbytes:
            return f"is {got.nbytes} bytes, the index records {expected.nbytes}"
        if got.digest != expected.digest:
            return f"hashes to {got.digest}, the index records {expected.digest} (stale or torn)"
        return None

    # --- transfers ----------------------------------------------------------------------

    def _fetch_from(self, base: HttpURL, obj: ObjectInfo, dst: str, progress, deadline: Deadline,
                    headers: dict[str, str]) -> int:
        """Ranged GETs into ``dst`` (created or truncated), each answer checked for its range and
        the object's size. A server that ignores ``Range`` (200) is read whole, once."""
        rng = max(1, int(HTTP_RANGE_NBYTES.get()))
        ranges = [(s, min(s + rng, obj.size)) for s in range(0, obj.size, rng)]
        done = [0]
        lock = threading.Lock()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if obj.size:
                os.ftruncate(fd, obj.size)

            def put(start: int, data: bytes) -> None:
                view = memoryview(data)
                off = 0
                while off < len(view):
                    off += os.pwrite(fd, view[off:], start + off)
                with lock:
                    done[0] += len(view)
                    if progress is not None:
                        progress(done[0], obj.size)

            if not ranges:
                return 0
            first = self._get_range(base, obj, ranges[0], deadline, headers)
            if first is None:  # 200: the whole object came back
                whole = self._get(base, obj.key, headers, deadline=deadline).body
                if len(whole) != obj.size:
                    raise SourceChangedError(str(base), obj.key, f" ({len(whole)} bytes, planned {obj.size})")
                put(0, whole)
                return obj.size
            put(ranges[0][0], first)
            rest = ranges[1:]

            def one(r: tuple[int, int]) -> None:
                data = self._get_range(base, obj, r, deadline, headers)
                if data is None:
                    raise SourceChangedError(str(base), obj.key, " (the server stopped honouring Range mid-object)")
                put(r[0], data)

            workers = max(1, min(int(HTTP_IN_FLIGHT.get()), len(rest)))
            if workers == 1:
                for r in rest:
                    one(r)
            elif rest:
                with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-http") as pool:
                    for f in [pool.submit(one, r) for r in rest]:
                        f.result()
        finally:
            os.close(fd)
        return obj.size

    def _get_range(self, base: HttpURL, obj: ObjectInfo, r: tuple[int, int], deadline: Deadline,
                   headers: dict[str, str]) -> "bytes | None":
        """The bytes of ``r``, or None when the server answered 200 (no ranges)."""
        start, end = r
        h = dict(headers)
        h["Range"] = f"bytes={start}-{end - 1}"
        ans = self._get(base, obj.key, h, deadline=deadline, ok=(200, 206))
        if ans.status == 200:
            return None
        cr = ans.headers.get("content-range", "")
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", cr.strip())
        if m is None or int(m.group(1)) != start or int(m.group(2)) != end - 1:
            raise SourceChangedError(str(base), obj.key, f" (asked bytes {start}-{end - 1}, got Content-Range {cr!r})")
        if m.group(3) != "*" and int(m.group(3)) != obj.size:
            raise SourceChangedError(str(base), obj.key, f" (now {m.group(3)} bytes, planned {obj.size})")
        if len(ans.body) != end - start:
            raise SourceChangedError(str(base), obj.key, f" (a body of {len(ans.body)} bytes for {end - start})")
        return ans.body

    def _head_size(self, key: str) -> int | None:
        try:
            ans = self._get(self.origin, key, NO_CACHE, method="HEAD")
        except FileNotFoundError:
            return None
        n = ans.headers.get("content-length")
        return int(n) if n is not None and n.isdigit() else None

    def _get(self, base: HttpURL, key: str, headers: dict[str, str], *, method: str = "GET",
             deadline: "Deadline | None" = None, ok: tuple[int, ...] = (200,), max_body: "int | None" = None) -> _Answer:
        """One request, asked again on a transient failure until the deadline. 404/410:
        ``FileNotFoundError``; another 4xx: ``HttpSourceUnavailableError`` at once. A body over
        ``max_body`` (an index past the index limit) is refused unread, as a directory refuses
        such an index: ``MalformedHeaderError``."""
        deadline = deadline or Deadline.from_knob()
        path = base.path + "/" + quote(key)
        backoff = 0.1
        while True:
            try:
                ans = self._request(base, method, path, headers, max_body=max_body, name=key)
                if ans.status in (404, 410):
                    raise FileNotFoundError(f"{base}/{key}")
                if ans.status in ok:
                    return ans
                if ans.status >= 500 or ans.status == 429:
                    raise _Transient(f"HTTP {ans.status}")
                raise HttpSourceUnavailableError(str(base), f"{method} {key}", f"HTTP {ans.status} {ans.body[:200]!r}")
            except _Transient as e:
                why = str(e)
            if deadline.expired():
                raise HttpSourceUnavailableError(str(base), f"{method} {key}", f"{why}; gave up after {deadline.limit_s:.0f}s")
            time.sleep(min(backoff, max(0.0, deadline.left())))
            backoff = min(backoff * 2, 2.0)

    def _request(self, base: HttpURL, method: str, path: str, headers: dict[str, str], *,
                 max_body: "int | None" = None, name: str = "") -> _Answer:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (base.scheme, base.netloc)
        conn = conns.get(key)
        if conn is None:
            timeout = float(HTTP_TIMEOUT_S.get())
            if base.scheme == "https":
                conn = http.client.HTTPSConnection(base.netloc, timeout=timeout, context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(base.netloc, timeout=timeout)
            conns[key] = conn
        try:
            conn.request(method, path, headers={"Accept-Encoding": "identity", **headers})
            resp = conn.getresponse()
            if max_body is not None and method != "HEAD" and resp.status == 200:
                length = resp.getheader("Content-Length")
                body = resp.read(max_body + 1) if length is None or not length.isdigit() or int(length) <= max_body else b""
                if len(body) > max_body or (length is not None and length.isdigit() and int(length) > max_body):
                    conn.close()
                    conns.pop(key, None)
                    size = int(length) if length is not None and length.isdigit() else f"more than {max_body}"
                    raise MalformedHeaderError(f"{base}/{name}", f"index is {size} bytes, over the {max_body}-byte limit")
            else:
                body = resp.read() if method != "HEAD" else b""
            out = _Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)
            if resp.will_close:
                conn.close()
                conns.pop(key, None)
            return out
        except (OSError, http.client.HTTPException, socket.timeout) as e:
            conn.close()
            conns.pop(key, None)
            raise _Transient(f"{type(e).__name__}: {e}") from None


__all__ = ["HttpSource", "HttpURL", "is_http_url", "parse_http_url", "origin_of", "ORIGIN_ENV", "NO_CACHE"]
