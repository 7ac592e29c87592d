"""A static HTTP origin with ``Range`` support (single ranges), keep-alive, and a log of what it
served: the source dir of the fleet benchmark and of the HTTP source's tests.

Python's ``http.server`` ignores ``Range``; this one answers ``bytes=a-b`` with 206 and a
``Content-Range``, and streams bodies in 1 MiB writes so a rate-limited link paces it.

    python -m benchmarks.fleet.origin DIR --bind 10.77.0.1 --port 8000 [--log FILE] [--throttle N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class OriginServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str, addr: tuple[str, int], log_path: "str | None" = None):
        self.root = os.path.realpath(root)
        self.log_path = log_path
        self.served: list[tuple[str, str, int]] = []  # (method, path, body bytes)
        self.throttle = 0  # the next this-many requests for a payload file get 503 SlowDown (a test's fault)
        self.lock = threading.Lock()
        super().__init__(addr, _Handler)

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def record(self, method: str, path: str, n: int) -> None:
        with self.lock:
            self.served.append((method, path, n))
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps([method, path, n]) + "\n")

    def bytes_served(self, suffix: str = "") -> int:
        with self.lock:
            return sum(n for m, p, n in self.served if p.endswith(suffix))

    def start_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="fleet-origin", daemon=True)
        t.start()
        return t


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OriginServer

    def log_message(self, fmt, *args):  # quiet: the server keeps its own record
        pass

    def _file(self) -> "str | None":
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        full = os.path.realpath(os.path.join(self.server.root, path.lstrip("/")))
        if not full.startswith(self.server.root + os.sep) or not os.path.isfile(full):
            return None
        return full

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head: bool):
        with self.server.lock:
            throttled = self.server.throttle > 0 and self.path.endswith(".safetensors")
            if throttled:
                self.server.throttle -= 1
        if throttled:
            body = b"SlowDown"
            self.send_response(503)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.server.record(self.command, self.path + " 503", 0)
            return
        full = self._file()
        if full is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.server.record(self.command, self.path, 0)
            return
        size = os.path.getsize(full)
        start, end = 0, size  # [start, end)
        status = 200
        m = _RANGE.match(self.headers.get("Range", "").strip())
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                start, end = max(0, size - int(m.group(2))), size
            if start >= size or start >= end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if head:
            self.server.record("HEAD", self.path, 0)
            return
        sent = 0
        with open(full, "rb") as f:
            f.seek(start)
            while sent < end - start:
                chunk = f.read(min(1 << 20, end - start - sent))
                if not chunk:
                    break
                self.wfile.write(chunk)
                sent += len(chunk)
        self.server.record("GET", self.path, sent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log", default=None, help="append one JSON line per request: [method, path, bytes]")
    ap.add_argument("--throttle", type=int, default=0, help="answer 503 SlowDown to the first N payload requests")
    a = ap.parse_args()
    server = OriginServer(a.root, (a.bind, a.port), a.log)
    server.throttle = a.throttle
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
