"""The body of ``POST /pull_weights``, parsed strictly. No sglang here.

Why strict: the core refuses booleans and strings as versions on purpose, and a lax schema
(pydantic's default) turned ``"target_version": "1"`` and ``true`` into a pull of version 1.
The body is decoded by msgspec against a typed Struct: every field has exactly its JSON type,
anything else is a 400 that names the field, and the body's size is bounded before decoding.
Unknown fields are ignored (older and newer clients send the same three).
"""

from __future__ import annotations

import msgspec

from weightsync.errors import InvalidRequestError

from .results import shorten

MAX_BODY_BYTES = 1 << 20
EXPECTED = '{"local_checkpoint_dir": str, "source_dir": str, "target_version": int}'


class PullRequestBody(msgspec.Struct, frozen=True):
    """What a caller sends: bring ``local_checkpoint_dir`` to ``target_version`` from ``source_dir``."""

    local_checkpoint_dir: str
    source_dir: str
    target_version: int


def parse_pull_body(raw: bytes) -> PullRequestBody:
    """The request body, or ``InvalidRequestError`` (400) saying what is wrong and what is expected."""
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequestError(
            f"invalid /pull_weights request: the body has {len(raw)} bytes, more than the "
            f"{MAX_BODY_BYTES} allowed. Expected {EXPECTED}"
        )
    try:
        return msgspec.json.decode(raw, type=PullRequestBody)
    except msgspec.ValidationError as exc:
        problem = str(exc)
    except msgspec.DecodeError as exc:
        problem = f"the body is not JSON ({exc})"
    raise InvalidRequestError(f"invalid /pull_weights request: {shorten(problem, 500)}. Expected {EXPECTED}")
