"""Delta encodings: a registry of codecs, each turning (old bytes, new bytes) into one payload
and applying a payload to a region of the local checkpoint in place.

- ``xor`` (upstream, ``xor.py``): payload = zstd(new XOR old) over the whole tensor; an involution.
- ``overwrite`` (upstream, ``overwrite.py``): zstd(u32 count, count ascending u32 byte positions,
  count new bytes).
- ``sparse-v1`` (ours, opt-in for upstream readers): see ``sparse_v1``.
- ``sparse-v2`` (ours): the changed elements, Rice / Exp-Golomb or range coded per class of the
  old element's exponent; see ``sparse_v2`` (its compiled coder, ``_sparse2_rc.c``, beside it).

Beside the codecs: ``base`` (the protocols every codec meets), ``zstd_frames`` (the bounded frame
reader every payload goes through), ``positions`` (a chain's changed elements, from the payloads)
and ``encoding_choice`` (which encoding a version gets under ``encoding="auto"``). Those two
import the rest of the core; this registry imports only the codecs, so importing it from any
core module makes no circle.
"""

from __future__ import annotations

from ..errors import UnsupportedFormatError
from . import overwrite, sparse_v1, sparse_v2, xor
from .base import (
    SCRATCH,
    UINT_OF_WIDTH,
    ChainCodec,
    Codec,
    DensityCodec,
    Encoded,
    PayloadDensity,
    Scratch,
    SegmentedCodec,
    count_changed,
)
from .overwrite import OverwriteCodec
from .xor import XorCodec, apply_xor_chain

__all__ = [
    "SCRATCH", "UINT_OF_WIDTH", "ChainCodec", "Codec", "DensityCodec", "Encoded", "OverwriteCodec", "PayloadDensity",
    "Scratch", "SegmentedCodec", "UPSTREAM_ENCODINGS", "XorCodec", "apply_xor_chain", "count_changed", "get_codec",
    "register_codec", "supported_encodings",
]  # fmt: skip

_CODECS: dict[str, Codec] = {c.name: c for c in (xor.CODEC, overwrite.CODEC, sparse_v1.CODEC, sparse_v2.CODEC)}
UPSTREAM_ENCODINGS = ("xor", "overwrite")


def register_codec(codec: Codec) -> None:
    _CODECS[codec.name] = codec


def supported_encodings() -> list[str]:
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    try:
        return _CODECS[name]
    except KeyError:
        raise UnsupportedFormatError("delta_encoding", name, sorted(_CODECS)) from None
