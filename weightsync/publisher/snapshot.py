"""The publisher's snapshot: one rank's tensors as of the newest version it wrote.

The next delta diffs against these bytes. Each entry owns a copy of one tensor's bytes, its
dtype and shape, and the digest of those bytes once a publish computed it (a version that
leaves the tensor unchanged carries the digest instead of hashing again). ``version`` is the
version the buffers hold; whether that version is committed is the Publisher's business.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import msgspec
import numpy as np

from .. import progress
from ..errors import PublishError
from ..format.manifest import checkpoint_weight_files
from ..format.safetensors_io import DTYPE_NBYTES, as_byte_view, local_tensor_table

_NP_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
}


class RawTensor(msgspec.Struct, frozen=True):
    """A tensor as bytes: safetensors dtype name, shape, and a C-contiguous buffer."""

    dtype: str
    shape: tuple[int, ...]
    data: object

    def bytes_view(self) -> np.ndarray:
        arr = np.frombuffer(as_byte_view(self.data), dtype=np.uint8)
        return arr


def as_raw(value: "RawTensor | np.ndarray") -> RawTensor:
    if isinstance(value, RawTensor):
        return value
    if isinstance(value, np.ndarray):
        st = _NP_TO_ST.get(value.dtype.name)
        if st is None:
            raise PublishError(f"numpy dtype {value.dtype} has no safetensors name; pass a RawTensor")
        return RawTensor(st, tuple(value.shape), np.ascontiguousarray(value))
    raise PublishError(f"expected a RawTensor or numpy array, got {type(value).__name__}")


class SnapEntry(msgspec.Struct):
    dtype: str
    shape: tuple[int, ...]
    buf: np.ndarray  # uint8, owned
    digest: str | None = None  # of buf in the publisher's checksum, once computed


class EncodeJob(NamedTuple):
    """One tensor of a version: its new bytes and the snapshot entry they replace."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    new: np.ndarray  # uint8; ``snap.buf`` itself when the caller did not pass the tensor
    snap: SnapEntry

    @property
    def untouched(self) -> bool:
        return self.new is self.snap.buf


class Snapshot:
    """name -> SnapEntry, and the version those bytes are."""

    def __init__(self) -> None:
        self.entries: dict[str, SnapEntry] = {}
        self.version = 0

    def seed(self, tensors: Mapping[str, "RawTensor | np.ndarray"], version: int) -> None:
        bar = progress.stage("publish: snapshot of the base", sum(as_raw(v).bytes_view().nbytes for v in tensors.values()))
        for name, value in tensors.items():
            raw = as_raw(value)
            src = raw.bytes_view()
            check_nbytes(name, raw, src)
            entry = self.entries.get(name)
            if entry is None or entry.buf.nbytes != src.nbytes:
                entry = SnapEntry(raw.dtype, raw.shape, np.empty(src.nbytes, np.uint8))
                self.entries[name] = entry
            entry.dtype, entry.shape, entry.digest = raw.dtype, raw.shape, None
            np.copyto(entry.buf, src)
            bar.advance(src.nbytes)
        self.version = version

    def nbytes(self) -> int:
        return sum(e.buf.nbytes for e in self.entries.values())

    def names(self) -> list[str]:
        return list(self.entries)

    def jobs(self, tensors: Mapping[str, "RawTensor | np.ndarray"]) -> list[EncodeJob]:
        """One job per snapshot tensor; those not passed carry their snapshot bytes."""
        unknown = [n for n in tensors if n not in self.entries]
        if unknown:
            raise PublishError(
                f"tensors {unknown[:5]} are not in the snapshot; seed the snapshot with every tensor this rank owns"
            )
        jobs = []
        for name, value in tensors.items():
            raw = as_raw(value)
            new = raw.bytes_view()
            snap = self.entries[name]
            check_nbytes(name, raw, new)
            if (raw.dtype, tuple(raw.shape)) != (snap.dtype, tuple(snap.shape)):
                raise PublishError(
                    f"tensor {name}: got {raw.dtype} {list(raw.shape)}, the snapshot holds "
                    f"{snap.dtype} {list(snap.shape)}; dtype and shape must not change between versions"
                )
            jobs.append(EncodeJob(name, raw.dtype, tuple(raw.shape), new, snap))
        for name, snap in self.entries.items():
            if name not in tensors:
                jobs.append(EncodeJob(name, snap.dtype, snap.shape, snap.buf, snap))
        return jobs

    def differing_bytes(self, tensors: "list[tuple[str, np.ndarray]]") -> list[str]:
        """Names whose bytes (uint8) differ from the snapshot's (a retry must pass the same bytes)."""
        out = []
        for name, new in tensors:
            buf = self.entries[name].buf
            if new is not buf and not np.array_equal(new, buf):
                out.append(name)
        return out

    def advance(self, version: int, changed: "list[tuple[str, np.ndarray, str | None]]") -> None:
        """Take a written version's bytes: (name, new bytes, digest or None) of each tensor it changed."""
        for name, new, digest in changed:
            entry = self.entries[name]
            if new is not entry.buf:
                np.copyto(entry.buf, new)
            entry.digest = digest
        self.version = version


def check_nbytes(name: str, raw: RawTensor, data: np.ndarray) -> None:
    if raw.dtype not in DTYPE_NBYTES:
        raise PublishError(f"tensor {name}: unknown dtype {raw.dtype!r}; expected one of {sorted(DTYPE_NBYTES)}")
    expected = int(np.prod(raw.shape, dtype=np.int64)) * DTYPE_NBYTES[raw.dtype]
    if data.nbytes != expected:
        raise PublishError(
            f"tensor {name}: {data.nbytes} bytes given, {raw.dtype} x {list(raw.shape)} needs {expected}"
        )


def read_checkpoint_tensors(checkpoint_dir: str, names: "set[str] | None" = None) -> dict[str, RawTensor]:
    """The tensors of an HF checkpoint (all, or those in ``names``) as RawTensor (reads the bytes)."""
    table = local_tensor_table(checkpoint_dir, checkpoint_weight_files(checkpoint_dir))
    wanted = {name: pe for name, pe in table.items() if names is None or name in names}
    bar = progress.stage(f"read {os.path.basename(os.path.normpath(checkpoint_dir))}", sum(e.nbytes for _, e in wanted.values()))
    out = {}
    for name, (p, e) in wanted.items():
        out[name] = RawTensor(e.dtype, e.shape, np.fromfile(p, dtype=np.uint8, count=e.nbytes, offset=e.offset))
        bar.advance(e.nbytes)
    return out


__all__ = ["RawTensor", "as_raw", "Snapshot", "SnapEntry", "EncodeJob", "read_checkpoint_tensors"]
