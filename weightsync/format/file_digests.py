"""The index's digest of each payload file (ours, FORMAT.md "The index"): ``file_digests``.

A tensor digest covers a tensor's final bytes, so a host can check it only after it applied a
payload. A cache or a peer that hands out a shard file needs a digest of the bytes it hands out,
so a stale or torn copy is caught before anything is applied and fetched again from the origin.
The publisher records, at commit, for every file its ``weight_map`` names::

    "file_digests": {"<shard file>": {"nbytes": 1234, "xxh3-128": "<32 lowercase hex>"}}

xxh3-128 because the threat is a stale or torn copy, not an adversary (per-tensor digests stay
the end-to-end proof), and it hashes at memory speed. Upstream readers ignore the key; indexes
without it (upstream writers, older publishers) are read as before.
"""

from __future__ import annotations

import json
import os
import re

import msgspec
import xxhash

FILE_DIGESTS_KEY = "file_digests"
FILE_DIGEST_ALGORITHM = "xxh3-128"
_HEX32 = re.compile(r"[0-9a-f]{32}")
_CHUNK = 8 << 20


class FileDigest(msgspec.Struct, frozen=True):
    nbytes: int
    digest: str  # xxh3-128, lowercase hex


def digest_file(path: str) -> FileDigest:
    h = xxhash.xxh3_128()
    n = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return FileDigest(n, h.hexdigest())


def with_file_digests(directory: str, index: bytes) -> bytes:
    """``index`` (JSON bytes) with ``file_digests`` of every file its ``weight_map`` names, read
    from ``directory``. Deterministic: a retried commit over the same files writes the same bytes."""
    obj = json.loads(index)
    files = sorted(set((obj.get("weight_map") or {}).values()))
    entries = {}
    for name in files:
        d = digest_file(os.path.join(directory, name))
        entries[name] = {"nbytes": d.nbytes, FILE_DIGEST_ALGORITHM: d.digest}
    obj[FILE_DIGESTS_KEY] = entries
    return json.dumps(obj, indent=1).encode()


def read_file_digests(index_obj: object) -> dict[str, FileDigest]:
    """The well-formed entries of an index's ``file_digests`` (parsed JSON); a malformed entry
    is left out, so that file is read as if the index named no digest (from the origin)."""
    out: dict[str, FileDigest] = {}
    raw = index_obj.get(FILE_DIGESTS_KEY) if isinstance(index_obj, dict) else None
    if not isinstance(raw, dict):
        return out
    for name, entry in raw.items():
        if not isinstance(name, str) or not isinstance(entry, dict):
            continue
        n, d = entry.get("nbytes"), entry.get(FILE_DIGEST_ALGORITHM)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and isinstance(d, str) and _HEX32.fullmatch(d):
            out[name] = FileDigest(n, d)
    return out


__all__ = ["FILE_DIGESTS_KEY", "FILE_DIGEST_ALGORITHM", "FileDigest", "digest_file", "with_file_digests", "read_file_digests"]
