"""A real Azure Blob server on loopback for the tests: Microsoft's emulator, Azurite (its blob
service only, ``azurite-blob``).

Azurite is a Node package; ``scripts/setup_env.sh`` installs it into ``.venv/azurite`` (npm,
project-local). The server binds 127.0.0.1 on a port chosen free at start, keeps its data under
its own dir (so a restart finds the blobs again), has telemetry off, and checks Shared Key
signatures: a client with another account key gets the real 403. The container is created at
start (Azure has no implicit containers).

    with AzuriteServer.start(tmp) as az:
        env = az.env()              # AZURE_* variables for the client
        url = az.url("run1")        # az://wsync/run1
        az.settle()                 # written so far: saved (a kill loses the last seconds')
        az.kill(); az.restart()
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import os
import sys

from .loopback import ServerProcess, find_executable, free_ports

# Azurite's built-in account and its documented key (public: every Azure SDK ships it for the
# emulator). obstore's emulator mode (AZURE_STORAGE_USE_EMULATOR) assumes exactly these.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "wsync"
API_VERSION = "2021-08-06"

# Azure's answer to a throttled request (503, its code in the body and in x-ms-error-code), as
# (reason, body, headers) for testbed.s3_server.ThrottlingProxy's ``answer``.
SERVER_BUSY = (
    "Server Busy",
    b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code><Message>The server is currently '
    b"unable to receive requests. Please retry your request.</Message></Error>",
    {"Content-Type": "application/xml", "x-ms-error-code": "ServerBusy"},
)


def azurite_binary() -> str | None:
    """``azurite-blob`` from the project-local npm prefix (``.venv/azurite``), ``$WEIGHTSYNC_AZURITE``,
    or PATH."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    return find_executable("azurite-blob", [os.path.join(venv, "azurite", "node_modules", ".bin", "azurite-blob")],
                           env_var="WEIGHTSYNC_AZURITE")


def shared_key_request(port: int, method: str, path: str, query: dict[str, str], key: str = ACCOUNT_KEY,
                       timeout_s: float = 5.0) -> tuple[int, bytes]:
    """One bodyless request signed with Shared Key, for what obstore has no call for (creating the
    container). Path-style addressing: the canonical resource names the account twice, once as
    the signer and once as the URL's first segment."""
    date = email.utils.formatdate(usegmt=True)
    headers = {"x-ms-date": date, "x-ms-version": API_VERSION}
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    canonical_resource = f"/{ACCOUNT}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
    # VERB, then 11 standard headers all empty here (a zero Content-Length is written as empty).
    string_to_sign = f"{method}\n" + "\n" * 11 + canonical_headers + canonical_resource
    mac = hmac.new(base64.b64decode(key), string_to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
    headers["Content-Length"] = "0"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        conn.request(method, path + (f"?{qs}" if qs else ""), body=b"", headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class AzuriteServer(ServerProcess):
    NAME = "azurite"
    URL_ROOT = f"az://{CONTAINER}"
    find_binary = staticmethod(azurite_binary)
    MISSING = "no `azurite-blob`: run scripts/setup_env.sh (it installs azurite into .venv/azurite)"

    def __init__(self, root: str, binary: str):
        super().__init__(root, os.path.join(root, "azurite.log"))
        self.binary = binary
        self.data = os.path.join(root, "data")
        os.makedirs(self.data, exist_ok=True)
        self.port = free_ports(1)[0]

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint, path-style (the emulator serves every account on one host)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def endpoint_at(self, port: int) -> str:
        """The account's endpoint on another loopback port (a proxy in front of this server): the
        Shared Key signature names the account and path, not the host, so it stays valid."""
        return f"http://127.0.0.1:{port}/{ACCOUNT}"

    def env(self, **overrides: str) -> dict[str, str]:
        """The variables a user of a real account sets (account, key, endpoint), plus plain HTTP:
        the client signs as it does for Azure itself; only the endpoint differs."""
        env = {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY,
            "AZURE_STORAGE_ENDPOINT": self.endpoint,
            "AZURE_ALLOW_HTTP": "true",
        }
        env.update(overrides)
        return env

    def emulator_env(self, **overrides: str) -> dict[str, str]:
        """obstore's emulator mode: the well-known account and key, the endpoint from
        ``AZURITE_BLOB_STORAGE_URL`` (emulator mode ignores ``AZURE_STORAGE_ENDPOINT``)."""
        env = {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": f"http://127.0.0.1:{self.port}"}
        env.update(overrides)
        return env

    def command(self) -> list[str]:
        return [
            self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self.data,
            "--disableTelemetry", "--silent",
            # obstore may speak a newer API version than this Azurite knows; the calls it makes are old ones.
            "--skipApiVersionCheck",
        ]

    def answers(self) -> bool:
        # Up once the container exists (Azure has no implicit containers): created now, or there
        # from before a restart.
        return self._create_container() in (201, 409)

    def _create_container(self) -> int:
        try:
            status, _ = shared_key_request(self.port, "PUT", f"/{ACCOUNT}/{CONTAINER}", {"restype": "container"}, timeout_s=2)
            return status
        except OSError:
            return 0

    def kill(self) -> None:
        """SIGKILL the whole server. Not a durable crash as for ``weed mini``: Azurite saves its
        blob metadata on an interval, so blobs written in the last seconds are gone after
        ``restart`` (``stop`` saves them)."""
        super().kill()

    def settle(self, timeout_s: float = 60.0) -> None:
        """Stop gracefully and start again on the same port and data: what was written so far is
        saved (Azurite saves its metadata on close, else only every 5 s), so a ``kill`` after
        this loses nothing written before it."""
        self.stop()
        self.restart(timeout_s)
