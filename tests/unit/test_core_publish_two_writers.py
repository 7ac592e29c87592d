"""Two publishers of one run dir (issue 28 point 7): a restarted trainer while the old process
still encodes. Two real processes; the old one is held between its steps by a pipe.

What must hold: the old publisher never commits after the newer one started (it fails loud,
typed), never replaces a file of a version the newer one committed, and never takes the newer
one's landed index for its own; hosts that pulled before and after the old one's attempt hold
the same, exact bytes of the version.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from weightsync import Publisher, pull

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

SIZES = {"embed": ("float32", (64, 16)), "layers.0.w": ("float32", (32, 32)), "norm": ("float32", (16,))}

# A publisher process: it opens the run at v``base`` and runs the steps it reads from stdin,
# one per line, answering each with one JSON line (its result, or its typed error).
CHILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    from weightsync import Publisher, errors

    source, tensors_path, base, base_key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
    t = {k: dict(np.load(f"{tensors_path}-{k}.npz")) for k in sys.argv[4].split(",")}
    pub = Publisher(source, encoding="sparse-v1", workers=1, anchor_fraction=0, anchor_max_deltas=0)
    pub.seed_snapshot(t[base_key], version=base)
    staged = {}
    for line in sys.stdin:
        step, version, which = line.split()
        v = int(version)
        try:
            if step == "write":  # prepare and write this rank's shards; the commit waits for the next step
                prepared = pub.prepare(v, t[which])
                kind, _ = pub.choose_kind(v, prepared.delta_nbytes, prepared.full_nbytes)
                staged[v] = (kind, pub.write(prepared, kind))
                out = {"ok": True, "step": "write"}
            elif step == "discard":
                pub.discard_pending()
                out = {"ok": True, "step": "discard"}
            elif step == "commit":
                kind, manifest = staged[v]
                pub.commit(v, kind, [manifest])
                out = {"ok": True, "step": "commit"}
            else:
                r = pub.publish(v, t[which])
                out = {"ok": True, "step": "publish", "reason": r.reason}
        except errors.WeightSyncError as e:
            out = {"ok": False, "error_type": e.error_type, "message": str(e)}
        print(json.dumps(out), flush=True)
''')


class Writer:
    """One publisher process of the run."""

    def __init__(self, world, base: int, base_key: str | None = None):
        names = ",".join(str(k) for k in sorted(world.npz))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, world.source, world.npz_stem, str(base), names, base_key or str(base)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    def step(self, step: str, version: int, which: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{step} {version} {which}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the publisher process ended (exit {self.proc.wait()})"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0


class World:
    def __init__(self, root: str, rng: np.random.Generator):
        self.root = root
        self.seed, self.source = os.path.join(root, "seed"), os.path.join(root, "src")
        t0 = random_tensors(rng, SIZES)
        t1 = mutate(t0, rng, 0.05)
        self.t = {"0": t0, "1": t1, "2old": mutate(t1, rng, 0.05), "2new": mutate(t1, rng, 0.05)}
        self.t["3new"] = mutate(self.t["2new"], rng, 0.05)
        write_hf_checkpoint(self.seed, t0)
        self.npz_stem = os.path.join(root, "t")
        self.npz = {}
        for k, tensors in self.t.items():
            np.savez(f"{self.npz_stem}-{k}.npz", **tensors)
            self.npz[k] = f"{self.npz_stem}-{k}.npz"
        pub = Publisher(self.source, workers=1)
        pub.seed_snapshot(t0)
        pub.publish(1, t1)
        pub.close()

    def files(self, v: int) -> dict[str, tuple[int, str]]:
        """name -> (inode, sha256) of every file of a version dir."""
        vdir = os.path.join(self.source, f"weight_v{v:06d}")
        out = {}
        for name in sorted(os.listdir(vdir)):
            path = os.path.join(vdir, name)
            with open(path, "rb") as f:
                out[name] = (os.stat(path).st_ino, hashlib.sha256(f.read()).hexdigest())
        return out

    def pulls_exactly(self, local: str, v: int, which: str) -> str:
        result = pull(local, self.seed, self.source, v)
        assert result.applied_version == v
        assert_checkpoint_is(local, tensor_bytes(self.t[which]))
        return result.action


@pytest.fixture
def world(fast_tmp_path, rng):
    return World(str(fast_tmp_path), rng)


def test_a_superseded_publisher_that_wrote_before_the_new_one_committed_fails_loud_and_never_lands(world):
    old = Writer(world, base=1)
    assert old.step("write", 2, "2old")["ok"]  # the old trainer's shards of v2 are on disk, its index not yet
    new = Writer(world, base=1)  # the restarted trainer publishes v2 with its own weights
    assert new.step("publish", 2, "2new")["ok"]
    new.close()
    before = world.files(2)
    early = os.path.join(world.root, "early-host")
    world.pulls_exactly(early, 2, "2new")
    answer = old.step("commit", 2, "2old")
    old.close()
    assert not answer["ok"] and answer["error_type"] == "publisher_superseded", answer
    assert "was superseded" in answer["message"] and "wrote no index" in answer["message"]
    # Nothing of the committed version changed: the index, and every file it names (the old
    # one's shards lie beside them under names of their own, never named by the index).
    after = world.files(2)
    assert {n: after[n] for n in before} == before
    late = os.path.join(world.root, "late-host")
    world.pulls_exactly(late, 2, "2new")
    assert world.pulls_exactly(early, 2, "2new") == "noop"


def test_a_superseded_publisher_that_writes_after_the_new_one_started_fails_before_writing(world):
    old = Writer(world, base=1)
    assert old.step("publish", 2, "2old")["ok"]  # it holds the lease and has published v2
    new = Writer(world, base=2, base_key="2old")
    assert new.step("write", 3, "3new")["ok"]  # the new one took the lease at its first write
    answer = old.step("write", 3, "2old")
    assert not answer["ok"] and answer["error_type"] == "publisher_superseded", answer
    assert new.step("commit", 3, "3new")["ok"]
    new.close()
    old.close()
    world.pulls_exactly(os.path.join(world.root, "host"), 3, "3new")


def test_a_publisher_that_never_wrote_cannot_publish_over_what_another_committed(world):
    old = Writer(world, base=1)  # opened, but slow: it has written nothing yet
    new = Writer(world, base=1)
    assert new.step("publish", 2, "2new")["ok"]
    new.close()
    before = world.files(2)
    answer = old.step("publish", 2, "2old")
    assert not answer["ok"] and answer["error_type"] == "version_conflict", answer
    identical = old.step("publish", 2, "2new")  # the same bytes as committed: counted, nothing written
    assert identical["ok"] and identical["reason"].startswith("already published, identical")
    old.close()
    assert world.files(2) == before
    world.pulls_exactly(os.path.join(world.root, "host"), 2, "2new")


def test_a_superseded_publisher_cannot_discard_the_files_of_the_version_the_new_one_writes(world):
    old = Writer(world, base=1)
    assert old.step("write", 2, "2old")["ok"]  # pending v2 on the old one
    new = Writer(world, base=1)
    assert new.step("write", 2, "2new")["ok"]  # the new one writes v2 too (not committed yet)
    answer = old.step("discard", 2, "-")
    assert not answer["ok"] and answer["error_type"] == "publisher_superseded", answer
    assert new.step("commit", 2, "2new")["ok"]
    new.close()
    old.close()
    world.pulls_exactly(os.path.join(world.root, "host"), 2, "2new")
