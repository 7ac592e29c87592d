"""A failed publish is retried, on every rank, with the same version and the same bytes, until
its index lands; the ranks end in agreement. Also: an index being written in place (no rename)
reads as "not ready", and a version without a complete index can be published again.

Several ranks are several Publisher objects driven through the documented protocol (prepare,
choose_kind with totals, write, barrier, commit on rank 0, confirm on the others); the faults we
cannot cause for real (an encoder crash, ENOSPC on one rank, a failed barrier) are injected at
exactly one step."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

import weightsync.publisher.publish as publish_mod
from weightsync import Publisher, errors, pull

from core_support import assert_checkpoint_is, marker_version, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {
    "embed": ("float32", (64, 16)),
    "layers.0.w": ("float32", (32, 32)),
    "layers.1.w": ("float32", (32, 32)),
    "norm": ("float32", (16,)),
}
OWNERS = {"embed": 0, "layers.0.w": 1, "layers.1.w": 0, "norm": 1}


class BarrierFailed(RuntimeError):
    pass


class Ranks:
    """Two source ranks publishing into one source dir through the multi-rank protocol."""

    def __init__(self, source: str, t0: dict[str, np.ndarray], **kw):
        self.source = source
        self.pubs = [Publisher(source, encoding="sparse-v1", rank=r, world_size=2, workers=1, **kw) for r in (0, 1)]
        for r, pub in enumerate(self.pubs):
            pub.seed_snapshot(self.own(t0, r))

    @staticmethod
    def own(tensors, rank):
        return {n: a for n, a in tensors.items() if OWNERS[n] == rank}

    def publish(self, v: int, tensors, *, fail_barrier: bool = False) -> str:
        prepared = [pub.prepare(v, self.own(tensors, r)) for r, pub in enumerate(self.pubs)]
        totals = (
            sum(p.delta_nbytes for p in prepared), sum(p.full_nbytes for p in prepared),
            sum(p.changed_elements for p in prepared), sum(p.total_elements for p in prepared),
        )
        kinds = {pub.choose_kind(v, *totals) for pub in self.pubs}
        assert len(kinds) == 1, kinds
        (kind, _), = kinds
        manifests = [pub.write(p, kind) for pub, p in zip(self.pubs, prepared)]
        if fail_barrier:
            raise BarrierFailed("the barrier after the shard writes timed out")
        self.pubs[0].commit(v, kind, manifests)
        for pub in self.pubs[1:]:
            pub.confirm(v)
        return kind

    def versions(self) -> list[int]:
        return [pub.version for pub in self.pubs]

    def close(self):
        for pub in self.pubs:
            pub.close()


def version_files(source: str, v: int, prefix: str = "weight_v") -> dict[str, bytes]:
    vdir = os.path.join(source, f"{prefix}{v:06d}")
    if not os.path.isdir(vdir):
        return {}
    out = {}
    for name in sorted(os.listdir(vdir)):
        with open(os.path.join(vdir, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture
def world(fast_tmp_path, rng):
    root = str(fast_tmp_path)
    t = [random_tensors(rng, SIZES)]
    seed = os.path.join(root, "seed")
    write_hf_checkpoint(seed, t[0])
    for _ in range(3):
        t.append(mutate(t[-1], rng, 0.03))
    # The reference: the same versions published with no fault.
    ref = Ranks(os.path.join(root, "ref"), t[0])
    for v in (1, 2, 3):
        ref.publish(v, t[v])
    ref.close()
    return {"root": root, "seed": seed, "t": t, "ref": os.path.join(root, "ref")}


def inject(monkeypatch, step: str):
    """Arm one fault for v2 at ``step``; returns the Ranks-level kwargs of that step."""
    armed = {"on": True}
    if step == "encode":  # rank 1's encoder dies (an out-of-memory, a bug): nothing written anywhere
        real = publish_mod.Encoder.prepare

        def failing_prepare(self, version, rank, jobs, **kw):
            if armed["on"] and rank == 1 and version == 2:
                armed["on"] = False
                raise MemoryError("encoder ran out of memory")
            return real(self, version, rank, jobs, **kw)

        monkeypatch.setattr(publish_mod.Encoder, "prepare", failing_prepare)
        return {}
    if step == "shard write":  # rank 1's disk is full after rank 0 wrote its shards
        real_write_file = publish_mod.write_file

        def enospc_on_rank1(path, chunks, **kw):
            if armed["on"] and "weight_v000002" in path and "-r00001-" in os.path.basename(path):
                armed["on"] = False
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return real_write_file(path, chunks, **kw)

        monkeypatch.setattr(publish_mod, "write_file", enospc_on_rank1)
        return {}
    if step == "barrier":
        return {"fail_barrier": True}
    if step == "index write":
        real_write_bytes = publish_mod.write_bytes

        def enospc_on_index(path, data, **kw):
            if armed["on"] and path.endswith(os.path.join("weight_v000002", INDEX)):
                armed["on"] = False
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return real_write_bytes(path, data, **kw)

        monkeypatch.setattr(publish_mod, "write_bytes", enospc_on_index)
        return {}
    raise AssertionError(step)


@pytest.mark.parametrize("step", ["encode", "shard write", "barrier", "index write"])
def test_failed_multi_rank_publish_is_retried_with_the_same_bytes_and_every_rank_agrees(world, monkeypatch, step):
    t = world["t"]
    source = os.path.join(world["root"], "src")
    ranks = Ranks(source, t[0])
    ranks.publish(1, t[1])
    local = os.path.join(world["root"], "local")
    pull(local, world["seed"], source, 1)
    kwargs = inject(monkeypatch, step)
    with pytest.raises((MemoryError, OSError, BarrierFailed)):
        ranks.publish(2, t[2], **kwargs)
    # Not published: a reader sees "not ready" (or nothing) and keeps v1; no rank moved on.
    with pytest.raises(errors.SourceNotReadyError):
        pull(local, world["seed"], source, 2)
    assert marker_version(local) == 1 and ranks.versions() == [1, 1]
    with pytest.raises(errors.PublishError, match=r"does not follow|is written on this rank but its index has not landed|so the next version is 2"):
        ranks.pubs[1].prepare(3, ranks.own(t[3], 1))
    # The retry: same version, same inputs, on every rank.
    ranks.publish(2, t[2], **{k: v for k, v in kwargs.items() if k != "fail_barrier"})
    assert ranks.versions() == [2, 2]
    assert version_files(source, 2) == version_files(world["ref"], 2), "the retry must publish the reference bytes"
    ranks.publish(3, t[3])  # and the ranks go on together
    assert ranks.versions() == [3, 3]
    for v in (2, 3):
        assert version_files(source, v) == version_files(world["ref"], v)
    pull(local, world["seed"], source, 3)
    assert_checkpoint_is(local, tensor_bytes(t[3]))
    ranks.close()


def test_retry_with_other_bytes_is_refused_while_the_version_is_uncommitted(world):
    t = world["t"]
    ranks = Ranks(os.path.join(world["root"], "src"), t[0])
    prepared = ranks.pubs[1].prepare(1, ranks.own(t[1], 1))
    ranks.pubs[1].write(prepared, "delta")  # rank 1 wrote v1; rank 0 never did
    other = ranks.own(t[2], 1)
    with pytest.raises(errors.PublishError, match=r"v1 was already written by this rank with other bytes .*must pass the same bytes"):
        ranks.pubs[1].prepare(1, other)
    with pytest.raises(errors.PublishError, match=r"confirm\(v2\): this rank has not written v2"):
        ranks.pubs[1].confirm(2)
    ranks.publish(1, t[1])  # the same bytes go through
    assert ranks.versions() == [1, 1]
    assert version_files(ranks.source, 1) == version_files(world["ref"], 1)
    ranks.close()


def test_a_rank_that_skips_confirm_confirms_on_its_next_prepare_once_the_index_is_there(world):
    t = world["t"]
    ranks = Ranks(os.path.join(world["root"], "src"), t[0])
    prepared = [pub.prepare(1, ranks.own(t[1], r)) for r, pub in enumerate(ranks.pubs)]
    manifests = [pub.write(p, "delta") for pub, p in zip(ranks.pubs, prepared)]
    ranks.pubs[0].commit(1, "delta", manifests)
    assert ranks.versions() == [1, 0]  # rank 1 has not been told yet
    ranks.pubs[1].prepare(2, ranks.own(t[2], 1))  # sees v1's index: confirms, then prepares v2
    assert ranks.pubs[1].version == 1
    ranks.close()


def test_single_rank_publish_retried_after_a_failed_shard_write_publishes_the_same_bytes(world, monkeypatch):
    t = world["t"]
    source = os.path.join(world["root"], "src1")
    ref = os.path.join(world["root"], "ref1")
    for d, faulty in ((ref, False), (source, True)):
        pub = Publisher(d, encoding="xor", workers=1)
        pub.seed_snapshot(t[0])
        if faulty:
            real = publish_mod.write_file
            monkeypatch.setattr(publish_mod, "write_file", lambda p, c, **kw: (_ for _ in ()).throw(OSError(errno.ENOSPC, "disk full", p)))
            with pytest.raises(OSError, match="disk full"):
                pub.publish(1, t[1])
            monkeypatch.setattr(publish_mod, "write_file", real)
        pub.publish(1, t[1])
        pub.close()
    assert version_files(source, 1) == version_files(ref, 1)


# --- filesystems without rename (point 8) ---------------------------------------------------------


def _publish_plain(source, t, versions, **kw):
    pub = Publisher(source, encoding="xor", workers=1, atomic_rename=False, **kw)
    pub.seed_snapshot(t[0])
    for v in versions:
        pub.publish(v, t[v])
    return pub


@pytest.mark.parametrize("cut", ["empty", "half", "all but the last byte"])
def test_index_still_being_written_in_place_reads_as_not_ready(world, cut):
    t = world["t"]
    source = os.path.join(world["root"], "src")
    _publish_plain(source, t, (1, 2)).close()
    local = os.path.join(world["root"], "local")
    pull(local, world["seed"], source, 1)
    ipath = os.path.join(source, "weight_v000002", INDEX)
    with open(ipath, "rb") as f:
        full = f.read()
    keep = {"empty": 0, "half": len(full) // 2, "all but the last byte": len(full.rstrip()) - 1}[cut]
    with open(ipath, "wb") as f:
        f.write(full[:keep])  # what a reader sees while the publisher writes it (no rename)
    with pytest.raises(errors.IndexMissingError, match=r"version 2 .*still being written"):
        pull(local, world["seed"], source, 2)
    assert marker_version(local) == 1
    with open(ipath, "wb") as f:
        f.write(full)
    pull(local, world["seed"], source, 2)
    assert_checkpoint_is(local, tensor_bytes(t[2]))


def test_index_corrupt_in_the_middle_is_still_a_corrupt_artifact(world):
    t = world["t"]
    source = os.path.join(world["root"], "src")
    _publish_plain(source, t, (1,)).close()
    ipath = os.path.join(source, "weight_v000001", INDEX)
    with open(ipath, "rb") as f:
        raw = bytearray(f.read())
    raw[5:9] = b"\x00!!\x00"
    with open(ipath, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(errors.MalformedHeaderError, match=r"index is not valid JSON"):
        pull(os.path.join(world["root"], "local"), world["seed"], source, 1)


def test_restarted_publisher_publishes_again_a_version_whose_index_was_cut_short(world):
    t = world["t"]
    source = os.path.join(world["root"], "src")
    _publish_plain(source, t, (1, 2)).close()
    ipath = os.path.join(source, "weight_v000002", INDEX)
    with open(ipath, "r+b") as f:
        f.truncate(17)  # the publisher died while writing v2's index
    pub = Publisher(source, encoding="xor", workers=1, atomic_rename=False)
    pub.seed_snapshot(t[1], version=1)  # restarted from v1's bytes
    pub.publish(2, t[2])
    pub.publish(3, t[3])
    ipath3 = os.path.join(source, "weight_v000003", INDEX)
    before = os.stat(ipath3)
    again = Publisher(source, encoding="xor", workers=1, atomic_rename=False)
    again.seed_snapshot(t[2], version=2)
    assert again.publish(3, t[3]).reason.startswith("already published, identical")  # a complete index: counted
    assert os.stat(ipath3).st_mtime_ns == before.st_mtime_ns  # never written again
    with pytest.raises(errors.VersionConflictError, match=r"version 3 is already published .*with other bytes"):
        other = Publisher(source, encoding="xor", workers=1, atomic_rename=False)
        other.seed_snapshot(t[2], version=2)
        other.publish(3, t[1])
    local = os.path.join(world["root"], "local")
    pull(local, world["seed"], source, 3)
    assert_checkpoint_is(local, tensor_bytes(t[3]))


def test_full_version_index_total_size_is_the_tensor_bytes_as_an_integer(world):
    t = world["t"]
    source = os.path.join(world["root"], "src")
    pub = Publisher(source, encoding="xor", workers=1)
    pub.seed_snapshot(t[0])
    pub.publish(1, t[1], full=True)
    pub.close()
    with open(os.path.join(source, "weight_v000001", INDEX)) as f:
        meta = json.load(f)["metadata"]
    assert meta["total_size"] == sum(a.nbytes for a in t[1].values())
    assert isinstance(meta["total_size"], int)


def test_writing_the_first_prepared_object_again_is_a_retry_of_the_same_bytes(world, monkeypatch):
    t = world["t"]
    ranks = Ranks(os.path.join(world["root"], "src"), t[0])
    ranks.publish(1, t[1])
    prepared = [pub.prepare(2, ranks.own(t[2], r)) for r, pub in enumerate(ranks.pubs)]
    manifests = [pub.write(p, "delta") for pub, p in zip(ranks.pubs, prepared)]
    inject(monkeypatch, "index write")
    with pytest.raises(OSError, match="No space left"):
        ranks.pubs[0].commit(2, "delta", manifests)
    # A caller that kept its first prepared objects writes them again (not prepare(2) anew).
    manifests = [pub.write(p, "delta") for pub, p in zip(ranks.pubs, prepared)]
    ranks.pubs[0].commit(2, "delta", manifests)
    ranks.pubs[1].confirm(2)
    assert ranks.versions() == [2, 2]
    assert version_files(ranks.source, 2) == version_files(world["ref"], 2)
    ranks.close()


def test_commit_repeated_after_a_failed_post_write_hook_reruns_the_hook_without_rewriting_the_index(world):
    t = world["t"]
    calls = []

    def flaky_hook(vdir):
        calls.append(os.path.basename(vdir))
        if len(calls) == 1:
            raise OSError(errno.EIO, "object store refresh failed", vdir)

    pub = Publisher(os.path.join(world["root"], "src"), encoding="xor", workers=1, post_write_hook=flaky_hook)
    pub.seed_snapshot(t[0])
    manifest = pub.write(pub.prepare(1, t[1]), "delta")
    with pytest.raises(OSError, match="object store refresh failed"):
        pub.commit(1, "delta", [manifest])
    ipath = os.path.join(pub.source_dir, "weight_v000001", INDEX)
    before = os.stat(ipath)
    assert pub.version == 1  # the index landed: v1 is committed
    pub.commit(1, "delta", [manifest])
    after = os.stat(ipath)
    assert calls == ["weight_v000001", "weight_v000001"]
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    pub.close()
