"""The bodies of ``POST /pull_weights`` and ``POST /update_weights_from_pulled``, parsed strictly.
No sglang here.

Why strict: the core refuses booleans and strings as versions on purpose, and a lax schema
(pydantic's default) turned ``"target_version": "1"`` and ``true`` into a pull of version 1.
The body is decoded by msgspec against a typed Struct: every field has exactly its JSON type,
anything else is a 400 that names the field, and the body's size is bounded before decoding.
Unknown fields are ignored (older and newer clients send the same fields).

Two more refusals, both before the body is read:

- a ``target_version`` above ``MAX_TARGET_VERSION`` (the int64 range sglang's IPC, the metrics
  and the version spelling carry) is a 400: ``2**64`` used to reach the msgpack IPC and come
  back as a 500 with a body that was not JSON;
- any ``Content-Type`` but ``application/json`` (parameters such as ``charset`` allowed) is a
  415: a browser page may POST a ``text/plain`` body cross-site without a CORS preflight, and
  these routes change the weights an engine serves.
"""

from __future__ import annotations

from typing import Annotated, Optional

import msgspec

from weightsync.errors import InvalidRequestError, UnsupportedMediaTypeError

from .results import shorten

MAX_BODY_BYTES = 1 << 20
MAX_TARGET_VERSION = (1 << 63) - 1
JSON_MEDIA_TYPE = "application/json"

TargetVersion = Annotated[int, msgspec.Meta(ge=0, le=MAX_TARGET_VERSION)]

EXPECTED = ('{"local_checkpoint_dir": str, "source_dir": str (a dir, s3://bucket/prefix or http(s)://host[:port]/path), '
            '"target_version": int}')
LIVE_EXPECTED = '{"local_checkpoint_dir": str, "target_version": int, "flush_cache": bool (optional)}'


class PullRequestBody(msgspec.Struct, frozen=True):
    """What a caller sends: bring ``local_checkpoint_dir`` to ``target_version`` from ``source_dir``.

    ``source_dir`` is a string here whatever it names (a dir, a bucket URL, an HTTP(S) URL): which
    it is, and whether it is allowed, is ``sglang_patch.paths``' decision against the operator's
    roots; an HTTP source's origin and cache settings are never fields of the body.
    """

    local_checkpoint_dir: str
    source_dir: str
    target_version: TargetVersion


class LiveRequestBody(msgspec.Struct, frozen=True):
    """``POST /update_weights_from_pulled``: serve ``target_version`` from ``local_checkpoint_dir``."""

    local_checkpoint_dir: str
    target_version: TargetVersion
    flush_cache: bool = True
    torch_empty_cache: bool = False


def check_json_content_type(route: str, content_type: Optional[str]) -> None:
    """Raises ``UnsupportedMediaTypeError`` (415) unless the body is declared ``application/json``."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise UnsupportedMediaTypeError(route, shorten(content_type, 200) if content_type else None)


def _decode(raw: bytes, kind: type, route: str, expected: str):
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequestError(
            f"invalid {route} request: the body has {len(raw)} bytes, more than the "
            f"{MAX_BODY_BYTES} allowed. Expected {expected}"
        )
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        problem = str(exc)
    except msgspec.DecodeError as exc:
        problem = f"the body is not JSON ({exc})"
    raise InvalidRequestError(f"invalid {route} request: {shorten(problem, 500)}. Expected {expected}")


def parse_pull_body(raw: bytes) -> PullRequestBody:
    """The request body, or ``InvalidRequestError`` (400) saying what is wrong and what is expected."""
    return _decode(raw, PullRequestBody, "/pull_weights", EXPECTED)


def parse_live_body(raw: bytes) -> LiveRequestBody:
    """The ``/update_weights_from_pulled`` body, or ``InvalidRequestError`` (400)."""
    return _decode(raw, LiveRequestBody, "/update_weights_from_pulled", LIVE_EXPECTED)
