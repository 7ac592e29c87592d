"""What a seed copies: exactly the weight files the seed's index names, its index, and the small
non-weight files an engine needs. Never another format's weights, another index, or a killed
writer's temporary files, from the seed dir or from a full version.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from weightsync import Publisher, pull

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

SIZES = {"a": ("float32", (64,)), "b": ("int16", (8, 4)), "c": ("float32", (16,))}
ENGINE_FILES = {
    "config.json": '{"model_type": "toy"}',
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "generation_config.json": "{}",
    "special_tokens_map.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "tokenizer.model": "spm",
    "merges.txt": "a b",
}
FOREIGN_FILES = {
    "pytorch_model.bin": "torch pickle",
    "pytorch_model.bin.index.json": '{"weight_map": {"a": "pytorch_model.bin"}}',
    "consolidated.safetensors": "mistral-format weights",
    "model.pt": "torch pickle",
    "model-00001-of-00002.safetensors.tmp.4242": "a killed publisher's shard",
    "config.json.tmp.77": "a killed publisher's config",
}


def top_level(directory: str) -> set[str]:
    return {n for n in os.listdir(directory) if not n.startswith(".")}


@pytest.fixture
def world(fast_tmp_path):
    root = str(fast_tmp_path)
    rng = np.random.default_rng(9)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t0 = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, t0, shards=2, extra_files=ENGINE_FILES | FOREIGN_FILES)
    return {"seed": seed, "source": source, "local": local, "t0": t0, "rng": rng}


def seed_weight_files() -> set[str]:
    return {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"}


def test_seed_from_the_seed_dir_copies_only_named_weights_and_engine_files(world):
    pull(world["local"], world["seed"], world["source"], 0)
    assert top_level(world["local"]) == seed_weight_files() | set(ENGINE_FILES)
    assert_checkpoint_is(world["local"], tensor_bytes(world["t0"]))


def test_full_version_carries_no_template_weights_of_another_format(world):
    t1 = mutate(world["t0"], world["rng"], 0.2)
    pub = Publisher(world["source"], template_dir=world["seed"], workers=1)
    pub.seed_snapshot(world["t0"], version=0)
    pub.publish(1, t1, full=True)
    pub.close()
    vdir = os.path.join(world["source"], "weight_v000001")
    assert not top_level(vdir) & set(FOREIGN_FILES)
    assert set(ENGINE_FILES) <= top_level(vdir)


def test_seed_from_a_full_version_skips_leftover_temporary_and_foreign_files(world):
    t1 = mutate(world["t0"], world["rng"], 0.2)
    pub = Publisher(world["source"], workers=1)  # no template: the seed dir fills in config and tokenizer
    pub.seed_snapshot(world["t0"], version=0)
    pub.publish(1, t1, full=True)
    pub.close()
    vdir = os.path.join(world["source"], "weight_v000001")
    shard = sorted(n for n in os.listdir(vdir) if n.endswith(".safetensors"))[0]
    leftovers = {f"{shard}.tmp.31337": "half a shard", "generation_config.json.tmp.31337": "{",
                 "pytorch_model.bin": "stale", "consolidated.safetensors": "stale"}
    for name, text in leftovers.items():
        with open(os.path.join(vdir, name), "w") as f:
            f.write(text)
    pull(world["local"], world["seed"], world["source"], 1)
    local = top_level(world["local"])
    assert not local & (set(leftovers) | set(FOREIGN_FILES))
    assert set(ENGINE_FILES) <= local
    assert_checkpoint_is(world["local"], tensor_bytes(t1))


def test_reseed_removes_foreign_weight_files_an_older_seed_left_locally(world):
    pull(world["local"], world["seed"], world["source"], 0)
    stale = os.path.join(world["local"], "pytorch_model.bin")
    with open(stale, "w") as f:
        f.write("copied by an older puller")
    os.unlink(os.path.join(world["local"], ".weight_sync", "state.json"))  # no marker: the next pull seeds
    pull(world["local"], world["seed"], world["source"], 0)
    assert not os.path.exists(stale)
