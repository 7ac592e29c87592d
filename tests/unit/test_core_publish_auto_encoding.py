"""Encoding ``auto``: the publisher picks sparse-v1 or sparse-v2 per version by the declared
link against sparse-v2's extra apply time, a dense step still goes full, and whatever it picked
pulls bit-exactly through the normal pull path. Real files, real pulls; no timings.

The data is what the choice is about: bf16 weights (as their uint16 bits) moved by an Adam-like
step and rounded to nearest even, so small weights change more often than large ones and
sparse-v2 codes the change in fewer bytes than sparse-v1.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.cli import main
from weightsync.publisher.encoding_choice import EncodingSample, merge_samples, pick_windows

from core_support import assert_checkpoint_is, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SHAPES = {"layers.0.mlp.w": (512, 512), "layers.0.attn.w": (256, 512), "layers.1.mlp.w": (384, 512), "norm": (512,)}
SLOW = 1e3  # bytes/s per puller: any saved byte outweighs the apply
FAST = 1e12  # no saving on the wire pays for an extra pass


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (torch's cast)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)


class Trainer:
    """fp32 master weights; each step moves every weight by about ``lr`` and publishes bf16."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.master = {
            n: (1.0 + 0.05 * rng.standard_normal(s) if len(s) == 1 else 0.02 * rng.standard_normal(s)).astype(np.float32)
            for n, s in SHAPES.items()
        }

    def bf16(self) -> dict[str, np.ndarray]:
        return {n: bf16_bits(w) for n, w in self.master.items()}

    def step(self, lr: float) -> dict[str, np.ndarray]:
        for w in self.master.values():
            w += (lr * np.sign(self.rng.standard_normal(w.shape)) * np.exp(0.5 * self.rng.standard_normal(w.shape))).astype(np.float32)
        return self.bf16()


class World:
    def __init__(self, root: str, rng: np.random.Generator):
        self.root = root
        self.trainer = Trainer(rng)
        self.versions = [self.trainer.bf16()]
        self.seed = os.path.join(root, "seed")
        write_hf_checkpoint(self.seed, self.versions[0])
        self.locals = 0

    def step(self, lr: float) -> dict[str, np.ndarray]:
        self.versions.append(self.trainer.step(lr))
        return self.versions[-1]

    def publisher(self, source: str, **kw) -> Publisher:
        pub = Publisher(os.path.join(self.root, source), encoding="auto", workers=2, **kw)
        return pub

    def index(self, source: str, v: int) -> dict:
        with open(os.path.join(self.root, source, f"weight_v{v:06d}", INDEX)) as f:
            return json.load(f)

    def assert_pulls(self, source: str, v: int, local: str | None = None) -> str:
        if local is None:
            self.locals += 1
            local = os.path.join(self.root, f"local{self.locals}")
        assert pull(local, self.seed, os.path.join(self.root, source), v).applied_version == v
        assert_checkpoint_is(local, tensor_bytes(self.versions[v]))
        return local


@pytest.fixture
def world(fast_tmp_path, rng) -> World:
    return World(str(fast_tmp_path), rng)


@pytest.fixture(autouse=True)
def no_declared_link(monkeypatch):
    for env in ("WEIGHTSYNC_LINK_BYTES_PER_S", "WEIGHTSYNC_AUTO_SAMPLE_FRACTION", "WEIGHTSYNC_SPARSE2_PASS_NS",
                "WEIGHTSYNC_SPARSE2_CHANGE_NS"):
        monkeypatch.delenv(env, raising=False)


# --- the rule ------------------------------------------------------------------------------------


def test_auto_picks_sparse_v2_on_a_slow_link_and_sparse_v1_on_a_fast_one_for_the_same_step(world):
    step = world.step(3e-6)
    results = {}
    for source, link in (("slow", SLOW), ("fast", FAST)):
        pub = world.publisher(source, link_bytes_per_s=link)
        pub.seed_snapshot(world.versions[0])
        results[source] = pub.publish(1, step)
        pub.close()
    slow, fast = results["slow"], results["fast"]
    assert (slow.kind, slow.encoding) == ("delta", "sparse-v2")
    assert (fast.kind, fast.encoding) == ("delta", "sparse-v1")
    assert world.index("slow", 1)["metadata"]["delta_encoding"] == "sparse-v2"
    assert world.index("fast", 1)["metadata"]["delta_encoding"] == "sparse-v1"
    assert slow.wire_nbytes < fast.wire_nbytes  # the same step: what the slow link pays for
    for r in (slow, fast):  # the reason carries the figures the rule compared
        assert r.encoding_reason.startswith("auto: sparse-v2 ~") and "more apply" in r.encoding_reason
        assert "pays below" in r.encoding_reason
    world.assert_pulls("slow", 1)
    world.assert_pulls("fast", 1)


def test_auto_publishes_a_dense_step_as_a_full_version_without_a_sparse_v2_encode(world):
    pub = world.publisher("src", link_bytes_per_s=SLOW)
    pub.seed_snapshot(world.versions[0])
    dense = pub.publish(1, world.step(2e-3))  # most elements move at least one ulp
    pub.close()
    assert dense.kind == "full" and dense.encoding == ""
    assert "threshold 50%" in dense.reason  # the dense-step rules of choose_kind, on the exact totals
    assert "the sample shows a dense step" in dense.encoding_reason  # so only the cheap encode ran
    assert "delta_encoding" not in world.index("src", 1)["metadata"]
    world.assert_pulls("src", 1)


def test_versions_published_by_auto_pull_bit_exactly_whichever_encoding_it_chose(world):
    """One source dir whose chain mixes what auto chose: a slow link (sparse-v2), then the
    publisher restarted with a fast link (sparse-v1), a dense step (full) and a delta after it."""
    pub = world.publisher("src", link_bytes_per_s=SLOW)
    pub.seed_snapshot(world.versions[0])
    chosen = [pub.publish(1, world.step(3e-6)), pub.publish(2, world.step(1e-6))]
    pub.close()
    pub = world.publisher("src", link_bytes_per_s=FAST)
    pub.seed_snapshot(world.versions[2], version=2)
    chosen += [pub.publish(3, world.step(3e-6)), pub.publish(4, world.step(2e-3)), pub.publish(5, world.step(3e-6))]
    pub.close()
    assert [(r.kind, r.encoding) for r in chosen] == [
        ("delta", "sparse-v2"), ("delta", "sparse-v2"), ("delta", "sparse-v1"), ("full", ""), ("delta", "sparse-v1"),
    ]
    step_by_step = None
    for v in range(1, 6):  # one host following every version
        step_by_step = world.assert_pulls("src", v, step_by_step)
    world.assert_pulls("src", 3)  # a late host: the mixed chain sparse-v2, sparse-v2, sparse-v1 in one pull
    world.assert_pulls("src", 5)


def test_a_sample_of_every_window_measures_the_bytes_each_encoding_sends(world):
    """Tensors of at most one window are sampled whole: the sample's sizes are the payloads'."""
    step = world.step(3e-6)
    pub = world.publisher("src", link_bytes_per_s=SLOW)
    pub.seed_snapshot(world.versions[0])
    sample = pub.sample_encodings(1, step)
    sent = {}
    for encoding in ("sparse-v1", "sparse-v2"):
        prepared = pub.prepare(1, step, encoding=encoding)
        sent[encoding] = (prepared.delta_nbytes, prepared.changed_elements, prepared.total_elements)
    pub.close()
    assert (sample.v1_nbytes, sample.changed_elements, sample.sampled_elements) == sent["sparse-v1"]
    assert sample.v2_nbytes == sent["sparse-v2"][0] and sample.elements == sample.sampled_elements
    # bitstream 3 (the writer's where the coder is built): the range decoder reads every
    # element of a segment with changes once, and no class passes are made
    assert sample.v2_coded_elements == sample.sampled_elements and sample.v2_pass_elements == 0


def test_a_bitstream_2_sample_counts_the_class_passes_its_apply_makes(world, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SPARSE2_BITSTREAM", "2")
    step = world.step(3e-6)
    pub = world.publisher("src", link_bytes_per_s=SLOW)
    pub.seed_snapshot(world.versions[0])
    sample = pub.sample_encodings(1, step)
    pub.close()
    assert sample.v2_pass_elements >= 2 * sample.sampled_elements  # several classes: magnitudes + a class each
    assert sample.v2_coded_elements == 0


def test_the_sample_is_every_kth_window_from_the_version_and_never_under_four():
    assert pick_windows(3, 7, 1 / 64) == [0, 1, 2]  # a small model: everything
    assert pick_windows(1000, 70, 1 / 64) == list(range(70 % 64, 1000, 64))
    assert pick_windows(1000, 71, 1 / 64) != pick_windows(1000, 70, 1 / 64)  # the next version samples others
    assert len(pick_windows(20, 0, 1 / 64)) >= 4 and pick_windows(20, 0, 1 / 64) == [0, 5, 10, 15]
    assert pick_windows(10, 3, 1.0) == list(range(10))


# --- several ranks -----------------------------------------------------------------------------------


def test_several_ranks_choose_one_encoding_from_their_summed_samples(world):
    step = world.step(3e-6)
    owners = {n: i % 2 for i, n in enumerate(sorted(SHAPES))}
    pubs = [world.publisher("src", link_bytes_per_s=SLOW, rank=r, world_size=2) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot({n: a for n, a in world.versions[0].items() if owners[n] == r})
    mine = [{n: a for n, a in step.items() if owners[n] == r} for r in (0, 1)]
    with pytest.raises(errors.PublishError, match="needs one choice for all of them"):
        pubs[0].prepare(1, mine[0])
    total = merge_samples(pub.sample_encodings(1, t) for pub, t in zip(pubs, mine))
    choices = [pub.choose_encoding(1, total) for pub in pubs]
    assert choices[0] == choices[1] and choices[0].encoding == "sparse-v2"
    prepared = [pub.prepare(1, t, encoding=choices[0].encoding) for pub, t in zip(pubs, mine)]
    totals = [sum(x) for x in zip(*[(p.delta_nbytes, p.full_nbytes, p.changed_elements, p.total_elements) for p in prepared])]
    kinds = {pub.choose_kind(1, *totals)[0] for pub in pubs}
    assert kinds == {"delta"}
    manifests = [pub.write(p, "delta") for pub, p in zip(pubs, prepared)]
    assert {m.encoding for m in manifests} == {"sparse-v2"}
    pubs[0].commit(1, "delta", manifests)
    pubs[1].confirm(1)
    for pub in pubs:
        pub.close()
    assert world.index("src", 1)["metadata"]["delta_encoding"] == "sparse-v2"
    world.assert_pulls("src", 1)


def test_commit_refuses_ranks_that_encoded_one_version_two_ways(world):
    step = world.step(3e-6)
    owners = {n: i % 2 for i, n in enumerate(sorted(SHAPES))}
    pubs = [world.publisher("src", link_bytes_per_s=SLOW, rank=r, world_size=2) for r in (0, 1)]
    manifests = []
    for r, (pub, encoding) in enumerate(zip(pubs, ("sparse-v1", "sparse-v2"))):
        pub.seed_snapshot({n: a for n, a in world.versions[0].items() if owners[n] == r})
        manifests.append(pub.write(pub.prepare(1, {n: a for n, a in step.items() if owners[n] == r}, encoding=encoding), "delta"))
    with pytest.raises(errors.PublishError, match="different encodings"):
        pubs[0].commit(1, "delta", manifests)
    for pub in pubs:
        pub.close()
    assert not os.path.exists(os.path.join(world.root, "src", "weight_v000001", INDEX))


def test_merged_samples_add_every_field():
    a, b = EncodingSample(10, 4, 2, 30, 20, 8), EncodingSample(5, 5, 1, 3, 2, 0)
    assert merge_samples([a, b]) == EncodingSample(15, 9, 3, 33, 22, 8)


# --- bad values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", [None, 0, -5.0, float("nan"), float("inf"), "fast"])
def test_auto_refuses_a_missing_or_bad_link_before_writing_anything(world, link):
    with pytest.raises(errors.InvalidKnobError) as e:
        Publisher(os.path.join(world.root, "src"), encoding="auto", link_bytes_per_s=link)
    assert e.value.knob in ("link_bytes_per_s", "WEIGHTSYNC_LINK_BYTES_PER_S")
    assert "bytes per second one puller gets" in str(e.value) or "a number" in str(e.value)
    assert not os.path.exists(os.path.join(world.root, "src"))


@pytest.mark.parametrize("env, value", [
    ("WEIGHTSYNC_LINK_BYTES_PER_S", "fast"),
    ("WEIGHTSYNC_LINK_BYTES_PER_S", "-1"),
    ("WEIGHTSYNC_AUTO_SAMPLE_FRACTION", "0"),
    ("WEIGHTSYNC_AUTO_SAMPLE_FRACTION", "1.5"),
    ("WEIGHTSYNC_SPARSE2_PASS_NS", "-1"),
    ("WEIGHTSYNC_SPARSE2_CHANGE_NS", "nan"),
])
def test_auto_refuses_bad_knob_values_with_a_typed_error_naming_the_knob(world, monkeypatch, env, value):
    monkeypatch.setenv("WEIGHTSYNC_LINK_BYTES_PER_S", "1e6")
    monkeypatch.setenv(env, value)
    with pytest.raises(errors.InvalidKnobError) as e:
        Publisher(os.path.join(world.root, "src"), encoding="auto")
    assert e.value.knob == env and env in str(e.value)
    assert isinstance(e.value, ValueError) and e.value.http_status == 400


def test_the_declared_link_knob_serves_when_no_argument_is_passed(world, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_LINK_BYTES_PER_S", str(SLOW))
    pub = Publisher(os.path.join(world.root, "src"), encoding="auto", workers=1)
    pub.seed_snapshot(world.versions[0])
    assert pub.publish(1, world.step(3e-6)).encoding == "sparse-v2"
    pub.close()
    world.assert_pulls("src", 1)


def test_a_publisher_with_a_named_encoding_has_nothing_to_choose(world):
    pub = Publisher(os.path.join(world.root, "src"), encoding="sparse-v1", workers=1)
    pub.seed_snapshot(world.versions[0])
    with pytest.raises(errors.PublishError, match="not 'auto'"):
        pub.sample_encodings(1, world.step(3e-6))
    result = pub.publish(1, world.versions[1])
    pub.close()
    assert (result.encoding, result.encoding_reason) == ("sparse-v1", "")


# --- the command line ----------------------------------------------------------------------------------


def test_cli_publish_with_encoding_auto_reports_its_choice(world, capsys):
    base, new = os.path.join(world.root, "v0"), os.path.join(world.root, "v1")
    write_hf_checkpoint(base, world.versions[0])
    write_hf_checkpoint(new, world.step(3e-6))
    source = os.path.join(world.root, "src")
    argv = ["--json", "publish", source, "--version", "1", "--checkpoint", new, "--base-checkpoint", base,
            "--encoding", "auto", "--link-bytes-per-s", str(SLOW)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["encoding"] == "sparse-v2" and out["encoding_reason"].startswith("auto: ")
    world.assert_pulls("src", 1)
    assert main(["--json", "publish", os.path.join(world.root, "src2"), "--version", "1", "--checkpoint", new,
                 "--base-checkpoint", base, "--encoding", "auto"]) == 2  # no link declared
    assert json.loads(capsys.readouterr().out)["error_type"] == "invalid_knob"
