"""The object-store client (obstore, an optional extra): stores from the environment, deadlines,
and its errors mapped to the typed ones.

Credentials, endpoint and region come only from the environment: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``,
``AWS_ALLOW_HTTP`` (a plain-HTTP endpoint such as a loopback test server), and the
``GOOGLE_*``/``AZURE_*`` ones for ``gs://``/``az://`` (``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_ENDPOINT``, ``AZURE_ALLOW_HTTP``; the emulator's
``AZURE_STORAGE_USE_EMULATOR`` with ``AZURITE_BLOB_STORAGE_URL``; ``GOOGLE_SERVICE_ACCOUNT``,
``GOOGLE_SERVICE_ACCOUNT_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_ALLOW_HTTP``). The
URL names only the bucket and prefix.

Timeouts: obstore's default 30 s *total* request timeout would abort large ranged GETs, so a
request gets ``WEIGHTSYNC_BUCKET_REQUEST_TIMEOUT_S`` (ranges are sized to fit it), and the
client's own retries (5xx, throttling, timeouts, dropped connections; exponential backoff) stop
after ``WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S``, below the operation's deadline.
"""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import timedelta

from ..errors import (
    BucketClientMissingError,
    BucketConfigError,
    BucketCredentialsError,
    BucketRefusedError,
    BucketUnavailableError,
    SourceChangedError,
    SourceNotReadyError,
    WeightSyncError,
)
from ..knobs import Knob
from .url import BucketURL

FETCH_RANGE_NBYTES = Knob("WEIGHTSYNC_BUCKET_RANGE_NBYTES", 32 << 20, "bytes per ranged GET of a bucket pull")
FETCH_IN_FLIGHT = Knob("WEIGHTSYNC_BUCKET_IN_FLIGHT", 8, "ranged GETs in flight per object of a bucket pull")
OBJECTS_IN_FLIGHT = Knob("WEIGHTSYNC_BUCKET_OBJECTS_IN_FLIGHT", 2, "objects fetched or uploaded at once")
PUT_CHUNK_NBYTES = Knob("WEIGHTSYNC_BUCKET_PART_NBYTES", 32 << 20, "multipart part size (and the single-PUT limit)")
PUT_CONCURRENCY = Knob("WEIGHTSYNC_BUCKET_PUT_CONCURRENCY", 4, "parts of one multipart upload in flight")
REQUEST_TIMEOUT_S = Knob("WEIGHTSYNC_BUCKET_REQUEST_TIMEOUT_S", 120, "seconds one request may take in total")
RETRY_TIMEOUT_S = Knob("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", 60, "seconds the client retries one request")
DEADLINE_S = Knob("WEIGHTSYNC_BUCKET_DEADLINE_S", 600, "seconds a bucket fetch or upload may take, retries included")


class Deadline:
    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.end = time.monotonic() + limit_s

    @classmethod
    def from_knob(cls) -> "Deadline":
        return cls(float(DEADLINE_S.get()))

    def left(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


_stores: dict[tuple, object] = {}
_stores_lock = threading.Lock()


# AZURITE_BLOB_STORAGE_URL: the client reads the emulator's endpoint from it directly.
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "AZURITE_")

# Plain HTTP per scheme: the client does not read these itself (its HTTP options come only from
# the code), so a store whose endpoint is http:// (an emulator, a private gateway) needs one.
# AWS_ALLOW_HTTP and ALLOW_HTTP keep applying to every scheme, as before.
_ALLOW_HTTP_VARIABLES = {"s3": (), "gs": ("GOOGLE_ALLOW_HTTP",), "az": ("AZURE_ALLOW_HTTP",)}


def _env_key() -> tuple:
    # A store caches its credentials and timeouts: a changed environment (a rotated key, another
    # request or retry timeout) gets a new one.
    knobs = (REQUEST_TIMEOUT_S.env, RETRY_TIMEOUT_S.env)
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in knobs))


def open_store(url: BucketURL):
    """An obstore store for ``url``'s bucket and prefix, configured from the environment."""
    try:
        from obstore.store import from_url
    except ImportError:
        raise BucketClientMissingError(str(url)) from None
    key = (str(url), os.getpid(), _env_key())  # a tokio runtime does not survive a fork: one store per process
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            client_options: dict = {
                "timeout": f"{int(REQUEST_TIMEOUT_S.get())}s",
                "connect_timeout": "10s",
            }
            if any(_truthy(os.environ.get(n)) for n in ("AWS_ALLOW_HTTP", "ALLOW_HTTP", *_ALLOW_HTTP_VARIABLES.get(url.scheme, ()))):
                client_options["allow_http"] = True
            retry = {
                "max_retries": 10,
                "retry_timeout": timedelta(seconds=float(RETRY_TIMEOUT_S.get())),
                "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2},
            }
            config: dict = {}
            if url.scheme == "s3":
                # SigV4 over the payload costs a SHA-256 of every uploaded byte (~1 CPU-s/GB here);
                # TLS already protects it in transit and the index's digests check every byte at
                # pull time, so over HTTPS the payload goes unsigned (as the AWS SDKs do).
                # WEIGHTSYNC_BUCKET_UNSIGNED_PAYLOAD=0/1 decides either way.
                choice = os.environ.get("WEIGHTSYNC_BUCKET_UNSIGNED_PAYLOAD", "")
                config["unsigned_payload"] = _truthy(choice) if choice else not client_options.get("allow_http", False)
            try:
                store = from_url(str(url), config=config or None, client_options=client_options, retry_config=retry)  # type: ignore[arg-type,call-overload]
            except Exception as e:  # made from the environment alone: nothing a retry changes
                raise BucketConfigError(str(url), str(e).splitlines()[0]) from e
            _stores[key] = store
    return store


def same_etag(a: str, b: str) -> bool:
    """Whether two ETags of one object name the same version. Azure's LIST carries an ETag bare
    (``0x8D...``) where its GET header quotes it (``"0x8D..."``); S3 quotes both. A weak marker
    (``W/``) and the quotes are not part of the version's identity."""
    def bare(t: str) -> str:
        t = t.strip()
        return (t[2:] if t.startswith("W/") else t).strip('"')

    return bare(a) == bare(b)


# S3's refusal codes, then Azure's (a wrong account key or SAS: AuthenticationFailed on Azure,
# AuthorizationFailure on Azurite).
_CREDENTIAL_CODES = (
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AccessDenied", "InvalidToken",
    "AuthenticationFailed", "AuthorizationFailure",
)
_CREDENTIAL_WORDS = _CREDENTIAL_CODES + ("403 Forbidden", "401 Unauthorized", "credential")

# Worth asking again within the deadline (the server gone or busy, a short body).
TRANSIENT = (BucketUnavailableError,)


def typed_error(e: BaseException, url: BucketURL, operation: str) -> WeightSyncError:
    """The typed error for a client failure (the message's first line kept as the detail)."""
    if isinstance(e, WeightSyncError):
        return e
    detail = (str(e).splitlines() or [type(e).__name__])[0][:400]
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - the store could not exist without it
        return BucketUnavailableError(str(url), operation, detail)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or (
        isinstance(e, ox.GenericError) and any(w in str(e) for w in _CREDENTIAL_WORDS)
    ):
        return BucketCredentialsError(str(url), operation,
                                      _credential_detail(str(e)) or _no_credentials_named(url.scheme) or detail)
    if isinstance(e, ox.PreconditionError):
        return SourceChangedError(str(url), operation)
    if isinstance(e, FileNotFoundError):
        return SourceNotReadyError(f"{url}: {operation}: not there ({detail}); retry once it is published")
    status = _refusal_status(str(e))
    if status is not None:
        return BucketRefusedError(str(url), operation, status, _store_message(str(e)) or detail)
    return BucketUnavailableError(str(url), operation, detail)


def object_gone(name: str, key: str) -> SourceNotReadyError:
    """A planned object the store no longer has (a 404 mid-fetch)."""
    return SourceNotReadyError(
        f"{name}/{key} is gone (pruned while the pull was reading it?); nothing local changed. "
        "Retry the pull: it plans from what is published now."
    )


# A 4xx that no retry changes; 408 (timeout) and 429 (throttling) are worth asking again, and
# 401/403/404/409/412 have their own meanings above.
FINAL_4XX = {400, 405, 406, 411, 413, 414, 415, 416, 422, 431, 501}
_STATUS_RE = re.compile(r"status code: (\d{3})")
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,300})</Message>|\"message\"\s*:\s*\"([^\"]{1,300})\"")


def _refusal_status(text: str) -> "int | None":
    m = _STATUS_RE.search(text)
    if m is None:
        return None
    status = int(m.group(1))
    return status if status in FINAL_4XX else None


def _store_message(text: str) -> str:
    m = _MESSAGE_RE.search(text)
    return (m.group(1) or m.group(2)).strip() if m else ""


# The variables that name credentials for each scheme, directly or through a profile, a web
# identity or a container endpoint; with none set the client's last resort is the cloud's
# instance metadata, and its refusal (a metadata URL) would tell a user nothing.
_CREDENTIAL_VARIABLES = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"),
    "gs": ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
           "GOOGLE_SERVICE_ACCOUNT_KEY"),
    "az": ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY",
           "AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_TOKEN", "AZURE_CLIENT_SECRET",
           "AZURE_FEDERATED_TOKEN_FILE", "AZURE_STORAGE_USE_EMULATOR"),
}


def _no_credentials_named(scheme: str) -> str:
    names = _CREDENTIAL_VARIABLES.get(scheme, ())
    if not names or any(os.environ.get(n) for n in names):
        return ""
    return (f"no credentials in the environment (none of {', '.join(names)} is set) and the instance "
            "metadata service gave none")


def _credential_detail(text: str) -> str:
    for code in _CREDENTIAL_CODES:
        if code in text:
            return f"{code} (the store's answer)"
    return ""
