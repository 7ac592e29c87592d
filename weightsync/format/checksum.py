"""Checksum registry: the digest of a tensor's complete new bytes, as lowercase hex.

``xxh3-128`` (default, 32 hex digits), ``blake3`` (64 hex digits, optional package imported
lazily), ``adler32`` (8 hex digits, zlib's adler32 seeded with 1). Every hasher takes
incremental ``update(buffer)`` so apply can hash chunk by chunk while the chunk is in cache.
"""

from __future__ import annotations

import threading
import zlib
from typing import Callable, Protocol

from ..errors import ChecksumUnavailableError, UnsupportedFormatError


class Hasher(Protocol):
    # blake3's update returns the hasher (for chaining), the others None; callers ignore it
    def update(self, data, /) -> object: ...
    def hexdigest(self) -> str: ...


class _Adler32:
    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 1

    def update(self, data) -> None:
        self._value = zlib.adler32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _xxh3_128() -> Hasher:
    import xxhash

    return xxhash.xxh3_128()


def _blake3() -> Hasher:
    try:
        import blake3
    except ImportError:
        raise ChecksumUnavailableError("blake3", "blake3") from None
    return blake3.blake3()


_HASHERS: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": _xxh3_128,
    "blake3": _blake3,
    "adler32": _Adler32,
}
DIGEST_HEX_LEN = {"xxh3-128": 32, "blake3": 64, "adler32": 8}
DEFAULT_CHECKSUM = "xxh3-128"


def supported_checksums() -> list[str]:
    return sorted(_HASHERS)


class _Count:
    """Tensor verifications begun in this process: what a pull costs in hashing, counted (not
    timed)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._n += 1

    @property
    def value(self) -> int:
        return self._n


_begun = _Count()


def digests_begun() -> int:
    """How many tensor verifications this process has begun (``tensor_hasher`` calls)."""
    return _begun.value


def _make_hasher(checksum_format: str) -> Hasher:
    try:
        factory = _HASHERS[checksum_format]
    except KeyError:
        raise UnsupportedFormatError("checksum_format", checksum_format, supported_checksums()) from None
    return factory()


def require_checksum(checksum_format: str) -> None:
    """Fail now (unknown name, missing package) rather than mid-apply; begins no digest."""
    _make_hasher(checksum_format)


def new_hasher(checksum_format: str) -> Hasher:
    return _make_hasher(checksum_format)


def tensor_hasher(checksum_format: str) -> Hasher:
    """A hasher for verifying one tensor's bytes, counted (``digests_begun``)."""
    hasher = _make_hasher(checksum_format)
    _begun.add()
    return hasher


def digest(checksum_format: str, data) -> str:
    h = new_hasher(checksum_format)
    h.update(data)
    return h.hexdigest()


def is_well_formed_digest(checksum_format: str, value: object) -> bool:
    n = DIGEST_HEX_LEN.get(checksum_format)
    return (
        isinstance(value, str)
        and n is not None
        and len(value) == n
        and all(c in "0123456789abcdef" for c in value)
    )
