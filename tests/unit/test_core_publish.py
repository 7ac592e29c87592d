"""Publish-side behaviour: ranks, delta/full choice, pruning, commit order, filesystems without
rename, and the publisher's own refusals. Every published version is pulled back and compared."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.format.layout import list_versions

from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {
    "embed": ("float32", (64, 16)),
    "layers.0.w": ("float32", (32, 32)),
    "layers.1.w": ("float32", (32, 32)),
    "norm": ("float32", (16,)),
    "bias": ("int16", (5,)),
}


class Run:
    """A seed checkpoint and a source dir; ``expected[v]`` is the bytes of version v."""

    def __init__(self, root: str, rng: np.random.Generator):
        self.root, self.rng = root, rng
        self.seed, self.source = os.path.join(root, "seed"), os.path.join(root, "src")
        self.tensors = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.tensors[0])
        self.expected = [tensor_bytes(self.tensors[0])]
        self._locals = 0

    def next_tensors(self, density: float = 0.02, names=None) -> dict[str, np.ndarray]:
        new = mutate(self.tensors[-1], self.rng, density, names=names)
        self.tensors.append(new)
        self.expected.append(tensor_bytes(new))
        return new

    def vdir(self, v: int) -> str:
        return os.path.join(self.source, f"weight_v{v:06d}")

    def index(self, v: int) -> dict:
        with open(os.path.join(self.vdir(v), INDEX)) as f:
            return json.load(f)

    def fresh_local(self) -> str:
        self._locals += 1
        return os.path.join(self.root, f"local{self._locals}")

    def assert_pulls(self, v: int, local: str | None = None) -> None:
        local = local or self.fresh_local()
        assert pull(local, self.seed, self.source, v).applied_version == v
        assert_checkpoint_is(local, self.expected[v])


@pytest.fixture
def run(fast_tmp_path, rng) -> Run:
    return Run(str(fast_tmp_path), rng)


def split(tensors, owners, rank):
    return {n: a for n, a in tensors.items() if owners[n] == rank}


# --- several ranks -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["delta", "full"])
def test_two_ranks_commit_one_index_whose_weight_map_is_the_union(run, kind):
    owners = {n: i % 2 for i, n in enumerate(sorted(SIZES))}
    pubs = [Publisher(run.source, encoding="xor", rank=r, world_size=2, workers=1) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot(split(run.tensors[0], owners, r))
    new = run.next_tensors(0.05)
    prepared = [pub.prepare(1, split(new, owners, r)) for r, pub in enumerate(pubs)]
    totals = sum(p.delta_nbytes for p in prepared), sum(p.full_nbytes for p in prepared)
    kinds = {pub.choose_kind(1, *totals) for pub in pubs}
    assert len(kinds) == 1  # same totals on every rank: the same answer (here forced to `kind`)
    manifests = [pickle.loads(pickle.dumps(pub.write(p, kind))) for pub, p in zip(pubs, prepared)]  # cross-process
    assert not os.path.exists(os.path.join(run.vdir(1), INDEX))  # nothing is published before the commit
    pubs[0].commit(1, kind, manifests)
    index = run.index(1)
    stem = "delta" if kind == "delta" else "model"
    expected_map = {n: f"{stem}-r{owners[n]:05d}-00001" for n in SIZES}
    if kind == "delta":
        expected_map = {n: f for n, f in expected_map.items() if run.expected[1][n] != run.expected[0][n]}
    # Each shard is named by its rank and part, then a hash of its content (no other writer's bytes get the name).
    assert {n: f[: -len("-0123456789abcdef.safetensors")] for n, f in index["weight_map"].items()} == expected_map
    assert all(re.fullmatch(rf"{stem}-r0000[01]-00001-[0-9a-f]{{16}}\.safetensors", f) for f in index["weight_map"].values())
    assert set(index["weight_map"]) == set(manifests[0].weight_map) | set(manifests[1].weight_map)
    run.assert_pulls(1)
    for pub in pubs:
        pub.close()


def test_commit_refuses_a_tensor_written_by_two_ranks(run):
    pubs = [Publisher(run.source, encoding="xor", rank=r, world_size=2, workers=1) for r in (0, 1)]
    for pub in pubs:
        pub.seed_snapshot({"norm": run.tensors[0]["norm"]})  # both ranks claim "norm"
    new = run.next_tensors(1.0, names=["norm"])
    manifests = [pub.write(pub.prepare(1, {"norm": new["norm"]}), "delta") for pub in pubs]
    with pytest.raises(errors.PublishError, match=r"tensors \['norm'\] were written by two ranks; each tensor needs one owner"):
        pubs[0].commit(1, "delta", manifests)
    assert not os.path.exists(os.path.join(run.vdir(1), INDEX))


def test_commit_refuses_manifests_of_another_version_or_kind(run):
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    manifest = pub.write(pub.prepare(1, run.next_tensors()), "delta")
    with pytest.raises(errors.PublishError, match=r"manifest of rank 0 is for v1 \(delta\), not v1 \(full\)"):
        pub.commit(1, "full", [manifest])
    with pytest.raises(errors.PublishError, match=r"is for v1 \(delta\), not v2 \(delta\)"):
        pub.commit(2, "delta", [manifest])


def test_single_rank_publish_refuses_a_multi_rank_publisher(run):
    pub = Publisher(run.source, rank=1, world_size=2, workers=1)
    with pytest.raises(errors.PublishError, match=r"publish\(\) is for one rank"):
        pub.publish(1, {})
    with pytest.raises(errors.PublishError, match=r"rank 2 is not in \[0, 2\)"):
        Publisher(run.source, rank=2, world_size=2)


# --- delta or full --------------------------------------------------------------------------------


def test_dense_change_falls_back_to_a_full_version(run):
    pub = Publisher(run.source, encoding="xor", fallback_fraction=0.5, workers=1)
    pub.seed_snapshot(run.tensors[0])
    sparse = pub.publish(1, run.next_tensors(0.01))
    dense = pub.publish(2, run.next_tensors(1.0))  # random bytes: zstd cannot shrink them
    assert sparse.kind == "delta" and sparse.wire_nbytes < 0.5 * sparse.full_nbytes
    assert dense.kind == "full"
    assert "delta would be" in dense.reason and "threshold 50%" in dense.reason
    assert "delta_encoding" not in run.index(2)["metadata"]
    assert run.index(2)["metadata"]["version"] == "000002"
    for v in (1, 2):
        run.assert_pulls(v)


def test_full_every_n_versions_publishes_anchors_on_schedule(run):
    pub = Publisher(run.source, encoding="overwrite", full_every=3, workers=1)
    pub.seed_snapshot(run.tensors[0])
    kinds = {}
    for v in range(1, 8):
        result = pub.publish(v, run.next_tensors(0.01))
        kinds[v] = result.kind
        if result.kind == "full":
            assert result.reason == "every 3 versions"
    assert [v for v, k in kinds.items() if k == "full"] == [3, 6]
    local = run.fresh_local()
    for v in range(1, 8):
        run.assert_pulls(v, local)  # forward one by one through the anchors


def test_delta_with_nothing_changed_is_published_and_advances_the_marker(run):
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors(0.02))
    run.tensors.append(run.tensors[-1])
    run.expected.append(run.expected[-1])
    result = pub.publish(2, run.tensors[-1])
    assert result.kind == "delta" and result.changed_bytes == 0
    assert run.index(2)["weight_map"] == {}
    local = run.fresh_local()
    run.assert_pulls(1, local)
    run.assert_pulls(2, local)
    assert marker_version(local) == 2


def test_tensors_left_out_of_a_publish_carry_their_previous_bytes(run):
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    new = run.next_tensors(0.1, names=["norm"])
    result = pub.publish(1, {"norm": new["norm"]})
    assert set(run.index(1)["weight_map"]) == {"norm"}
    assert result.total_elements == sum(a.size for a in new.values())
    pub.publish(2, run.next_tensors(1.0), full=True)  # a full version holds every tensor
    assert set(run.index(2)["weight_map"]) == set(SIZES)
    run.assert_pulls(1)
    run.assert_pulls(2)


def test_seed_snapshot_from_a_checkpoint_equals_the_tensors(run):
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot_from_checkpoint(run.seed)
    assert sorted(pub.snapshot_names()) == sorted(SIZES)
    result = pub.publish(1, run.next_tensors(0.01, names=["bias"]))
    assert result.kind == "delta" and set(run.index(1)["weight_map"]) == {"bias"}
    run.assert_pulls(1)


def test_full_versions_carry_the_template_files_and_deltas_do_not(run):
    pub = Publisher(run.source, encoding="xor", template_dir=run.seed, full_every=2, workers=1)
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors())
    pub.publish(2, run.next_tensors())
    files1 = sorted(os.listdir(run.vdir(1)))
    assert len(files1) == 2 and files1[0].startswith("delta-r00000-00001-") and files1[1] == INDEX
    files2 = sorted(os.listdir(run.vdir(2)))
    assert "config.json" in files2 and "tokenizer.json" in files2 and "model.safetensors" not in files2
    run.assert_pulls(2)


def test_zero_size_tensors_publish_and_pull(run):
    """A tensor with a zero in its shape (an empty bias, a pruned head) is legal safetensors."""
    shapes = {"empty2d": np.zeros((0, 3), np.float32), "empty1d": np.zeros(0, np.int16), "w": np.arange(6, dtype=np.float32)}
    write_hf_checkpoint(run.seed, shapes)
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(shapes)
    new = dict(shapes, w=shapes["w"] + 1)
    pub.publish(1, new, full=False)
    pub.publish(2, new, full=True)
    for v in (1, 2):
        local = run.fresh_local()
        pull(local, run.seed, run.source, v)
        assert_checkpoint_is(local, tensor_bytes(new))


# --- pruning -------------------------------------------------------------------------------------


def test_pruning_keeps_every_version_a_pull_at_or_past_the_anchor_needs(run):
    pub = Publisher(run.source, encoding="xor", full_every=3, keep_versions=2, workers=1)
    pub.seed_snapshot(run.tensors[0])
    host_behind = run.fresh_local()  # a host that stays at v2 while the trainer moves on
    for v in range(1, 9):
        pub.publish(v, run.next_tensors(0.02))
        if v == 2:
            run.assert_pulls(2, host_behind)
        remaining = list_versions(run.source)
        if v >= 3:  # below the anchor point under the oldest kept version (v-1): gone
            assert min(remaining) == max((u for u in (3, 6) if u <= v - 1), default=1), (v, remaining)
        for u in remaining:  # every remaining dir is published, none half-deleted
            assert os.path.exists(os.path.join(run.vdir(u), INDEX))
    assert list_versions(run.source) == [6, 7, 8]
    for target in (6, 7, 8):
        run.assert_pulls(target)
    run.assert_pulls(8, host_behind)  # seeds from the anchor v6; v1..v5 are not needed


def test_pruning_never_removes_what_keep_versions_protects(run):
    pub = Publisher(run.source, encoding="xor", full_every=4, keep_versions=5, workers=1)
    pub.seed_snapshot(run.tensors[0])
    for v in range(1, 10):
        pub.publish(v, run.next_tensors(0.02))
    # v5..v9 are the newest five; v4 (full) stays because the kept v5..v7 chain from it
    assert list_versions(run.source) == [4, 5, 6, 7, 8, 9]
    for target in (4, 5, 6, 7, 8, 9):
        run.assert_pulls(target)


# --- commit order and failures --------------------------------------------------------------------


def test_index_is_the_last_file_to_appear(run, monkeypatch):
    appeared = []
    real_replace = os.replace

    def recording_replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        appeared.append(os.path.basename(dst))

    monkeypatch.setattr(os, "replace", recording_replace)
    pub = Publisher(run.source, encoding="xor", template_dir=run.seed, workers=1)
    assert appeared == []  # nothing before the first write: a refused publish leaves the source dir as it was
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors())
    pub.publish(2, run.next_tensors(), full=True)
    # The writer lease and the run's identity, once, before any version; then shards, the index last.
    assert appeared[:2] == ["weightsync-writer.json", "weightsync-run.json"]
    appeared = appeared[2:]
    assert appeared[-1] == INDEX and appeared.count(INDEX) == 2
    first = appeared.index(INDEX)
    # v1's delta: the run file records the seed's digests once, before v1's index lands.
    assert [f[:19] for f in appeared[:first]] == ["delta-r00000-00001-", "weightsync-run.json"]
    assert [f[:19] for f in appeared[first + 1 : -1]] == ["model-r00000-00001-"]


def test_failed_index_write_leaves_the_version_unpublished_and_a_commit_retry_publishes_it(run, monkeypatch):
    import weightsync.publisher.publish as publish_mod

    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors())
    local = run.fresh_local()
    run.assert_pulls(1, local)
    real_write_bytes = publish_mod.write_bytes

    def failing_write_bytes(path, data, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    prepared = pub.prepare(2, run.next_tensors())
    manifest = pub.write(prepared, "delta")  # shards are durable
    monkeypatch.setattr(publish_mod, "write_bytes", failing_write_bytes)
    with pytest.raises(OSError, match="No space left"):
        pub.commit(2, "delta", [manifest])
    # A reader sees "not ready", and its local checkpoint stays at v1.
    with pytest.raises(errors.IndexMissingError, match=r"version 2 .* has no model.safetensors.index.json yet"):
        pull(local, run.seed, run.source, 2)
    assert marker_version(local) == 1
    monkeypatch.setattr(publish_mod, "write_bytes", real_write_bytes)
    pub.commit(2, "delta", [manifest])
    run.assert_pulls(2, local)


def test_publish_can_be_retried_after_its_index_write_failed(run, monkeypatch):
    """Publisher's invariant: 'a failed write can be retried with the same inputs'."""
    import weightsync.publisher.publish as publish_mod

    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    new = run.next_tensors()
    real_write_bytes = publish_mod.write_bytes
    monkeypatch.setattr(
        publish_mod, "write_bytes", lambda path, data, **kw: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error", path))
    )
    with pytest.raises(OSError, match="I/O error"):
        pub.publish(1, new)
    monkeypatch.setattr(publish_mod, "write_bytes", real_write_bytes)
    pub.publish(1, new)
    run.assert_pulls(1)


def test_failed_shard_write_does_not_advance_the_snapshot_and_the_retry_works(run, monkeypatch):
    import weightsync.publisher.publish as publish_mod

    pub = Publisher(run.source, encoding="overwrite", workers=1)
    pub.seed_snapshot(run.tensors[0])
    new = run.next_tensors()
    real_write_file = publish_mod.write_file
    monkeypatch.setattr(
        publish_mod, "write_file", lambda path, chunks, **kw: (_ for _ in ()).throw(OSError(errno.ENOSPC, "disk full", path))
    )
    with pytest.raises(OSError, match="disk full"):
        pub.publish(1, new)
    assert pub.version == 0
    monkeypatch.setattr(publish_mod, "write_file", real_write_file)
    pub.publish(1, new)
    run.assert_pulls(1)


def _refuse_rename(monkeypatch):
    def no_rename(src, dst, *a, **kw):
        raise OSError(errno.EXDEV, "rename not supported by this filesystem", src)

    monkeypatch.setattr(os, "replace", no_rename)
    monkeypatch.setattr(os, "rename", no_rename)


def test_atomic_rename_off_writes_each_file_once_under_its_final_name(run, monkeypatch):
    _refuse_rename(monkeypatch)  # an object-store mount without rename (a fault we cannot cause here)
    pub = Publisher(run.source, encoding="xor", atomic_rename=False, workers=1)
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors())
    pub.publish(2, run.next_tensors(), full=True)
    for v in (1, 2):
        assert not [f for f in os.listdir(run.vdir(v)) if ".tmp." in f]
    monkeypatch.undo()  # the puller's host-local disk can rename
    run.assert_pulls(1)
    run.assert_pulls(2)


def test_atomic_rename_on_a_filesystem_without_rename_fails_cleanly(run, monkeypatch):
    pub = Publisher(run.source, encoding="xor", workers=1)
    pub.seed_snapshot(run.tensors[0])
    _refuse_rename(monkeypatch)
    with pytest.raises(OSError, match="rename not supported"):
        pub.publish(1, run.next_tensors())
    monkeypatch.undo()
    # The first rename is the writer lease's: it fails before any version file is written.
    assert not [f for f in os.listdir(run.source) if ".tmp." in f]  # no temporary left behind
    assert not os.path.exists(os.path.join(run.vdir(1), INDEX))


def test_post_write_hook_sees_the_committed_version(run):
    seen = []

    def hook(vdir):
        seen.append((os.path.basename(vdir), os.path.exists(os.path.join(vdir, INDEX))))

    pub = Publisher(run.source, encoding="xor", post_write_hook=hook, workers=1)
    pub.seed_snapshot(run.tensors[0])
    pub.publish(1, run.next_tensors())
    assert seen == [("weight_v000001", True)]


# --- the publisher's refusals ----------------------------------------------------------------------


def test_publisher_refuses_unknown_encodings_and_checksums(run):
    with pytest.raises(errors.UnsupportedFormatError, match=r"unsupported delta_encoding 'bsdiff'; this reader supports"):
        Publisher(run.source, encoding="bsdiff")
    with pytest.raises(errors.UnsupportedFormatError, match=r"unsupported checksum_format 'md5'"):
        Publisher(run.source, checksum="md5")


def test_publisher_refuses_versions_out_of_order(run):
    pub = Publisher(run.source, workers=1)
    pub.seed_snapshot(run.tensors[0])
    with pytest.raises(errors.VersionNumberError, match=r"cannot publish version 2 .*nothing is published yet, so the next version is 1"):
        pub.publish(2, run.tensors[0])
    pub.seed_snapshot(run.tensors[0], version=1)  # a snapshot that claims v1 while nothing is published
    with pytest.raises(errors.VersionNumberError, match=r"publish 1 next"):
        pub.publish(2, run.tensors[0])
    assert not os.path.exists(run.source)  # refused before anything was written


def test_publisher_refuses_a_changed_dtype_shape_or_unknown_tensor(run):
    pub = Publisher(run.source, workers=1)
    pub.seed_snapshot(run.tensors[0])
    t = run.tensors[0]
    with pytest.raises(errors.PublishError, match=r"tensor norm: got F64 \[16\], the snapshot holds F32 \[16\]; dtype and shape must not change"):
        pub.publish(1, {"norm": t["norm"].astype(np.float64)})
    with pytest.raises(errors.PublishError, match=r"tensor embed: got F32 \[16, 64\]"):
        pub.publish(1, {"embed": np.ascontiguousarray(t["embed"].T)})
    with pytest.raises(errors.PublishError, match=r"tensors \['ghost'\] are not in the snapshot"):
        pub.publish(1, {"ghost": np.zeros(2, np.float32)})
    with pytest.raises(errors.PublishError, match=r"numpy dtype complex64 has no safetensors name"):
        pub.publish(1, {"norm": np.zeros(16, np.complex64)})
    from weightsync import RawTensor

    with pytest.raises(errors.PublishError, match=r"tensor norm: 60 bytes given, F32 x \[16\] needs 64"):
        pub.publish(1, {"norm": RawTensor("F32", (16,), bytes(60))})
    with pytest.raises(errors.PublishError, match=r"unknown dtype 'F128'"):
        pub.publish(1, {"norm": RawTensor("F128", (16,), bytes(64))})
    assert pub.version == 0 and not os.path.exists(run.vdir(1))


def test_raw_tensor_bytes_publish_like_numpy_arrays(run):
    from weightsync import RawTensor

    pub = Publisher(run.source, encoding="overwrite", workers=1)
    pub.seed_snapshot({n: RawTensor(("F32" if a.dtype == np.float32 else "I16"), a.shape, a.tobytes()) for n, a in run.tensors[0].items()})
    new = run.next_tensors(0.05)
    pub.publish(1, {n: RawTensor(("F32" if a.dtype == np.float32 else "I16"), a.shape, bytearray(a.tobytes())) for n, a in new.items()})
    run.assert_pulls(1)
