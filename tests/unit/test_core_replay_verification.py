"""After a reseed, the replay verifies each tensor once, against its newest digest (the digest
covers the complete final bytes, whatever the encodings; FORMAT.md, Notes). Only a replay that
still fails replays once more version by version, to name the bad version. Hashing is counted
through ``checksum.digests_begun``, never timed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.format.checksum import digests_begun
from weightsync.codecs import supported_encodings

from core_support import assert_checkpoint_is, flip_local_byte, marker_version, mutate, random_tensors, raw_header, shard_path, tensor_bytes, write_hf_checkpoint

# An upstream-style chain: no side anchors, nothing pruned, so a pull replays every delta.
NO_ANCHORS = dict(anchor_fraction=0, anchor_max_deltas=0, prune=False)

SIZES = {f"w{i}": ("float32", (16, 16)) for i in range(5)} | {"only5": ("int16", (64,))}
N = 12


def publish_chain(root: str, encoding: str):
    rng = np.random.default_rng(6)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    tensors = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, tensors)
    expected = {0: tensor_bytes(tensors)}
    pub = Publisher(source, encoding=encoding, workers=1, **NO_ANCHORS)
    pub.seed_snapshot(tensors, version=0)
    for v in range(1, N + 1):
        names = [n for n in tensors if n != "only5"] + (["only5"] if v == 5 else [])
        tensors = mutate(tensors, rng, 0.05, names=names)
        assert pub.publish(v, tensors, full=False).kind == "delta"
        expected[v] = tensor_bytes(tensors)
    pub.close()
    return seed, source, expected


@pytest.mark.parametrize("encoding", supported_encodings())
def test_replay_after_a_reseed_hashes_each_tensor_once_not_once_per_version(fast_tmp_path, encoding):
    seed, source, expected = publish_chain(str(fast_tmp_path), encoding)
    local = str(fast_tmp_path / "local")
    pull(local, seed, source, N - 1)
    flip_local_byte(local, "w0", 3)  # v12 changes w0: the pull verifies it and finds the flip
    before = digests_begun()
    result = pull(local, seed, source, N)
    assert result.reseeded and result.deltas_applied == N
    changed_by_v12 = len(SIZES) - 1
    changed_by_chain = len(SIZES)  # "only5" too, through v5
    # first attempt (v12 only) + one folded replay of v1..v12; per-version verification would
    # have cost sum over the 12 versions of the tensors each changes (61 here)
    assert digests_begun() - before == changed_by_v12 + changed_by_chain
    assert marker_version(local) == N
    assert_checkpoint_is(local, expected[N])


def corrupt_digest(source: str, version: int, tensor: str) -> None:
    """Rewrite one digest in a shard's __metadata__ in place (same length, different value)."""
    path = shard_path(os.path.join(source, f"weight_v{version:06d}"), tensor)
    _, header = raw_header(path)
    good = header["__metadata__"][tensor]
    bad = ("0" if good[0] != "0" else "1") + good[1:]
    with open(path, "rb") as f:
        raw = f.read()
    assert raw.count(good.encode()) == 1
    with open(path, "wb") as f:
        f.write(raw.replace(good.encode(), bad.encode()))


@pytest.mark.parametrize("encoding", supported_encodings())
def test_a_replay_that_still_fails_names_the_bad_version_in_a_diagnostic_pass(fast_tmp_path, encoding):
    seed, source, expected = publish_chain(str(fast_tmp_path), encoding)
    corrupt_digest(source, 5, "only5")  # only v5 changes it: v12's pull checks v5's digest
    local = str(fast_tmp_path / "local")
    pull(local, seed, source, 4)
    before = digests_begun()
    with pytest.raises(errors.ChecksumMismatchError, match=r"version 5: 1 tensor\(s\) failed") as e:
        pull(local, seed, source, N)
    assert e.value.version == 5 and [m[0] for m in e.value.mismatches] == ["only5"]
    assert marker_version(local) is None  # never names bytes that did not verify
    # first attempt (v5..v12) + folded replay (v1..v12) + the diagnostic, version by version up to v5
    per_version = 5 * (len(SIZES) - 1) + 1
    assert digests_begun() - before == len(SIZES) + len(SIZES) + per_version


def test_a_corrupt_intermediate_digest_overwritten_by_later_versions_does_not_fail_the_pull(fast_tmp_path):
    """The digest of v12 covers w0's final bytes: a wrong digest at v5 for a tensor v6..v12
    change again cannot make those bytes wrong, and the folded pull never reads it."""
    seed, source, expected = publish_chain(str(fast_tmp_path), "xor")
    corrupt_digest(source, 5, "w0")
    local = str(fast_tmp_path / "local")
    result = pull(local, seed, source, N)
    assert not result.reseeded
    assert_checkpoint_is(local, expected[N])
