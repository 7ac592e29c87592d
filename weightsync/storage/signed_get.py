"""The bulk path of a bucket pull on S3: ranged GETs through a presigned URL, read by the standard
library's HTTP client into one reused buffer per range and written with ``pwrite``.

Why not obstore's stream for these bytes: it hands every chunk to Python as a new buffer, which
cost ~0.9-1.0 client CPU-s/GB on loopback against ~0.5 for ``http.client`` reading into a reused
buffer (docs/BUCKETS.md, "Pull: the fetch"), and a seed from a full version is nearly all fetch.
obstore still does the rest: credentials from the environment and the signature (SigV4 query
authentication signs the host only, so ``Range`` and ``If-Match`` ride along unsigned, as S3
allows). Where it cannot sign (GCS, Azure, anonymous access), where a proxy is configured for the
endpoint (``http.client`` does not speak to proxies), or with ``WEIGHTSYNC_BUCKET_SIGNED_GET=0``,
the fetch keeps obstore's stream.

One kept-alive connection per fetching thread and host, all closed when the fetch ends:
descriptors stay bounded by the ranges in flight. Every answer is checked as the stream's is: 206 with the planned
``Content-Range`` and ETag, else a typed error; a body cut short returns where it stopped and
the caller asks again from there.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import ssl
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Callable
from urllib.parse import urlsplit

from ..errors import (
    BucketCredentialsError,
    BucketRefusedError,
    BucketUnavailableError,
    SourceChangedError,
    SourceNotReadyError,
)
from ..knobs import Knob
from .client import FINAL_4XX, REQUEST_TIMEOUT_S, Deadline, object_gone, same_etag
from .url import BucketURL

SIGNED_GET = Knob("WEIGHTSYNC_BUCKET_SIGNED_GET", 1,
                  "1: an S3 pull reads bulk ranges through presigned URLs with the standard library; 0: obstore's stream")
BUFFER_NBYTES = 1 << 20  # per range in flight; measured: 256 KiB-4 MiB cost the same CPU, 1 MiB keeps it in cache

_now = time.monotonic  # a name of its own: the test of re-signing moves this clock alone

_CODE_RE = re.compile(rb"<Code>([A-Za-z]+)</Code>")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    if not (proxies.get(scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(host)


class SignedRanges:
    """Presigned ranged GETs of one bucket's objects. ``for_store`` gives None where this path does
    not apply; then the caller reads through obstore."""

    def __init__(self, store, url: BucketURL):
        self.store = store
        self.url = url
        self.name = str(url)
        self._signed: dict[str, tuple[str, float]] = {}  # key -> (URL, monotonic time it is re-signed after)
        self._lock = threading.Lock()

    @classmethod
    def for_store(cls, store, url: BucketURL) -> "SignedRanges | None":
        if url.scheme != "s3" or not SIGNED_GET.get():
            return None
        reader = cls(store, url)
        try:
            probe = reader.signed_url("probe", 60)
        except Exception:  # anonymous access, or credentials the client cannot sign with
            return None
        parts = urlsplit(probe)
        if parts.scheme not in ("http", "https") or not parts.hostname or _proxied(parts.scheme, parts.hostname):
            return None
        with reader._lock:
            reader._signed.clear()
        return reader

    def signed_url(self, key: str, expires_s: float) -> str:
        """One signature per key while it is young: its lifetime covers the fetch's deadline, and
        it is signed again once half of that has passed (a source kept for a later fetch, a
        session token rotated meanwhile)."""
        import obstore

        lifetime = max(60, min(int(expires_s) + 60, 7 * 86400))
        with self._lock:
            got = self._signed.get(key)
            if got is None or _now() > got[1]:
                got = (obstore.sign(self.store, "GET", key, timedelta(seconds=lifetime)), _now() + lifetime / 2)
                self._signed[key] = got
            return got[0]

    def read_range(self, key: str, size: int, tag: str, pos: int, end: int, fd: int,
                   wrote: Callable[[int], None], deadline: Deadline, conns: "Connections") -> tuple[int, str]:
        """Bytes ``[pos, end)`` of ``key`` written at their offsets in ``fd``. Returns where the
        bytes written stop (``end`` when whole) and, when short, why: a body cut short or a transient
        failure (5xx, throttling, a connection refused or dropped, a timeout), for the caller to ask
        again from there. Raises typed errors for the rest: the object changed (412, another ETag,
        size or range), gone (404), credentials (401/403)."""
        parts = urlsplit(self.signed_url(key, deadline.limit_s))
        operation = f"GET {key} bytes {pos}-{end}"
        for attempt in (0, 1):
            conn, reused = conns.get(parts, deadline)
            began, keep = pos, False
            try:
                headers = {"Range": f"bytes={pos}-{end - 1}"}
                if tag:
                    headers["If-Match"] = tag
                conn.request("GET", f"{parts.path}?{parts.query}", headers=headers)
                resp = conn.getresponse()
                if resp.status != 206:
                    self._refuse(resp, key, size, pos, end, operation)
                self._check_answer(resp, key, size, tag, pos, end)
                buf = memoryview(bytearray(min(BUFFER_NBYTES, end - pos)))
                while pos < end:
                    n = resp.readinto(buf[:min(len(buf), end - pos)])
                    if not n:
                        return pos, f"a short body: the range stopped at {pos} of {end}"
                    done = 0
                    while done < n:
                        done += os.pwrite(fd, buf[done:n], pos + done)
                    pos += n
                    wrote(n)
                keep = resp.isclosed() and not resp.will_close  # the whole body read: the connection can serve the next range
                return pos, ""
            except BucketUnavailableError as e:
                return pos, e.detail
            except (SourceChangedError, SourceNotReadyError, BucketCredentialsError, BucketRefusedError):
                raise
            except (OSError, http.client.HTTPException, socket.timeout) as e:
                if reused and pos == began and attempt == 0:
                    continue  # a kept connection the server had closed meanwhile: once more on a fresh one
                return pos, f"{type(e).__name__}: {e}"[:300]
            finally:
                if not keep:
                    conn.close()
        return pos, "no answer on a fresh connection"

    def _check_answer(self, resp, key: str, size: int, tag: str, pos: int, end: int) -> None:
        got_tag = resp.getheader("ETag")
        if tag and got_tag and not same_etag(got_tag, tag):
            raise SourceChangedError(self.name, key, f" (ETag {got_tag}, planned {tag})")
        m = _CONTENT_RANGE_RE.match(resp.getheader("Content-Range") or "")
        if m is None:
            raise SourceChangedError(self.name, key, f" (a 206 without a byte range: {resp.getheader('Content-Range')!r})")
        first, last, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if total != "*" and int(total) != size:
            raise SourceChangedError(self.name, key, f" (now {total} bytes, listed {size})")
        if (first, last) != (pos, end - 1):
            raise SourceChangedError(self.name, key, f" (the store sent bytes {first}-{last} for {pos}-{end - 1})")

    def _refuse(self, resp, key: str, size: int, pos: int, end: int, operation: str) -> None:
        status = resp.status
        body = resp.read(4096) if status >= 400 else b""
        m = _CODE_RE.search(body)
        code = m.group(1).decode() if m else ""
        if status == 412:
            raise SourceChangedError(self.name, key)
        if status == 404:
            raise object_gone(self.name, key)
        if status in (401, 403):
            raise BucketCredentialsError(self.name, operation, f"{code or status} (the store's answer)")
        if status == 416:
            raise SourceChangedError(self.name, key, f" (the store has fewer than {end} bytes, listed {size})")
        if status == 200:
            # A server that ignores Range sends the whole object: never taken for the range.
            raise BucketUnavailableError(self.name, operation, "the store ignored the Range header (HTTP 200)")
        if status in FINAL_4XX:
            raise BucketRefusedError(self.name, operation, status, code or resp.reason)
        raise BucketUnavailableError(self.name, operation, f"HTTP {status} {code or resp.reason}".strip())


class Connections:
    """The connections of one fetch: one kept alive per thread and host (a TLS handshake per
    32 MiB range would cost a real store several percent), every one listed so ``close`` ends
    them all when the fetch is done. Descriptors: at most the fetch's threads x hosts."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._open: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get(self, parts, deadline: Deadline) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``parts``' host (made when there is none), and whether it
        is open from an earlier range (the server may have closed it since)."""
        timeout = max(1.0, min(float(REQUEST_TIMEOUT_S.get()), deadline.left()))
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((parts.scheme, parts.netloc))
        reused = conn is not None and conn.sock is not None
        if conn is None:
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(parts.netloc, timeout=timeout, context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
            conns[(parts.scheme, parts.netloc)] = conn
            with self._lock:
                self._open.append(conn)
        conn.timeout = timeout  # a closed connection reconnects on its next request, with this
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, reused

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            conn.close()

    def open_count(self) -> int:
        """Connections with a socket now (for the tests of the bound)."""
        with self._lock:
            return sum(1 for c in self._open if c.sock is not None)


__all__ = ["SignedRanges", "Connections", "SIGNED_GET"]
