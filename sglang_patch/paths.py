"""Which directories a ``/pull_weights`` request may read and write: the decision, without sglang.

The operator names allowed roots with ``--pull-weights-allowed-roots DIR[,DIR...]``. A request's
``local_checkpoint_dir`` (written) and ``source_dir`` (read) must both lie inside one of them.
A root may also be a bucket prefix (``s3://bucket/prefix``, ``gs://``, ``az://``) or an HTTP(S)
prefix (``http://host[:port]/path``, a static server or a caching tier in front of the trainer's
dir): a ``source_dir`` URL must then lie below it, segment by segment as paths do. An HTTP root
matches on scheme, host and port exactly (``http://cache:8080`` allows neither
``http://cache:8081`` nor ``https://cache:8080`` nor ``http://cache2:8080``). A URL with user
info, a query or a fragment is refused (400): the bucket's endpoint and credentials, and an HTTP
source's origin behind a cache (``WEIGHTSYNC_HTTP_ORIGIN``), come from the server's environment
only, never from a request.

Invariants (each refusal raises before anything is touched):
- No allowed roots configured means every request is refused (403): an endpoint that writes to
  arbitrary paths as the server's user must be switched on deliberately, not by default.
- A path must be absolute; a relative path would depend on the server's working dir (400).
- A path with a ``..`` component is refused outright (403), even if it would land inside a root.
- The path must be inside a root both as written and after resolving symlinks (``realpath``); a
  symlink that leads out of every root is refused (403). The caller then uses the resolved path,
  so a later pull works on exactly the directory that was checked.
- The local checkpoint dir must not overlap the engine's own model (the seed dir: version 0 is
  copied from it, so patching it would destroy the reset point) nor the source dir (400).
- A path the OS cannot use (longer than PATH_MAX, a component longer than NAME_MAX) is a 400
  here, not an ``OSError`` later; every message shows a path cut to ``SHOWN_PATH_CHARS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from weightsync.errors import InvalidRequestError, PathNotAllowedError
from weightsync.storage.http import HttpURL, is_http_url, parse_http_url
from weightsync.storage.url import is_bucket_url, parse_bucket_url, url_within

ALLOWED_ROOTS_FLAG = "--pull-weights-allowed-roots"
PATH_MAX = 4096  # Linux's limits; os.pathconf would ask a directory that may not exist yet
NAME_MAX = 255
SHOWN_PATH_CHARS = 200


def cut_path(path: str) -> str:
    """A path for a message, cut to ``SHOWN_PATH_CHARS`` characters (a request may carry 100 KB)."""
    if len(path) <= SHOWN_PATH_CHARS:
        return path
    return f"{path[:SHOWN_PATH_CHARS]}... ({len(path)} characters)"


def shown(value: object) -> str:
    """``repr`` of a request's path (or of whatever came instead of one), cut short."""
    return repr(cut_path(value)) if isinstance(value, str) else cut_path(repr(value))


def parse_allowed_roots(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """Allowed roots from the flag's value: comma-separated absolute dirs (normalised, deduplicated).

    Raises ``ValueError`` for a relative root or one with ``..`` (an operator error at start-up).
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    roots: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if is_bucket_url(item):
            # A bucket prefix (s3://bucket/prefix) allows source URLs below it, segment by segment.
            url = str(parse_bucket_url(item))
            if url not in roots:
                roots.append(url)
            continue
        if is_http_url(item):
            # An HTTP(S) prefix: source URLs on the same scheme, host and port, below its path.
            url = str(parse_http_url(item, what=f"{ALLOWED_ROOTS_FLAG} entry"))
            if url not in roots:
                roots.append(url)
            continue
        if not os.path.isabs(item):
            raise ValueError(f"{ALLOWED_ROOTS_FLAG}: {item!r} is not an absolute path")
        if ".." in _components(item):
            raise ValueError(f"{ALLOWED_ROOTS_FLAG}: {item!r} contains '..'; name the directory itself")
        root = os.path.normpath(item)
        if root not in roots:
            roots.append(root)
    return tuple(roots)


@dataclass(frozen=True)
class CheckedPaths:
    """The request's directories, resolved (symlinks followed) and checked against the roots."""

    local_checkpoint_dir: str
    source_dir: str


def check_request_paths(
    local_checkpoint_dir: object,
    source_dir: object,
    allowed_roots: Sequence[str],
    *,
    seed_dir: str | None = None,
) -> CheckedPaths:
    """Check a request's dirs against the allowed roots; return their resolved forms.

    Raises:
        InvalidRequestError (400): not a non-empty absolute path; the local dir overlaps the
            seed dir or the source dir.
        PathNotAllowedError (403): no roots configured; a ``..`` component; outside every root as
            written or after resolving symlinks.
    """
    path_roots = [r for r in allowed_roots if not _is_url(r)]
    local = _check_one("local_checkpoint_dir", local_checkpoint_dir, path_roots)
    if is_bucket_url(source_dir):
        source = _check_source_url(source_dir, allowed_roots)
    elif is_http_url(source_dir):
        source = _check_source_http_url(source_dir, allowed_roots)
    else:
        source = _check_one("source_dir", source_dir, path_roots)
        if _overlaps(local, source):
            raise InvalidRequestError(
                f"local_checkpoint_dir {shown(local)} and source_dir {shown(source)} overlap; the local "
                "checkpoint must be a separate host-local directory, not inside the published versions"
            )
    # The seed is checked whatever the source is: a URL source still writes the local dir.
    if seed_dir:
        seed = os.path.realpath(seed_dir)
        if _overlaps(local, seed):
            raise InvalidRequestError(
                f"local_checkpoint_dir {shown(local)} overlaps the engine's own model dir {shown(seed)} "
                "(the seed for version 0); patching it would destroy the reset point. Use a "
                "separate directory for the local checkpoint."
            )
    return CheckedPaths(local_checkpoint_dir=local, source_dir=source)


def _check_one(label: str, value: object, allowed_roots: Sequence[str]) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{label} must be a non-empty path, got {shown(value)}")
    if "\x00" in value:
        raise InvalidRequestError(f"{label} contains a NUL byte")
    if not os.path.isabs(value):
        raise InvalidRequestError(
            f"{label} must be an absolute path, got {shown(value)} (a relative path would depend on "
            "the server's working directory)"
        )
    _check_os_limits(label, value)
    if not allowed_roots:
        raise PathNotAllowedError(
            cut_path(value),
            [],
            f"no allowed roots are configured; start the server with {ALLOWED_ROOTS_FLAG} DIR[,DIR...]",
        )
    if ".." in _components(value):
        raise PathNotAllowedError(cut_path(value), allowed_roots, f"{label} contains a '..' component")
    written = os.path.normpath(value)
    if not any(_is_within(written, root) for root in allowed_roots):
        raise PathNotAllowedError(cut_path(value), allowed_roots, f"{label} is not below any allowed root")
    real = os.path.realpath(written)
    if not any(_is_within(real, os.path.realpath(root)) for root in allowed_roots):
        raise PathNotAllowedError(
            cut_path(value),
            allowed_roots,
            f"{label} resolves through a symlink to {shown(real)}, outside every allowed root",
        )
    return real


def _check_source_url(value: str, allowed_roots: Sequence[str]) -> str:
    """A bucket URL source: parsed strictly (no endpoint, credentials or query: those come from
    the server's environment only, 400 otherwise) and below an allowed URL root (403)."""
    url = str(parse_bucket_url(cut_path(value) if len(value) > 2048 else value))
    url_roots = [r for r in allowed_roots if is_bucket_url(r)]
    if not any(url_within(url, root) for root in url_roots):
        raise PathNotAllowedError(
            cut_path(value), list(allowed_roots),
            "source_dir is a bucket URL below no allowed URL root" if url_roots else
            f"source_dir is a bucket URL and no URL root is allowed (add s3://bucket/prefix to {ALLOWED_ROOTS_FLAG})",
        )
    return url


def _check_source_http_url(value: str, allowed_roots: Sequence[str]) -> str:
    """An HTTP(S) source: parsed strictly (no user info, query or fragment: the origin behind a
    cache comes from the server's environment only, 400 otherwise) and below an allowed HTTP root
    on the same scheme, host and port (403)."""
    url = parse_http_url(cut_path(value) if len(value) > 2048 else value)
    http_roots = [parse_http_url(r) for r in allowed_roots if is_http_url(r)]
    if not any(http_url_within(url, root) for root in http_roots):
        raise PathNotAllowedError(
            cut_path(value), list(allowed_roots),
            "source_dir is an HTTP URL below no allowed HTTP root (scheme, host and port must match)"
            if http_roots else
            f"source_dir is an HTTP URL and no HTTP root is allowed (add http://host:port/prefix to {ALLOWED_ROOTS_FLAG})",
        )
    return str(url)


def http_url_within(url: HttpURL, root: HttpURL) -> bool:
    """True when ``url`` is ``root`` or below it: the same scheme and host[:port] (a host name's
    case aside), then path segment by segment (``/runs`` does not contain ``/runs2``)."""
    if url.scheme != root.scheme or url.netloc.lower() != root.netloc.lower():
        return False
    return not root.path or url.path == root.path or url.path.startswith(root.path + "/")


def _is_url(value: str) -> bool:
    return is_bucket_url(value) or is_http_url(value)


def _check_os_limits(label: str, value: str) -> None:
    """A path the OS would refuse (ENAMETOOLONG) is the request's fault: 400, said plainly."""
    nbytes = len(os.fsencode(value))
    if nbytes >= PATH_MAX:
        raise InvalidRequestError(
            f"{label} {shown(value)} is {nbytes} bytes long; a path on this host must be shorter "
            f"than {PATH_MAX} bytes. Use a shorter directory path."
        )
    for part in _components(value):
        if len(os.fsencode(part)) > NAME_MAX:
            raise InvalidRequestError(
                f"{label} has a component of {len(os.fsencode(part))} bytes ({shown(part)}); a "
                f"file name on this host may have at most {NAME_MAX}. Use a shorter directory name."
            )


def _components(path: str) -> list[str]:
    return [part for part in path.replace(os.sep, "/").split("/") if part]


def _is_within(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:
        return False


def _overlaps(a: str, b: str) -> bool:
    return _is_within(a, b) or _is_within(b, a)
