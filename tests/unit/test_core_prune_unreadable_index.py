"""Pruning while a version's index is unreadable (issue 28 points 9 and 10, the prune side).

A bound side anchor is deleted only when its own version is; an index that cannot be read at
the moment of a prune (damaged, mid-restore, nested too deeply to parse) keeps its version and
its anchor, is named in the report, and never crashes the command. After the index is repaired,
every kept version pulls exactly on a fresh host. Real files, the real puller and CLI.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from weightsync import Publisher, plan_pull, pull
from weightsync.cli import main
from weightsync.format.layout import list_anchors, list_versions
from weightsync.publisher.prune import prune_source, prune_versions

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {"embed": ("float32", (64, 16)), "layers.0.w": ("float32", (32, 32)), "norm": ("float32", (16,))}


class Chain:
    """v1..v7 deltas with a bound side anchor every second version (v2, v4, v6), no pruning yet."""

    def __init__(self, root: str, rng):
        self.root = root
        self.seed, self.source = os.path.join(root, "seed"), os.path.join(root, "src")
        self.t = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.t[0])
        pub = Publisher(self.source, workers=1, anchor_fraction=0, anchor_max_deltas=2, prune=False)
        pub.seed_snapshot(self.t[0])
        for v in range(1, 8):
            self.t.append(mutate(self.t[-1], rng, 0.05))
            pub.publish(v, self.t[v], full=False)
        pub.close()
        assert list_anchors(self.source) == [2, 4, 6]

    def index_path(self, v: int) -> str:
        return os.path.join(self.source, f"weight_v{v:06d}", INDEX)

    def pulls_exactly(self, v: int) -> str:
        local = os.path.join(self.root, f"fresh-{v}-{len(os.listdir(self.root))}")
        result = pull(local, self.seed, self.source, v)
        assert result.applied_version == v
        assert_checkpoint_is(local, tensor_bytes(self.t[v]))
        return result.action


@pytest.fixture
def chain(fast_tmp_path, rng):
    return Chain(str(fast_tmp_path), rng)


DAMAGE = {
    "damaged": lambda raw: raw[:1] + b"#" + raw[1:],  # a byte inserted: complete, not JSON
    "nested too deeply": lambda raw: b'{"metadata": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_bound_anchor_is_kept_while_its_version_s_index_is_unreadable_and_serves_after_the_repair(chain, damage):
    path = chain.index_path(6)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(DAMAGE[damage](good))
    report = prune_source(chain.source, keep=2)
    assert 6 in report.unreadable and 6 in list_versions(chain.source)
    assert 6 in list_anchors(chain.source)  # its version was not deleted: neither is its anchor
    with open(path, "wb") as f:  # the index is restored
        f.write(good)
    prune_versions(chain.source, keep=2)  # a later prune, with every index readable
    for v in list_versions(chain.source):
        chain.pulls_exactly(v)
    plan, _ = plan_pull(os.path.join(chain.root, "planner"), chain.seed, chain.source, 7)
    assert plan.seed is not None and plan.seed.kind == "anchor" and plan.seed.version == 6, plan.reason


def test_an_anchor_goes_only_with_its_own_version(chain):
    prune_versions(chain.source, keep=2)
    versions, anchors = list_versions(chain.source), list_anchors(chain.source)
    assert all(a in versions for a in anchors), (versions, anchors)
    for v in versions:
        chain.pulls_exactly(v)


def test_prune_on_a_deeply_nested_small_index_flags_the_version_and_never_crashes(chain, capsys):
    with open(chain.index_path(3), "wb") as f:
        f.write(b"[" * 100_000 + b"]" * 100_000)
    assert main(["--json", "prune", chain.source, "--keep", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "3" in out["unreadable"] and "MalformedHeaderError" in out["unreadable"]["3"]
    assert main(["prune", chain.source, "--keep", "2", "--dry-run"]) == 0
    assert "skipped v3: its index is unreadable" in capsys.readouterr().out


def test_a_source_dir_copied_mid_restore_keeps_every_anchor_until_its_version_goes(chain):
    """A restore that has copied the anchors but not yet the versions' indexes: nothing bound is lost."""
    saved = {}
    for v in (2, 4, 6):
        saved[v] = chain.index_path(v) + ".saved"
        shutil.move(chain.index_path(v), saved[v])
    prune_versions(chain.source, keep=2)
    assert list_anchors(chain.source) == [2, 4, 6]
    for v, tmp in saved.items():
        shutil.move(tmp, chain.index_path(v))
    for v in list_versions(chain.source):
        chain.pulls_exactly(v)
