"""Interop both ways with an independent implementation written from docs/FORMAT.md only
(``interop_writer``): our ``pull`` applies what it writes bit-exact, and it reads back what our
``Publisher`` writes.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from weightsync import Publisher, pull

import interop_writer as upstream
from core_support import (
    assert_checkpoint_is,
    marker_version,
    mutate,
    random_tensors,
    read_checkpoint_bytes,
    tensor_bytes,
    write_hf_checkpoint,
)

SIZES = {
    "model.embed_tokens.weight": ("float16", (64, 32)),
    "model.layers.0.mlp.up_proj.weight": ("float32", (48, 40)),
    "model.layers.0.input_layernorm.weight": ("float32", (32,)),
    "model.layers.1.self_attn.q_proj.bias": ("int32", (7,)),
    "lm_head.weight": ("float16", (64, 32)),
    "one_byte": ("uint8", (1,)),
}

# What each version of the upstream chain is: (kind, options).
UPSTREAM_CHAIN = [
    ("delta", dict(encoding="xor", checksum="xxh3-128", shards=1, version_style="int")),
    ("delta", dict(encoding="overwrite", checksum="blake3", shards=2, version_style="plain")),
    ("delta", dict(encoding="xor", checksum="adler32", shards=3, version_style="padded")),
    ("full", dict(with_index=True, shards=2, version_style="int", extra_files={"config.json": '{"v": 4}'})),
    ("delta", dict(encoding="overwrite", checksum="xxh3-128", shards=2, version_style="padded", omit_defaults=True)),
    ("delta", dict(encoding="xor", checksum="blake3", shards=2, version_style="int")),
    ("full", dict(with_index=False)),  # index-less: one complete model.safetensors, no config
    ("delta", dict(encoding="overwrite", checksum="adler32", shards=1, version_style="plain")),
    ("full", dict(with_index=True, shards=3, version_style=None)),  # an HF index without "version"
    ("delta", dict(encoding="xor", checksum="xxh3-128", shards=2, version_style="padded")),
]


@pytest.fixture(scope="module")
def upstream_chain(fast_module_tmp):
    root = str(fast_module_tmp)
    rng = np.random.default_rng(7)
    seed, source = os.path.join(root, "seed"), os.path.join(root, "src")
    arrays = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, arrays, shards=2, extra_files={"config.json": '{"v": 0}'})
    expected = {0: tensor_bytes(arrays)}
    for version, (kind, opts) in enumerate(UPSTREAM_CHAIN, start=1):
        names = [n for n in sorted(arrays) if rng.random() < 0.6] or [sorted(arrays)[0]]
        new = mutate(arrays, rng, 0.08, names=names)
        if kind == "delta":
            upstream.write_delta_version(source, version, tensor_bytes(arrays), tensor_bytes(new), **opts)
        else:
            upstream.write_full_version(source, version, new, **opts)
        arrays = new
        expected[version] = tensor_bytes(new)
    return {"seed": seed, "source": source, "expected": expected, "latest": len(UPSTREAM_CHAIN)}


@pytest.mark.parametrize("target", range(1, len(UPSTREAM_CHAIN) + 1))
def test_fresh_pull_of_an_upstream_version_is_bit_exact(upstream_chain, fast_tmp_path, target):
    local = str(fast_tmp_path / "local")
    result = pull(local, upstream_chain["seed"], upstream_chain["source"], target)
    assert result.applied_version == target and not result.reseeded
    assert_checkpoint_is(local, upstream_chain["expected"][target])
    assert marker_version(local) == target


def test_stepwise_pulls_through_the_whole_upstream_chain_are_bit_exact(upstream_chain, fast_tmp_path):
    local = str(fast_tmp_path / "local")
    for target in range(0, upstream_chain["latest"] + 1):
        result = pull(local, upstream_chain["seed"], upstream_chain["source"], target)
        assert not result.reseeded, result
        assert_checkpoint_is(local, upstream_chain["expected"][target])


def test_seeding_from_an_indexless_full_version_takes_config_from_the_seed_dir(upstream_chain, fast_tmp_path):
    local = str(fast_tmp_path / "local")
    pull(local, upstream_chain["seed"], upstream_chain["source"], 4)  # local now has v4's sharded files
    result = pull(local, upstream_chain["seed"], upstream_chain["source"], 7)
    assert result.action == "seed"
    files = sorted(os.listdir(local))
    assert "model.safetensors" in files
    # The sharded files and index of the earlier seed are gone: the dir is one clean checkpoint.
    assert not [f for f in files if f.endswith(".safetensors") and f != "model.safetensors"]
    assert "model.safetensors.index.json" not in files
    with open(os.path.join(local, "config.json")) as f:
        assert json.load(f) == {"v": 0}  # v7 has no config: the seed dir's
    assert_checkpoint_is(local, upstream_chain["expected"][7])


def test_seeding_from_a_full_version_with_config_takes_its_config(upstream_chain, fast_tmp_path):
    local = str(fast_tmp_path / "local")
    pull(local, upstream_chain["seed"], upstream_chain["source"], 5)
    with open(os.path.join(local, "config.json")) as f:
        assert json.load(f) == {"v": 4}
    assert os.path.exists(os.path.join(local, "tokenizer.json"))  # from the seed dir
    assert_checkpoint_is(local, upstream_chain["expected"][5])


def test_independent_reader_agrees_with_itself_on_the_upstream_chain(upstream_chain):
    """Sanity of the reference implementation before it judges ours."""
    seed = upstream_chain["expected"][0]
    for v in range(1, upstream_chain["latest"] + 1):
        assert upstream.read_version(upstream_chain["source"], v, seed) == upstream_chain["expected"][v]


def test_a_sparse_v2_chain_of_the_independent_writer_pulls_bit_exact(fast_tmp_path):
    """Written from FORMAT.md alone (its own class boundaries, segments of 2^12, widths from the
    byte length), applied by our pull, step by step and folded."""
    rng = np.random.default_rng(13)
    seed, source = str(fast_tmp_path / "seed"), str(fast_tmp_path / "src")
    sizes = dict(SIZES, big=("float32", (100, 123)))
    arrays = random_tensors(rng, sizes)
    arrays["big"] = (0.02 * rng.standard_normal((100, 123))).astype(np.float32)
    write_hf_checkpoint(seed, arrays)
    expected = {0: tensor_bytes(arrays)}
    for version in range(1, 5):
        new = mutate(arrays, rng, 0.05)
        new["big"] = arrays["big"] * (1 + np.float32(1e-3) * (rng.random((100, 123)) < 0.2))
        upstream.write_delta_version(source, version, tensor_bytes(arrays), tensor_bytes(new), encoding="sparse-v2",
                                     checksum="xxh3-128", shards=2)
        assert upstream.read_version(source, version, expected[0]) == tensor_bytes(new)
        arrays = new
        expected[version] = tensor_bytes(new)
    step = str(fast_tmp_path / "step")
    for version in (1, 2):
        assert pull(step, seed, source, version, workers=2).applied_version == version
        assert_checkpoint_is(step, expected[version])
    folded = str(fast_tmp_path / "folded")
    res = pull(folded, seed, source, 4, workers=2)
    assert res.applied_version == 4 and not res.reseeded
    assert_checkpoint_is(folded, expected[4])


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "sparse-v1", "sparse-v2"])
def test_versions_our_publisher_writes_are_read_by_the_independent_reader(fast_tmp_path, encoding):
    rng = np.random.default_rng(11)
    source = str(fast_tmp_path / "src")
    arrays = random_tensors(rng, SIZES)
    expected = {0: tensor_bytes(arrays)}
    checksums = ["xxh3-128", "blake3", "adler32"]
    for version in range(1, 8):
        new = mutate(arrays, rng, 0.9 if version == 4 else 0.05, names=[n for n in sorted(arrays) if rng.random() < 0.5])
        pub = Publisher(source, encoding=encoding, checksum=checksums[version % 3], workers=2, full_every=5)
        pub.seed_snapshot(arrays, version=version - 1)
        pub.publish(version, new)  # v4: fallback to full (dense), v5: full by schedule
        pub.close()
        arrays = new
        expected[version] = tensor_bytes(new)
    kinds = {}
    for version in range(1, 8):
        with open(os.path.join(source, f"weight_v{version:06d}", "model.safetensors.index.json")) as f:
            kinds[version] = "delta" if "delta_encoding" in json.load(f)["metadata"] else "full"
        assert upstream.read_version(source, version, expected[0]) == expected[version], f"v{version}"
    assert kinds == {1: "delta", 2: "delta", 3: "delta", 4: "full", 5: "full", 6: "delta", 7: "delta"}


def test_multi_rank_versions_of_our_publisher_are_read_by_the_independent_reader(fast_tmp_path):
    rng = np.random.default_rng(12)
    source = str(fast_tmp_path / "src")
    arrays = random_tensors(rng, SIZES)
    owners = {n: i % 2 for i, n in enumerate(sorted(arrays))}
    pubs = [Publisher(source, encoding="overwrite", checksum="blake3", rank=r, world_size=2, workers=1) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot({n: a for n, a in arrays.items() if owners[n] == r})
    expected0 = tensor_bytes(arrays)
    for version in (1, 2):
        arrays = mutate(arrays, rng, 0.03)
        prepared = [pub.prepare(version, {n: a for n, a in arrays.items() if owners[n] == r}) for r, pub in enumerate(pubs)]
        kind, _ = pubs[0].choose_kind(version, sum(p.delta_nbytes for p in prepared), sum(p.full_nbytes for p in prepared))
        manifests = [pub.write(p, kind) for pub, p in zip(pubs, prepared)]
        pubs[0].commit(version, kind, manifests)
        assert upstream.read_version(source, version, expected0) == tensor_bytes(arrays)
    for pub in pubs:
        pub.close()


def test_our_pull_output_is_an_hf_checkpoint_the_safetensors_package_loads(upstream_chain, fast_tmp_path):
    local = str(fast_tmp_path / "local")
    pull(local, upstream_chain["seed"], upstream_chain["source"], upstream_chain["latest"])
    assert read_checkpoint_bytes(local) == upstream_chain["expected"][upstream_chain["latest"]]
