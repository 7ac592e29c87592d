"""Bucket URLs: ``s3://bucket/prefix`` (and ``gs://``, ``az://``), parsed strictly.

A URL names a bucket and a key prefix, nothing else: no endpoint, no credentials, no query.
Those come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...), so a request
that names a source (``POST /pull_weights``) can never point the engine at another server.
"""

from __future__ import annotations

import re

import msgspec

from ..errors import BucketURLError

SCHEMES = ("s3", "gs", "az")
_URL_RE = re.compile(r"^([a-z0-9]+)://([^/]*)(/.*)?$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,221}[a-z0-9]$")


class BucketURL(msgspec.Struct, frozen=True):
    scheme: str
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket's root

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def key(self, name: str) -> str:
        """The full key of ``name`` (relative to the prefix), for messages."""
        return f"{self.prefix}/{name}" if self.prefix else name


def is_bucket_url(value: object) -> bool:
    """True for a string that starts with a bucket scheme (``s3://`` ...): it is then parsed as one."""
    return isinstance(value, str) and any(value.startswith(f"{s}://") for s in SCHEMES)


def parse_bucket_url(url: str) -> BucketURL:
    """The canonical form of a bucket URL; ``BucketURLError`` for anything else."""
    if not isinstance(url, str):
        raise BucketURLError(repr(url), "not a string")
    m = _URL_RE.match(url)
    if m is None or m.group(1) not in SCHEMES:
        raise BucketURLError(url, f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    scheme, bucket, path = m.group(1), m.group(2), m.group(3) or ""
    if any(c in url for c in "?#@\\") or any(ord(c) < 0x21 for c in url):
        raise BucketURLError(url, "a query, fragment, user info, backslash, space or control character is not allowed")
    if not _BUCKET_RE.match(bucket):
        raise BucketURLError(url, f"{bucket!r} is not a bucket name")
    parts = [p for p in path.split("/")]
    inner = parts[1:] if parts and parts[0] == "" else parts
    if inner and inner[-1] == "":
        inner = inner[:-1]
    if any(p in ("", ".", "..") for p in inner):
        raise BucketURLError(url, "the prefix has an empty, '.' or '..' segment")
    return BucketURL(scheme, bucket, "/".join(inner))


def url_within(url: str, root: str) -> bool:
    """True when bucket URL ``url`` is ``root`` or below it, segment by segment (``s3://b/run``
    does not contain ``s3://b/run2``): the allowed-roots rule paths follow."""
    u, r = parse_bucket_url(url), parse_bucket_url(root)
    if (u.scheme, u.bucket) != (r.scheme, r.bucket):
        return False
    return not r.prefix or u.prefix == r.prefix or u.prefix.startswith(r.prefix + "/")
