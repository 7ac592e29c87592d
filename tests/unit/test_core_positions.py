"""Changed element positions of a chain, decoded from the payloads (``weightsync.puller.positions``).

The reference is an independent numpy diff of the exact tensors each version holds; every
encoding, element widths 1/2/4, a chain mixing encodings, a full version in the chain, and the
held version (marker vs verified note).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from core_support import mutate, random_tensors, write_hf_checkpoint
from weightsync import Publisher, pull
from weightsync.errors import PositionsUnavailableError
from weightsync.format.layout import format_version
from weightsync.puller.positions import held_version, iter_changed_elements, plan_change_chain

SIZES = {
    "a.weight": ("float16", (64, 48)),
    "b.weight": ("float32", (300,)),
    "c.bytes": ("uint8", (1000,)),
    "d.untouched": ("float16", (32,)),
}


def _changed(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    o = old.reshape(-1).view(np.uint8).reshape(old.size, -1)
    n = new.reshape(-1).view(np.uint8).reshape(new.size, -1)
    return np.flatnonzero(np.any(o != n, axis=1)).astype(np.int64)


def _chain(tmp_path, encodings, *, full_at=None, density=0.03):
    rng = np.random.default_rng(7)
    versions = [random_tensors(rng, SIZES)]
    seed = str(tmp_path / "seed")
    write_hf_checkpoint(seed, versions[0], shards=2)
    source = str(tmp_path / "source")
    for v, enc in enumerate(encodings, start=1):
        versions.append(mutate(versions[-1], rng, density, names=["a.weight", "b.weight", "c.bytes"]))
        pub = Publisher(source, encoding=enc, template_dir=seed)
        try:
            pub.seed_snapshot(versions[-2], version=v - 1)
            pub.publish(v, versions[-1], full=(v == full_at) or None if full_at else None)
        finally:
            pub.close()
    local = str(tmp_path / "local")
    pull(local, seed, source, len(encodings))
    return seed, source, local, versions


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "sparse-v1", "sparse-v2"])
def test_positions_of_one_delta_equal_an_independent_diff(tmp_path, encoding, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "2")  # one-class segments: plain positions
    _, source, local, versions = _chain(tmp_path, [encoding])
    chain, indexes = plan_change_chain(source, 0, 1)
    got = {name: pos for name, _, pos in iter_changed_elements(local, source, chain, indexes)}
    assert "d.untouched" not in got
    for name in ("a.weight", "b.weight", "c.bytes"):
        want = _changed(versions[0][name], versions[1][name])
        assert want.size > 0
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_positions_of_a_mixed_chain_are_the_union_over_its_versions(tmp_path):
    _, source, local, versions = _chain(tmp_path, ["xor", "sparse-v1", "overwrite"])
    chain, _ = plan_change_chain(source, 1, 3)
    assert chain.deltas == [2, 3] and chain.is_deltas_only
    got = {name: pos for name, _, pos in iter_changed_elements(local, source, chain)}
    for name in ("a.weight", "b.weight", "c.bytes"):
        want = np.union1d(_changed(versions[1][name], versions[2][name]), _changed(versions[2][name], versions[3][name]))
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_skipped_tensors_are_not_decoded_and_the_others_are_unchanged(tmp_path, monkeypatch):
    import weightsync.puller.positions as positions

    _, source, local, versions = _chain(tmp_path, ["sparse-v1"])
    chain, indexes = plan_change_chain(source, 0, 1)
    decoded: list[str] = []
    real = positions.changed_elements
    monkeypatch.setattr(positions, "changed_elements", lambda *a: decoded.append(a[-1]) or real(*a))
    got = {name: pos for name, _, pos in iter_changed_elements(local, source, chain, indexes, skip=frozenset({"b.weight"}))}
    assert "b.weight" not in got and "b.weight" not in decoded
    for name in ("a.weight", "c.bytes"):
        np.testing.assert_array_equal(got[name], _changed(versions[0][name], versions[1][name]), err_msg=name)


def test_a_window_returns_every_change_inside_it_and_decodes_only_the_segments_it_overlaps(tmp_path, monkeypatch):
    import weightsync.codecs.sparse_v1 as codec_sparse
    import weightsync.puller.positions as positions

    monkeypatch.setattr(codec_sparse.SparseCodec, "seg_elements", codec_sparse.MIN_SEG_ELEMENTS)
    rng = np.random.default_rng(3)
    seg = codec_sparse.MIN_SEG_ELEMENTS
    old = rng.standard_normal(6 * seg).astype(np.float16)
    new = old.copy()
    changed = np.sort(rng.choice(old.size, 3000, replace=False))
    new[changed] += np.float16(1)
    payload = codec_sparse.SparseCodec().encode(old.view(np.uint8), new.view(np.uint8), 2, 1, "t").payload
    changed = _changed(old, new)
    window = (2 * seg + 17, 4 * seg - 5)  # inside segments 2 and 3 of 6
    got = positions.changed_elements("sparse-v1", payload, old.nbytes, 2, "t", window)
    inside = changed[(changed >= window[0]) & (changed <= window[1])]
    assert inside.size and np.isin(inside, got).all()  # every change inside the window
    assert got.min() >= 2 * seg and got.max() < 4 * seg  # nothing from segments 0, 1, 4 and 5
    np.testing.assert_array_equal(got, changed[(changed >= 2 * seg) & (changed < 4 * seg)])
    np.testing.assert_array_equal(positions.changed_elements("sparse-v1", payload, old.nbytes, 2, "t"), changed)


def test_a_full_version_in_the_chain_has_no_positions(tmp_path):
    _, source, local, _ = _chain(tmp_path, ["xor", "xor", "xor"], full_at=2)
    chain, _ = plan_change_chain(source, 0, 3)
    assert chain.full_version == 2 and not chain.is_deltas_only
    with pytest.raises(PositionsUnavailableError, match="v2 is a full version"):
        list(iter_changed_elements(local, source, chain))


def test_held_version_reads_the_marker_then_a_live_verified_note(tmp_path):
    _, source, local, _ = _chain(tmp_path, ["xor"])
    held = held_version(local)
    assert held is not None and held.version == 1 and held.how == "marker"
    assert held.source_dir == os.path.realpath(source)
    os.unlink(os.path.join(local, ".weight_sync", "state.json"))
    assert held_version(local) is None
    note = os.path.join(local, ".weight_sync", "verified.json")
    with open(note, "w") as f:
        json.dump({"version": format_version(1), "source_dir": source, "pid": os.getpid()}, f)
    held = held_version(local)
    assert held is not None and held.version == 1 and held.how == "verified note"
    with open(note, "w") as f:
        json.dump({"version": format_version(1), "source_dir": source, "pid": 2**22 + 12345}, f)
    assert held_version(local) is None  # the pull that wrote it is gone: its pages may be torn


def test_held_version_sees_a_deferred_flush_that_finishes_between_its_reads(tmp_path, monkeypatch):
    """The flush writes the marker, then removes its note: a reader that found no marker, then no
    note, must look at the marker again rather than call a verified checkpoint unverified. The
    race is forced here by finishing the flush inside the reader's first marker read."""
    from weightsync.puller import positions

    _, _, local, _ = _chain(tmp_path, ["xor"])
    marker = os.path.join(local, ".weight_sync", "state.json")
    note = os.path.join(local, ".weight_sync", "verified.json")
    with open(marker, "rb") as f:
        marker_bytes = f.read()
    os.unlink(marker)
    with open(note, "w") as f:
        json.dump({"version": format_version(1), "source_dir": "x", "pid": os.getpid()}, f)
    real = positions.read_applied_state
    calls = []

    def read_then_finish_the_flush(path):
        state = real(path)
        if not calls:  # the flush finishes right after the reader's first look
            with open(marker, "wb") as f:
                f.write(marker_bytes)
            os.unlink(note)
        calls.append(state)
        return state

    monkeypatch.setattr(positions, "read_applied_state", read_then_finish_the_flush)
    held = held_version(local)
    assert calls[0] is None  # the first look found no marker
    assert held is not None and (held.version, held.how) == (1, "marker")


def test_held_version_names_the_run_and_seed_the_marker_or_note_records(tmp_path):
    from weightsync.puller.identity import seed_fingerprint
    from weightsync.format.manifest import read_run_id
    from weightsync.format.layout import run_path

    seed, source, local, _ = _chain(tmp_path, ["xor"])
    held = held_version(local)
    assert held.run == read_run_id(run_path(source)) and held.run is not None
    assert held.seed == seed_fingerprint(seed)
    os.unlink(os.path.join(local, ".weight_sync", "state.json"))
    with open(os.path.join(local, ".weight_sync", "verified.json"), "w") as f:
        json.dump({"version": format_version(1), "source_dir": source, "pid": os.getpid(), "run": "r9", "seed": "s9"}, f)
    held = held_version(local)
    assert (held.how, held.run, held.seed) == ("verified note", "r9", "s9")


def test_sparse_v2_with_several_magnitude_classes_has_no_positions_without_the_old_bytes(tmp_path, monkeypatch):
    from weightsync import codecs
    from weightsync.codecs.sparse_v2 import Sparse2Codec

    monkeypatch.setitem(codecs._CODECS, "sparse-v2", Sparse2Codec(class_min_saving=0.0, bitstream=2))
    rng = np.random.default_rng(3)
    old = np.where(rng.random(16384) < 0.5, 1e-3, 10.0).astype(np.float16) * rng.random(16384).astype(np.float16)
    new = old.copy()
    small = np.flatnonzero(np.abs(old) < 0.01)
    hit = rng.choice(small, size=small.size // 3, replace=False)
    new[hit] = (new[hit].astype(np.float32) * 1.5).astype(np.float16)  # only small weights move
    seed, source = str(tmp_path / "seed"), str(tmp_path / "source")
    write_hf_checkpoint(seed, {"w": old})
    pub = Publisher(source, encoding="sparse-v2", template_dir=seed)
    try:
        pub.seed_snapshot({"w": old}, version=0)
        pub.publish(1, {"w": new})
    finally:
        pub.close()
    local = str(tmp_path / "local")
    pull(local, seed, source, 1)
    chain, _ = plan_change_chain(source, 0, 1)
    with pytest.raises(PositionsUnavailableError, match="magnitude classes of the old bytes"):
        list(iter_changed_elements(local, source, chain))


def test_range_coded_sparse_v2_has_no_positions_without_the_old_bytes(tmp_path, monkeypatch):
    """Bitstream 3 decides every element in the context of its old bytes."""
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "3")
    _, source, local, _ = _chain(tmp_path, ["sparse-v2"])
    chain, _ = plan_change_chain(source, 0, 1)
    with pytest.raises(PositionsUnavailableError, match="range coded in the context of the old bytes"):
        list(iter_changed_elements(local, source, chain))
