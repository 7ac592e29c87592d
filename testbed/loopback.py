"""What the testbed's real loopback servers and fault proxies share.

- ``free_ports``: free 127.0.0.1 ports (and, for ``weed mini``, their gRPC twins);
- ``find_executable``: a server's binary, from an explicit variable, the project's install or PATH;
- ``ServerProcess``: a server binary run in its own session with a log file, waited for until it
  answers, killed (a crash) or stopped (SIGTERM, then SIGKILL) by its process group. A subclass
  (``s3_server.S3Server``, ``azurite_server.AzuriteServer``, ``gcs_server.GcsServer``) gives the
  command line, the environment and ``answers()``;
- ``LoopbackProxy``: a TCP proxy on a free 127.0.0.1 port in front of one of those servers, one
  request per connection, that lets a subclass decide per request to answer in the server's
  place or to cut the answer short (``s3_server.ThrottlingProxy``, ``cutting_proxy.CuttingProxy``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time


def find_executable(name: str, candidates: "list[str]", env_var: str | None = None) -> str | None:
    """``$env_var`` where it names an executable, else the first executable of ``candidates`` (the
    project-local installs), else ``name`` on PATH; None when none is there."""
    explicit = os.environ.get(env_var) if env_var else None
    for path in ([explicit] if explicit else []) + candidates:
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def free_ports(n: int, twin_offset: int | None = None) -> list[int]:
    """``n`` distinct free 127.0.0.1 ports. With ``twin_offset``, each port p also has p + twin_offset
    free (``weed mini`` binds every service's gRPC on its port + 10000)."""
    ports: list[int] = []
    socks: list[socket.socket] = []
    try:
        # Held open until all are found, so the same port is not handed out twice.
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            if p in ports or (twin_offset is not None and p + twin_offset > 65535):
                s.close()
                continue
            socks.append(s)
            if twin_offset is not None:
                t = socket.socket()
                try:
                    t.bind(("127.0.0.1", p + twin_offset))
                except OSError:
                    socks.remove(s)
                    s.close()
                    t.close()
                    continue
                socks.append(t)
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


class ServerProcess:
    """One server process of the testbed. A subclass sets ``NAME`` (in the errors), ``MISSING`` (the
    error when its binary is not installed), ``URL_ROOT`` and ``find_binary``, and gives
    ``command()``, ``answers()`` and, where the server needs more than this process's
    environment, ``server_env()``. Its ``__init__(root, binary)`` chooses the ports and calls
    this one's."""

    NAME = "server"
    MISSING = "the server's binary is not installed: run scripts/setup_env.sh"
    # What "answers" means, for the timeout's message (" S3": the S3 API, not only the process).
    WAITS_FOR = ""
    START_TIMEOUT_S = 60.0
    POLL_S = 0.2
    # The store's URL for the client, up to the prefix: "s3://wsync", "az://wsync", "gs://wsync".
    URL_ROOT = ""

    def __init__(self, root: str, log_path: str):
        self.root = root
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def find_binary() -> str | None:
        raise NotImplementedError

    @classmethod
    def start(cls, root: str, timeout_s: float | None = None):
        """A server under ``root`` (its data and log), started and answering."""
        binary = cls.find_binary()
        if binary is None:
            raise RuntimeError(cls.MISSING)
        server = cls(root, binary)
        server.restart(timeout_s)
        return server

    def url(self, prefix: str) -> str:
        return f"{self.URL_ROOT}/{prefix.strip('/')}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def server_env(self) -> dict[str, str] | None:
        """The server process's environment; None: this process's."""
        return None

    def answers(self) -> bool:
        """Whether the server is up to serving a test (polled after the start)."""
        raise NotImplementedError

    def restart(self, timeout_s: float | None = None) -> None:
        """Start (again, on the same ports and data) and wait until it answers."""
        if timeout_s is None:
            timeout_s = self.START_TIMEOUT_S
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the server is running")
        log = open(self.log_path, "ab")
        try:
            # Its own session: kill/stop reach every process it forks, and a ^C of the test run
            # does not reach it before the fixture's stop does.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.server_env(), cwd=self.root, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.NAME} exited with {self.proc.returncode}; "
                                   f"see {self.log_path}:\n{self.log_tail()}")
            if self.answers():
                return
            time.sleep(self.POLL_S)
        self.stop()
        raise RuntimeError(f"{self.NAME} did not answer{self.WAITS_FOR} within {timeout_s:.0f}s; "
                           f"see {self.log_path}:\n{self.log_tail()}")

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
                # After the last ")": the command name may hold spaces and parentheses.
                fields = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            return (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_ranged_get(first: bytes, rest: bytes) -> bool:
    return first.startswith(b"GET ") and b"\r\nrange:" in (b"\r\n" + rest.lower())


class LoopbackProxy:
    """A TCP proxy on a free 127.0.0.1 port in front of ``upstream_port``. For each request it
    reads the head, asks ``decide`` (under a lock, so a subclass's counters need none), then
    answers in the server's place, or forwards the request with ``connection: close`` and
    passes the answer back, whole or cut after a number of bytes. Signatures stay valid: the
    client signs for the proxy's host, and the server checks the Host header it receives."""

    THREAD_NAME = "loopback-proxy"

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name=self.THREAD_NAME)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def decide(self, ranged_get: bool) -> tuple[bytes | None, int | None]:
        """(answer, cut_after) for one request: ``answer`` sent in the server's place (then the
        connection closed), else the request forwarded and the server's answer cut (both
        connections closed) after ``cut_after`` bytes, headers included; (None, None): passed
        through whole."""
        return None, None

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        up = None
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            first, _, rest = head.partition(b"\r\n")
            with self._lock:
                answer, cut_after = self.decide(_is_ranged_get(first, rest))
            if answer is not None:
                conn.sendall(answer)
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            # One request per connection (Connection is not a signed header), so every request
            # passes ``decide`` instead of riding a kept-alive connection.
            up.sendall(first + b"\r\nconnection: close\r\n" + rest)
            # The rest of the request (an upload's body) beside the answer.
            threading.Thread(target=_pump, args=(conn, up, None), daemon=True).start()
            _pump(up, conn, cut_after)
        except OSError:
            pass
        finally:
            for s in (conn, up):
                if s is not None:
                    _shut(s)
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pump(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
    """src to dst until either end closes, or until ``limit`` bytes; then both ends shut, so the
    other direction's pump ends too."""
    sent = 0
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            if limit is not None and sent + len(data) >= limit:
                dst.sendall(data[: limit - sent])
                break  # the cut: mid-answer
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass
    finally:
        _shut(src)
        _shut(dst)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
