"""Every error the core raises, in one place.

Three families matter to a caller, because each asks for a different reaction:

- ``SourceNotReadyError``: the published version is not there, or not complete yet. Retry
  later; the local checkpoint was not touched.
- ``LocalStateError``: the host-local checkpoint is torn or corrupt. ``pull`` reseeds once
  and replays on its own; this surfaces only when that did not help.
- ``CorruptArtifactError``: the published artifact itself is bad (checksum mismatch, broken
  header, names that do not match the index). Retrying cannot help: fail loud.

Each class subclasses the stdlib error it refines, carries its data as attributes, and has
an ``error_type`` (a stable machine-readable name) and ``http_status`` (what an HTTP endpoint
answers). Messages say what happened, expected vs actual, and what to do.
"""

from __future__ import annotations

import errno
import os
from typing import Iterable, Sequence

__all__ = [
    "WeightSyncError",
    "InvalidRequestError",
    "BackwardPullError",
    "InvalidKnobError",
    "PathNotAllowedError",
    "UnsupportedMediaTypeError",
    "SourceNotReadyError",
    "VersionMissingError",
    "IndexMissingError",
    "ChainBrokenError",
    "ShardShrunkError",
    "CorruptArtifactError",
    "ChecksumMismatchError",
    "ShardMismatchError",
    "MalformedHeaderError",
    "UnsafeNameError",
    "PayloadBoundError",
    "UnsupportedFormatError",
    "LocalStateError",
    "LocalTensorMismatchError",
    "ConflictError",
    "LockTimeoutError",
    "PullWorkerDiedError",
    "PullInProgressError",
    "PullTimeoutError",
    "EngineUnavailableError",
    "PublishError",
    "OverwriteTooLargeError",
    "ChecksumUnavailableError",
    "CoderUnavailableError",
    "HostResourceError",
    "AnchorUnusableError",
    "VersionAlreadyPublishedError",
    "PendingVersionError",
    "host_resource_error",
    "error_types",
]


class WeightSyncError(Exception):
    """Base class of every error raised by the core."""

    error_type: str = "weight_sync_error"
    http_status: int = 500
    retryable: bool = False


# --- the caller asked for something that cannot be done -------------------------------


class InvalidRequestError(WeightSyncError, ValueError):
    error_type = "bad_request"
    http_status = 400


class BackwardPullError(InvalidRequestError):
    """Deltas only go forward; a lower target needs a reset to version 0 first."""

    def __init__(self, target_version: int, applied_version: int):
        self.target_version = target_version
        self.applied_version = applied_version
        super().__init__(
            f"cannot pull backwards: the local checkpoint is at version {applied_version}, "
            f"the request asks for {target_version}. Deltas only go forward; pull version 0 "
            "to reset to the engine's own model, then pull forward again."
        )


class InvalidKnobError(InvalidRequestError):
    """A tunable (an environment knob or the argument that overrides it) has a value outside
    what it can mean. Nothing was written: fix the value and call again."""

    error_type = "invalid_knob"

    def __init__(self, knob: str, value: object, expected: str):
        self.knob = knob
        self.value = value
        self.expected = expected
        super().__init__(f"{knob}={value!r} is not valid: expected {expected}")


class PathNotAllowedError(InvalidRequestError, PermissionError):
    error_type = "forbidden"
    http_status = 403

    def __init__(self, path: str, allowed_roots: Sequence[str], why: str = ""):
        self.path = path
        self.allowed_roots = list(allowed_roots)
        super().__init__(
            f"path {path!r} is outside the allowed roots {self.allowed_roots}"
            + (f" ({why})" if why else "")
            + ". Ask the operator to add its root to the allowed roots, or use a path below one."
        )


class UnsupportedMediaTypeError(InvalidRequestError):
    """An endpoint body sent as anything but ``application/json``. Refused because a browser
    page may send a ``text/plain`` body cross-site without a preflight."""

    error_type = "unsupported_media_type"
    http_status = 415

    def __init__(self, route: str, content_type: str | None):
        self.route = route
        self.content_type = content_type
        got = repr(content_type) if content_type else "no Content-Type header"
        super().__init__(f"{route} takes a JSON body sent as Content-Type: application/json, got {got}; "
                         "send the body with that header")


# --- the source is not (yet) there: retry later, nothing local was touched -------------


class SourceNotReadyError(WeightSyncError, FileNotFoundError):
    error_type = "source_not_ready"
    http_status = 404
    retryable = True


class VersionMissingError(SourceNotReadyError):
    def __init__(self, version: int, path: str):
        self.version = version
        self.path = path
        super().__init__(
            f"version {version} is not published: {path} does not exist. "
            "The trainer may not have written it yet; retry after it is published."
        )


class IndexMissingError(SourceNotReadyError):
    def __init__(self, version: int, path: str, detail: str = ""):
        self.version = version
        self.path = path
        super().__init__(
            f"version {version} at {path} has no model.safetensors.index.json yet"
            + (f" ({detail})" if detail else "")
            + ". The index is written last, so the version is still being published (or the "
            "shared filesystem has not shown it here yet); retry later."
        )


class ChainBrokenError(SourceNotReadyError):
    def __init__(self, needed_version: int, target_version: int, path: str):
        self.needed_version = needed_version
        self.target_version = target_version
        self.path = path
        super().__init__(
            f"reaching version {target_version} needs version {needed_version}, which is not "
            f"at {path} (pruned, or not visible yet). Publish a full version at or below "
            f"{target_version}, or keep more versions when pruning."
        )


class ShardShrunkError(SourceNotReadyError):
    """A shard became shorter than the bytes the pull checked, while it was being read (read
    with pread, never through a map, so this is an error and not a SIGBUS). The local
    checkpoint's marker was not moved: retry the pull; if the shard stays short, the version
    is damaged and the next pull fails at its header check (republish it)."""

    def __init__(self, path: str, needed_nbytes: int, file_nbytes: int):
        self.path = path
        self.needed_nbytes = needed_nbytes
        self.file_nbytes = file_nbytes
        super().__init__(
            f"shard {path} is now {file_nbytes} bytes, shorter than the {needed_nbytes} the pull checked "
            "(truncated while being read); retry the pull, and republish the version if it stays short"
        )


# --- the published artifact is bad: fail loud, do not retry -----------------------------


class CorruptArtifactError(WeightSyncError, ValueError):
    error_type = "corrupt_artifact"
    http_status = 422


class ChecksumMismatchError(CorruptArtifactError):
    """One or more tensors did not hash to the digest their version promised."""

    def __init__(self, version: int, mismatches: Sequence[tuple[str, str, str]], checksum_format: str):
        self.version = version
        self.mismatches = list(mismatches)  # (tensor name, expected digest, actual digest)
        self.checksum_format = checksum_format
        shown = "; ".join(f"{n}: expected {e}, got {a}" for n, e, a in self.mismatches[:5])
        more = f" (and {len(self.mismatches) - 5} more)" if len(self.mismatches) > 5 else ""
        super().__init__(
            f"version {version}: {len(self.mismatches)} tensor(s) failed {checksum_format} "
            f"verification after a fresh seed: {shown}{more}. The published delta is corrupt; "
            "republish this version (or publish a full version) and pull again."
        )


class ShardMismatchError(CorruptArtifactError):
    def __init__(self, shard: str, missing: Iterable[str], unexpected: Iterable[str]):
        self.shard = shard
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        super().__init__(
            f"shard {shard} does not hold what the index maps to it: missing {self.missing[:5]}, "
            f"unexpected {self.unexpected[:5]}. The version was written inconsistently; republish it."
        )


class MalformedHeaderError(CorruptArtifactError):
    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: malformed file: {detail}. Republish this version.")


class UnsafeNameError(CorruptArtifactError):
    def __init__(self, name: str, where: str):
        self.name = name
        self.where = where
        super().__init__(
            f"{where} names {name!r}, which escapes its directory (an absolute path, '..', a "
            "separator, a control character, or a symlink pointing outside). Refusing to touch it."
        )


class PayloadBoundError(CorruptArtifactError):
    def __init__(self, tensor: str, detail: str):
        self.tensor = tensor
        self.detail = detail
        super().__init__(f"tensor {tensor}: delta payload out of bounds: {detail}. Republish this version.")


class UnsupportedFormatError(CorruptArtifactError, NotImplementedError):
    error_type = "unsupported_format"

    def __init__(self, field: str, value: object, supported: Sequence[str]):
        self.field = field
        self.value = value
        self.supported = list(supported)
        super().__init__(
            f"unsupported {field} {value!r}; this reader supports {self.supported}. "
            "Upgrade the reader, or publish with a supported setting."
        )


# --- the local checkpoint is bad: reseed once and replay, then fail loud -----------------


class LocalStateError(WeightSyncError, RuntimeError):
    error_type = "local_state_corrupt"
    http_status = 500


class LocalTensorMismatchError(LocalStateError):
    def __init__(self, tensor: str, detail: str):
        self.tensor = tensor
        self.detail = detail
        super().__init__(
            f"local checkpoint cannot take the delta for {tensor}: {detail}. "
            "The local checkpoint does not match the version the delta builds on."
        )


# --- concurrency --------------------------------------------------------------------------


class ConflictError(WeightSyncError, RuntimeError):
    error_type = "conflict"
    http_status = 409
    retryable = True


class LockTimeoutError(ConflictError, TimeoutError):
    def __init__(self, lock_path: str, timeout_s: float):
        self.lock_path = lock_path
        self.timeout_s = timeout_s
        super().__init__(
            f"another pull held {lock_path} for more than {timeout_s:.0f} s. Wait for it to "
            "finish (or find the stuck process holding the lock) and retry."
        )


class PullWorkerDiedError(WeightSyncError, RuntimeError):
    """The process running a pull (an engine's pull helper) exited or was killed before it replied."""

    error_type = "pull_worker_died"
    http_status = 500
    retryable = True

    def __init__(
        self, pid: int, returncode: "int | None", rank: str = "", target_version: "int | None" = None, detail: str = ""
    ):
        self.pid = pid
        self.returncode = returncode
        self.rank = rank
        self.target_version = target_version
        self.detail = detail
        if detail:
            how = f"was stopped ({detail})"
        elif returncode is not None and returncode < 0:
            how = f"was killed by signal {-returncode}"
        elif returncode is not None:
            how = f"exited with status {returncode}"
        else:
            how = "went away"
        to = f" to v{target_version}" if target_version is not None else ""
        on = f" of rank {rank}" if rank else ""
        super().__init__(
            f"the pull process{on} (pid {pid}) {how} before finishing the pull{to}. The local checkpoint "
            "keeps no marker for a version it did not verify and flush, so a retry re-verifies or "
            "reseeds; retry the pull (the engine starts a new pull process), and see the server log "
            "for why it ended."
        )


class PullInProgressError(ConflictError):
    """The engine is running a pull to another target; this request was not queued.

    ``error_type`` is ``PullInProgress``, the name trainers match on: ``running_target_version``
    is what the reply's ``target_version`` carries. A request for the very target (same dirs)
    that is running is never refused: it waits for that pull and gets its result.
    """

    error_type = "PullInProgress"

    def __init__(self, target_version: int, running_target_version: int | None):
        self.target_version = target_version
        self.running_target_version = running_target_version
        running = f"to v{running_target_version} " if running_target_version is not None else ""
        super().__init__(
            f"a pull {running}is still running on this engine; this request to v{target_version} "
            "was not queued. Wait for the running pull's reply, then retry."
        )


class PullTimeoutError(WeightSyncError, TimeoutError):
    """A pull did not finish within the engine's deadline (``--pull-weights-timeout-s``)."""

    error_type = "pull_timeout"
    http_status = 504
    retryable = True

    def __init__(self, target_version: int, timeout_s: float, where: str = ""):
        self.target_version = target_version
        self.timeout_s = timeout_s
        self.where = where
        super().__init__(
            f"the pull to v{target_version} did not finish within {timeout_s:g} s"
            + (f" on {where}" if where else "")
            + " and was abandoned (a hung read of the source dir?). The applied-version marker "
            "names only verified bytes; a later pull waits for this host's pull lock until the "
            "stuck read returns. Check the shared filesystem, then retry."
        )


class EngineUnavailableError(WeightSyncError):
    """The engine cannot run pulls now: it is shutting down, or the plugin failed at start-up."""

    error_type = "unavailable"
    http_status = 503
    retryable = True

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


# --- publishing ----------------------------------------------------------------------------


class PublishError(WeightSyncError, ValueError):
    error_type = "publish_error"
    http_status = 400


class OverwriteTooLargeError(PublishError):
    def __init__(self, tensor: str, nbytes: int):
        self.tensor = tensor
        self.nbytes = nbytes
        super().__init__(
            f"tensor {tensor} has {nbytes} bytes; the 'overwrite' encoding stores 32-bit "
            "positions and cannot address past 4 GiB. Use the 'xor' or 'sparse-v1' encoding."
        )


class ChecksumUnavailableError(UnsupportedFormatError, ImportError):
    def __init__(self, name: str, package: str):
        self.package = package
        super().__init__("checksum_format", name, [name])
        self.args = (
            f"checksum {name!r} needs the optional package {package!r}: pip install {package}",
        )


class CoderUnavailableError(UnsupportedFormatError, ImportError):
    """A sparse-v2 payload of bitstream 3 met an install without the compiled range coder."""

    def __init__(self, tensor: str):
        self.tensor = tensor
        super().__init__("sparse-v2 bitstream", 3, ["2"])
        self.args = (
            f"tensor {tensor}: sparse-v2 bitstream 3 needs the compiled range coder weightsync.codecs._sparse2_rc, which "
            "this install lacks. Reinstall with a C compiler present (`pip install -e .`, or scripts/setup_env.sh), "
            "or have the publisher write bitstream 2 (WEIGHTSYNC_SPARSE2_BITSTREAM=2)",
        )


# --- the host ran out of something ------------------------------------------------------------


class HostResourceError(WeightSyncError, OSError):
    """The host ran out of descriptors, memory or local disk space. Neither the artifact nor the
    local bytes are to blame: the applied-version marker is absent or names verified bytes, and
    the same pull succeeds once the resource is there (raise the limit, free space)."""

    error_type = "host_resource_exhausted"
    http_status = 503
    retryable = True

    def __init__(self, resource: str, errno_name: str, detail: str, hint: str):
        self.resource = resource
        self.errno_name = errno_name
        self.detail = detail
        super().__init__(f"the host ran out of {resource} ({errno_name}: {detail}). {hint}")


_RESOURCE_ERRNOS = {
    errno.EMFILE: ("file descriptors", "The process's descriptor limit (ulimit -n) is too low for this pull; raise it."),
    errno.ENFILE: ("file descriptors", "The system-wide descriptor table is full; close descriptors elsewhere."),
    errno.ENOMEM: ("memory", "Free memory on this host (or lower WEIGHTSYNC_APPLY_WORKERS) and retry."),
    errno.ENOSPC: ("disk space", "Free space on the local checkpoint's disk and retry."),
    errno.EDQUOT: ("disk quota", "Free space within the disk quota of the local checkpoint dir and retry."),
}


def host_resource_error(exc: BaseException) -> HostResourceError | None:
    """The typed error for an OS resource failure (EMFILE, ENFILE, ENOMEM, ENOSPC, EDQUOT, a
    MemoryError), or None for any other exception."""
    if isinstance(exc, WeightSyncError):
        return None
    if isinstance(exc, MemoryError):
        return HostResourceError("memory", "ENOMEM", str(exc) or "an allocation failed", _RESOURCE_ERRNOS[errno.ENOMEM][1])
    if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
        resource, hint = _RESOURCE_ERRNOS[exc.errno]
        where = f" at {exc.filename}" if exc.filename else ""
        return HostResourceError(resource, errno.errorcode[exc.errno], f"{exc.strerror}{where}", hint)
    return None


class PositionsUnavailableError(InvalidRequestError):
    """A chain's changed element positions cannot be read from its payloads alone (a full
    version, or an encoding whose positions depend on bytes this host no longer holds)."""

    def __init__(self, what: str, *, tensor: str | None = None, encoding: str | None = None):
        self.tensor = tensor
        self.encoding = encoding
        super().__init__(what)


def error_types() -> dict[str, int]:
    """error_type -> HTTP status of every concrete error class (for the endpoint's docs/tests)."""
    out: dict[str, int] = {}
    stack: list[type[WeightSyncError]] = [WeightSyncError]
    while stack:
        cls = stack.pop()
        out[cls.error_type] = cls.http_status
        stack.extend(cls.__subclasses__())
    return out


class VersionAlreadyPublishedError(PublishError):
    """The version's index is already in the source dir: it is published and immutable. A retry
    of a publish whose index landed (a later step, such as pruning, failed) is told so, never
    that the version "does not follow"."""

    error_type = "version_already_published"

    def __init__(self, version: int, source_dir: str, detail: str = ""):
        self.version = version
        self.source_dir = source_dir
        super().__init__(
            f"version {version} is already published in {source_dir}{detail}; versions are immutable, "
            f"publish {version + 1} next (or remove the source dir for a new run)"
        )


class PendingVersionError(PublishError):
    """This rank wrote a version whose index has not landed: it must be finished (with its
    staged bytes) or discarded before anything else is published."""

    error_type = "version_pending"

    def __init__(self, pending_version: int, what: str):
        self.pending_version = pending_version
        super().__init__(
            f"{what}. v{pending_version} is written on this rank but its index has not landed: finish it with "
            f"its staged bytes (Publisher.finish_pending(), or prepare/write v{pending_version} again with the "
            f"same bytes), call confirm({pending_version}) once rank 0's commit succeeded, or give it up with "
            "Publisher.discard_pending() (the next version is then full)"
        )


class AnchorUnusableError(CorruptArtifactError):
    """A side anchor failed its check (a file missing or cut short, a bad header, a tensor
    that does not hash to the anchor's digest) and no other way to the target is published:
    the chain below the anchor is pruned. The versions themselves are not blamed. Its
    ``error_type`` stays ``corrupt_artifact``: clients already know not to retry that."""

    def __init__(self, anchor_version: int, detail: str, target_version: int, needed_version: int | None):
        self.anchor_version = anchor_version
        self.detail = detail
        self.target_version = target_version
        self.needed_version = needed_version
        missing = f"v{needed_version} is pruned" if needed_version is not None else "a version it needs is missing"
        super().__init__(
            f"the side anchor of v{anchor_version} failed its check ({detail}), and reaching v{target_version} "
            f"without it needs the chain below it, where {missing}. Restore the anchor's files from "
            "a backup, or have the trainer publish a full version and pull that one."
        )


# --- the pull side: "not there" is not "not yet", local faults are local ---------------------


class SourceDirUnusableError(InvalidRequestError):
    """The source dir does not exist, or holds no weightsync run (no ``weightsync-run.json``, no
    ``weight_vNNNNNN/``, no ``anchor_vNNNNNN/``): a wrong path, which no retry fixes."""

    def __init__(self, source_dir: str, detail: str):
        self.source_dir = source_dir
        self.detail = detail
        super().__init__(
            f"source dir {source_dir} {detail}; it is not a weightsync run, so waiting will not help. "
            "Check the path (it is the dir the trainer publishes weight_vNNNNNN/ into)."
        )


class VersionPrunedError(InvalidRequestError):
    """The requested version was published and has been pruned since: it never comes back."""

    def __init__(self, version: int, source_dir: str, oldest_pullable: "int | None"):
        self.version = version
        self.source_dir = source_dir
        self.oldest_pullable = oldest_pullable
        oldest = f"the oldest version still pullable is v{oldest_pullable}" if oldest_pullable is not None else "no older version is left"
        super().__init__(
            f"version {version} was pruned from {source_dir} (newer versions are published); {oldest}. "
            "Pull a version that is kept, or keep more versions when pruning."
        )


class LayoutMismatchError(CorruptArtifactError):
    """A full version (or a side anchor) whose tensor names, dtypes or shapes differ from the
    layout it must have (the seed dir's, or the one its index records). Nothing local was
    touched. A version published with ``--allow-layout-change`` is exempt from the seed check."""

    def __init__(self, what: str, reference: str, differences: Sequence[str]):
        self.what = what
        self.reference = reference
        self.differences = list(differences)
        shown = "; ".join(self.differences[:5])
        more = f" (and {len(self.differences) - 5} more)" if len(self.differences) > 5 else ""
        super().__init__(
            f"{what} does not have the layout of {reference}: {shown}{more}. Serving it would mix tensors "
            "of no published version; republish it as a complete full version (or with --allow-layout-change "
            "when the model's layout really changed, and restart the engines from a model of the new layout)."
        )


class LocalDirUnusableError(LocalStateError):
    """The local checkpoint dir cannot be used at all: a regular file, read-only, or not
    creatable. A host-side fault: neither the request's versions nor the artifact are blamed."""

    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(
            f"the local checkpoint dir {path} cannot be used: {detail}. Fix the path or its permissions "
            "on this host (it must be a writable directory, or creatable), then pull again."
        )


class LocalDirNotOursError(InvalidRequestError):
    """A pull into a non-empty directory that weightsync did not write (no ``.weight_sync/``):
    it would replace the user's files. Refused unless forced."""

    def __init__(self, path: str, entries: Sequence[str]):
        self.path = path
        self.entries = list(entries)
        super().__init__(
            f"the local checkpoint dir {path} is not empty ({', '.join(self.entries[:5])}"
            + (f" and {len(self.entries) - 5} more" if len(self.entries) > 5 else "")
            + ") and weightsync did not write it (no .weight_sync/); a pull would replace these files. "
            "Pick an empty or new dir, or pass --force (force=True) to let the pull own it."
        )


class LocalFileDamagedError(LocalStateError):
    """A file of the local checkpoint is damaged (a header that does not parse, a file cut
    short): a local fault; a pull reseeds it."""

    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"local file {path} is damaged: {detail}. A pull reseeds it (the published versions are not blamed).")


class SeedDirUnusableError(InvalidRequestError):
    """The seed dir (the engine's own model, version 0) is not a complete, readable checkpoint."""

    def __init__(self, seed_dir: str, detail: str):
        self.seed_dir = seed_dir
        self.detail = detail
        super().__init__(
            f"the seed dir {seed_dir} (the engine's own model, version 0) cannot be used: {detail}. "
            "Pass the complete model dir the engine was started from."
        )


__all__ += [
    "SourceDirUnusableError", "VersionPrunedError", "LayoutMismatchError", "LocalDirUnusableError",
    "LocalDirNotOursError", "LocalFileDamagedError", "SeedDirUnusableError",
]


# --- buckets (s3://, gs://, az://) as a source dir -------------------------------------------


class BucketClientMissingError(InvalidRequestError, ImportError):
    """A source dir is a bucket URL but the object-store client is not installed."""

    error_type = "bucket_client_missing"

    def __init__(self, url: str):
        self.url = url
        super().__init__(
            f"{url} is a bucket: reading or writing it needs the optional object-store client (obstore), "
            "which is not installed. Install it with `pip install 'weightsync[bucket]'`."
        )


class BucketURLError(InvalidRequestError):
    """A bucket URL that cannot name a source (an unknown scheme, no bucket, a query, credentials)."""

    def __init__(self, url: str, detail: str):
        self.url = url
        self.detail = detail
        super().__init__(f"bucket URL {url!r} cannot be used: {detail}. Expected s3://bucket/prefix (or gs://, az://).")


class BucketConfigError(WeightSyncError, ValueError):
    """The object-store client cannot be configured from the environment (an Azure URL with no
    account named, a malformed endpoint): nothing was asked of any store, and retrying changes
    nothing until the environment does."""

    error_type = "bucket_config"
    http_status = 400

    def __init__(self, url: str, detail: str):
        self.url = url
        self.detail = detail
        super().__init__(
            f"the client for {url} cannot be configured from the environment: {detail}. Set the store's "
            f"variables ({_store_variables(url)}; docs/BUCKETS.md) where the pull or publish runs. Nothing was written."
        )


def _store_variables(url: str) -> str:
    """The environment variables that configure a URL's store."""
    if url.startswith("az://"):
        return "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or a SAS or client secret; AZURE_STORAGE_ENDPOINT"
    if url.startswith("gs://"):
        return "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT (a key file)"
    return "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL"


class BucketRefusedError(WeightSyncError, ConnectionError):
    """The store answered a request with a refusal that no retry changes (400, 405, 411, 501 ...):
    it does not support the request (an S3-compatible store without conditional writes or
    multipart uploads, an emulator) or the endpoint is not the store meant. Not retried."""

    error_type = "bucket_refused"
    http_status = 502

    def __init__(self, url: str, operation: str, status: int, detail: str):
        self.url = url
        self.operation = operation
        self.status = status
        self.detail = detail
        super().__init__(
            f"the store for {url} refused {operation} with HTTP {status}: {detail}. Not retried: the store "
            "does not support this request or the endpoint is not the store meant; check the endpoint "
            f"({_endpoint_variable(url)}) and that the store supports conditional writes and multipart uploads. "
            "Nothing partial was kept."
        )


class BucketCredentialsError(WeightSyncError, PermissionError):
    """The store refused the credentials (wrong, expired, or not allowed on this bucket). They
    come from the environment only (AWS_* / GOOGLE_* / AZURE_* variables), never a request."""

    error_type = "bucket_credentials"
    http_status = 403

    def __init__(self, url: str, operation: str, detail: str):
        self.url = url
        self.operation = operation
        self.detail = detail
        super().__init__(
            f"the store refused the credentials for {operation} on {url}: {detail}. Check the environment's "
            "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, or the GCS/Azure ones): "
            "wrong, expired, or without access to this bucket. Nothing local was changed."
        )


class BucketUnavailableError(WeightSyncError, ConnectionError):
    """The store did not answer (connection refused, timeouts, 5xx, throttling) within the
    operation's deadline, after retries. Nothing was counted as done: retry later."""

    error_type = "bucket_unavailable"
    http_status = 503
    retryable = True

    def __init__(self, url: str, operation: str, detail: str):
        self.url = url
        self.operation = operation
        self.detail = detail
        super().__init__(
            f"the store for {url} did not complete {operation}: {detail}. Retried within the deadline; "
            f"nothing partial was kept. Retry later (is the endpoint up? {_endpoint_variable(url)}?)."
        )


def _endpoint_variable(url: str) -> str:
    """The environment variable that names the endpoint for a URL's store."""
    if url.startswith("az://"):
        return "AZURE_STORAGE_ENDPOINT, or AZURITE_BLOB_STORAGE_URL for the emulator"
    if url.startswith("gs://"):
        return "the service account's gcs_base_url"
    return "AWS_ENDPOINT_URL"


class SourceChangedError(SourceNotReadyError):
    """An object of the source changed while the pull read it (its ETag moved): the bytes
    planned from are gone. Nothing local was changed by it: retry, the retry plans again."""

    error_type = "source_changed"

    def __init__(self, url: str, key: str, detail: str = ""):
        self.url = url
        self.key = key
        super().__init__(
            f"{url}/{key} changed while the pull was reading it (its ETag no longer matches){detail}; "
            "nothing partial was kept. Retry the pull: it plans from what is published now."
        )


class ConditionalWritesUnsupportedError(InvalidRequestError):
    """The store accepted a second create-only write of one key: it does not honour
    ``If-None-Match: *``, so it cannot carry the commit protocol, and is refused at start."""

    error_type = "conditional_writes_unsupported"

    def __init__(self, url: str):
        self.url = url
        super().__init__(
            f"the store behind {url} does not honour conditional create (If-None-Match: *): a second "
            "create-only PUT of one key succeeded. Two writers could then both commit one version, so "
            "publishing there is refused. Use a store that supports conditional writes (AWS S3, GCS, "
            "Azure, MinIO, R2, SeaweedFS ...)."
        )


class BucketConflictError(VersionAlreadyPublishedError):
    """Another writer committed this version (its index in the bucket is not ours, byte for byte)."""

    error_type = "bucket_conflict"
    http_status = 409

    def __init__(self, version: int, url: str):
        super().__init__(
            version, url,
            " by another writer (its index differs from the one this publisher wrote); this publisher lost the "
            "race and stops here",
        )


__all__ += [
    "BucketClientMissingError", "BucketURLError", "BucketCredentialsError", "BucketUnavailableError", "BucketRefusedError", "BucketConfigError",
    "SourceChangedError", "ConditionalWritesUnsupportedError", "BucketConflictError",
]


# --- publishing: refusals before anything is written (issue 25 points 2-4, 8; issue 28 point 7) ---


class VersionNumberError(PublishError):
    """The version number is not the next one of the source dir: a gap, a number below 1, or a
    number at or below the newest published one that is not on disk any more. Nothing was
    written; publish ``expected_version``."""

    error_type = "version_out_of_order"

    def __init__(self, version: int, expected_version: int, newest_version: int, source_dir: str, detail: str = ""):
        self.version = version
        self.expected_version = expected_version
        self.newest_version = newest_version
        self.source_dir = source_dir
        newest = f"the newest published version is v{newest_version}" if newest_version else "nothing is published yet"
        super().__init__(
            f"cannot publish version {version} into {source_dir}: {newest}, so the next version is "
            f"{expected_version}{detail}. Versions chain one at a time (a gap would leave pulls of the "
            f"missing numbers waiting forever); nothing was written: publish {expected_version} next."
        )


class BaseMismatchError(PublishError):
    """A delta's base (the bytes it diffs against) is not what version ``base_version`` holds
    according to what the source dir records (its digests, or the run's seed digests). Such a
    delta would be rejected by every pull as corrupt. Nothing was written."""

    error_type = "base_mismatch"

    def __init__(self, version: int, base_version: int, mismatches: Sequence[tuple[str, str, str]],
                 missing: Sequence[str] = (), extra: Sequence[str] = (), checksum_format: str = ""):
        self.version = version
        self.base_version = base_version
        self.mismatches = list(mismatches)  # (tensor, recorded digest, digest of the given base)
        self.missing = sorted(missing)
        self.extra = sorted(extra)
        self.checksum_format = checksum_format
        parts = []
        if self.mismatches:
            n, e, a = self.mismatches[0]
            parts.append(f"tensor {n} differs first: v{base_version} records {checksum_format} {e}, the base holds {a}"
                         + (f" ({len(self.mismatches)} tensors differ)" if len(self.mismatches) > 1 else ""))
        if self.missing:
            parts.append(f"the base lacks tensors {self.missing[:5]} that v{base_version} holds")
        if self.extra:
            parts.append(f"the base holds tensors {self.extra[:5]} that v{base_version} does not")
        what = "the run's seed (version 0)" if base_version == 0 else f"version {base_version}"
        super().__init__(
            f"the base of the delta v{version} is not {what}: {'; '.join(parts)}. Nothing was written. Pass the "
            f"checkpoint of {what} as the base (--base-checkpoint), or publish v{version} as a full version (--full)."
        )


class LayoutChangeError(PublishError):
    """A full version mid-run changes the layout (a tensor's dtype or shape, or the tensor set)
    of the version before it. Later deltas would diff against it and engines loaded with the old
    layout could not take it. Nothing was written."""

    error_type = "layout_change"

    def __init__(self, version: int, base_version: int, changes: Sequence[str]):
        self.version = version
        self.base_version = base_version
        self.changes = list(changes)
        more = f" (and {len(self.changes) - 5} more)" if len(self.changes) > 5 else ""
        super().__init__(
            f"the full version v{version} changes the layout of v{base_version}: {'; '.join(self.changes[:5])}{more}. "
            "Nothing was written. If the model really changed, publish it with --allow-layout-change "
            "(Publisher: allow_layout_change=True; the index records it), else pass the right checkpoint."
        )


class VersionConflictError(VersionAlreadyPublishedError, ConflictError):
    """The version is published with other bytes than the ones given (versions are immutable).
    Exit code 6 (conflict); retrying the same call cannot help."""

    error_type = "version_conflict"
    http_status = 409
    retryable = False

    def __init__(self, version: int, source_dir: str, detail: str = ""):
        VersionAlreadyPublishedError.__init__(self, version, source_dir, detail)


class SupersededPublisherError(ConflictError):
    """Another publisher took over this source dir (a restarted trainer while this one still
    ran): this one is fenced and must stop. Nothing of the other's versions was touched."""

    error_type = "publisher_superseded"
    retryable = False

    def __init__(self, source_dir: str, own_epoch: int, current_epoch: "int | None", holder: str, what: str):
        self.source_dir = source_dir
        self.own_epoch = own_epoch
        self.current_epoch = current_epoch
        self.holder = holder
        now = f"epoch {current_epoch} ({holder})" if current_epoch is not None else f"no readable lease ({holder})"
        super().__init__(
            f"{what}: this publisher (writer epoch {own_epoch}) was superseded in {source_dir}, which now names "
            f"{now}. It wrote no index; stop this process (the newer publisher owns the run), or open a new "
            "Publisher to take the run over on purpose."
        )


__all__ += [
    "VersionNumberError", "BaseMismatchError", "LayoutChangeError", "VersionConflictError", "SupersededPublisherError",
]


class SeedDirMismatchError(InvalidRequestError):
    """A pull's seed dir is not the model the run started from: tensors of it differ from the
    digests the run recorded for version 0 (``weightsync-run.json``, key ``seed``). Not the
    published artifact's fault; nothing is marked as pulled."""

    error_type = "seed_dir_mismatch"

    def __init__(self, seed_dir: str, source_dir: str, mismatches: Sequence[tuple[str, str, str]]):
        self.seed_dir = seed_dir
        self.source_dir = source_dir
        self.mismatches = list(mismatches)  # (tensor, digest the run recorded, digest of the seed dir's bytes)
        shown = "; ".join(f"{n}: run records {e}, seed dir holds {a}" for n, e, a in self.mismatches[:3])
        super().__init__(
            f"the seed dir {seed_dir} is not the model the run in {source_dir} started from: "
            f"{len(self.mismatches)} tensor(s) differ from the run's seed digests ({shown}). The published versions "
            "are not to blame: pass the model the trainer started from as --seed-dir (the engine's own model)."
        )


__all__ += ["SeedDirMismatchError"]


class HttpSourceURLError(InvalidRequestError):
    """An HTTP(S) source URL that cannot name a source (user info, a query, a fragment, '..')."""

    def __init__(self, url: str, detail: str):
        self.url = url
        self.detail = detail
        super().__init__(
            f"HTTP source URL {url!r} cannot be used: {detail}. Expected http(s)://host[:port]/path/to/run; "
            "the origin behind a cache comes from WEIGHTSYNC_HTTP_ORIGIN, never from the request."
        )


class PayloadFileMismatchError(CorruptArtifactError):
    """A payload file read from the origin itself does not match the size and digest its index
    records (``file_digests``): the published version is damaged, not a cache in front of it."""

    def __init__(self, url: str, key: str, expected: str, actual: str):
        self.url = url
        self.key = key
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"{url}/{key} read from the origin is {actual}, its index records {expected}: the published "
            "file is damaged (a cache's copy was already passed over). Nothing was applied; republish the version."
        )


class HttpSourceUnavailableError(BucketUnavailableError):
    """An HTTP(S) source (or its origin) did not answer, or kept answering 5xx/429, within the
    fetch's deadline, after retries. Nothing partial was kept: retry later."""

    error_type = "source_unavailable"

    def __init__(self, url: str, operation: str, detail: str):
        self.url = url
        self.operation = operation
        self.detail = detail
        WeightSyncError.__init__(
            self,
            f"the HTTP source {url} did not complete {operation}: {detail}. Retried within the deadline "
            "(WEIGHTSYNC_BUCKET_DEADLINE_S); nothing partial was kept. Retry later (is the server up? "
            "WEIGHTSYNC_HTTP_ORIGIN?).",
        )


__all__ += ["HttpSourceURLError", "PayloadFileMismatchError", "HttpSourceUnavailableError"]


class SwarmUnavailableError(InvalidRequestError, ImportError):
    """The BitTorrent swarm (``weightsync[swarm]``, docs/FLEET.md) was asked for, but its optional
    package, libtorrent, is not installed. Raised before anything is written."""

    error_type = "swarm_unavailable"  # an engine's reply names it (sglang 0.5.16's venv has no libtorrent)

    def __init__(self, what: str, cause: str = ""):
        self.what = what
        self.package = "libtorrent"
        self.cause = cause
        super().__init__(
            f"{what} needs the optional package 'libtorrent' (the BitTorrent v2 swarm), which this install "
            f"lacks{': ' + cause if cause else ''}. pip install 'weightsync[swarm]' (or libtorrent), or leave the "
            "swarm off (no WEIGHTSYNC_SWARM_PEERS / WEIGHTSYNC_PUBLISH_TORRENT): the source alone serves every host."
        )


class SwarmConfigError(InvalidRequestError):
    """A swarm setting (a peer address, the listen address, a tracker URL) that cannot be used."""

    def __init__(self, setting: str, value: object, expected: str):
        self.setting = setting
        self.value = value
        self.expected = expected
        super().__init__(f"swarm setting {setting}={value!r} cannot be used: expected {expected}.")


__all__ += ["SwarmUnavailableError", "SwarmConfigError"]


# --- publishing from several nodes into one bucket (WEIGHTSYNC_BUCKET_RANK_REPORTS=1) -----------


class RankReportMissingError(PublishError):
    """Rank 0's commit waited for the reports of some ranks and they did not come. Nothing was
    committed; the same commit retried once those ranks reported lands (``retryable``)."""

    error_type = "rank_report_missing"
    retryable = True

    def __init__(self, version: int, url: str, ranks: Iterable[int], waited_s: float, detail: str = ""):
        self.version = version
        self.url = url
        self.ranks = list(ranks)
        self.waited_s = waited_s
        self.detail = detail
        # The names below are storage.rank_reports' knobs and layout (spelled out: this module
        # imports nothing of the package, so every module can import it).
        super().__init__(
            f"v{version}: no report from rank(s) {self.ranks} in {url} after {waited_s:.0f}s (expected one per rank "
            f"under weight_v{version:06d}/.ranks/ naming its uploaded shards{detail}); nothing was "
            "committed. Each rank other than 0 reports at the end of its write() (with "
            "WEIGHTSYNC_BUCKET_RANK_REPORTS=1 on every rank): find why that rank did not write, then retry the version "
            "on every rank (or wait longer: WEIGHTSYNC_BUCKET_RANK_REPORT_WAIT_S)"
        )


class RankReportMismatchError(PublishError):
    """A rank's report cannot be this attempt's (two under one lease, damaged, for another
    version or rank, or naming a shard the bucket lacks): rank 0 never commits it."""

    error_type = "rank_report_mismatch"

    def __init__(self, version: int, url: str, rank: int, what: str):
        self.version = version
        self.url = url
        self.rank = rank
        self.what = what
        super().__init__(
            f"v{version}: the report of rank {rank} in {url} {what}; nothing was committed. Retry the version on every "
            "rank with the same bytes, passing commit() the manifests every rank's write() returned in this attempt "
            "(or discard_pending() on every rank first, which removes the reports)"
        )


__all__ += ["RankReportMissingError", "RankReportMismatchError"]


def name_the_source(error: BaseException, root: str, url: str) -> BaseException:
    """``error`` with every mention of the host-local dir ``root`` replaced by the source ``url``
    it stands for (a pull's mirror of a bucket, a publisher's staging copy): an operator needs
    ``s3://.../weight_v000003``, not ``.weight_sync/sources/<hash>/weight_v000003``. Rewritten in
    place, so its type, its data attributes and its traceback stay; returned for ``raise``."""
    roots = sorted({root.rstrip(os.sep), os.path.realpath(root)}, key=len, reverse=True)
    url = url.rstrip("/")

    def fix(value):
        if isinstance(value, str):
            for r in roots:
                value = value.replace(r, url)
            return value
        if isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
            return type(value)(fix(v) for v in value)
        return value

    try:
        error.args = tuple(fix(a) for a in error.args)
        for name, value in list(vars(error).items()):
            fixed = fix(value)
            if fixed is not value:
                setattr(error, name, fixed)
        if isinstance(error, OSError):  # slots, not in vars(); set only when there (str() changes)
            for name in ("filename", "filename2"):
                if isinstance(getattr(error, name), str):
                    setattr(error, name, fix(getattr(error, name)))
    except (AttributeError, TypeError):
        pass  # an error that refuses a new attribute value keeps the mirror's path: still typed
    return error
