"""A loopback proxy in front of an HTTP server that cuts the first ``cut`` ranged GET answers
after ``after`` bytes (headers included) by closing both connections: a body cut short, as a
dropped connection or a restarted load balancer gives. Everything else passes through, one
request per connection. Signatures stay valid: the client signs for the proxy's host, and the
server checks the Host header it receives (as ``s3_server.ThrottlingProxy``).

    with CuttingProxy(upstream_port, cut=3, after=5000) as proxy:
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
"""

from __future__ import annotations

import socket
import threading


class CuttingProxy:
    def __init__(self, upstream_port: int, cut: int, after: int):
        self.upstream_port = upstream_port
        self.cut = cut
        self.after = after
        self.cuts = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="cutting-proxy")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
            is_ranged_get = first.startswith(b"GET ") and b"\r\nrange:" in (b"\r\n" + rest.lower())
            with self._lock:
                limit = self.after if is_ranged_get and self.cuts < self.cut else None
                if limit is not None:
                    self.cuts += 1
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            up.sendall(first + b"\r\nconnection: close\r\n" + rest)
            sent = 0
            while True:
                data = up.recv(1 << 16)
                if not data:
                    break
                if limit is not None and sent + len(data) >= limit:
                    conn.sendall(data[: limit - sent])
                    break  # the cut: both ends closed below, mid-body
                conn.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (conn, up):
                if s is not None:
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()

    def __enter__(self) -> "CuttingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
