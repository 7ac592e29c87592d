"""A Qwen3-shaped bf16 checkpoint that a real sglang CPU server serves, and published versions
that change an exact fraction of its elements (for the engine benchmark, bench_engine.py).

The trainer simulation of bench_data.py keeps fp32 weights and Adam moments (16 bytes per
element), too much for a 1.3 GB model on a shared 24 GiB box; the engine benchmark measures
pull and pause, whose cost depends on how many elements change, not on why. So each version
flips the lowest mantissa bit of a chosen fraction of the elements of every tensor (one ulp, a
finite value stays finite) at random positions, and the weights are bf16 of N(0, 0.02) (norms
near 1), so the served model's output is arbitrary but its arithmetic sane.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_data import Shape, qwen3_tensors  # noqa: E402
from weightsync import Publisher, RawTensor  # noqa: E402
from weightsync.fsio import write_file  # noqa: E402
from weightsync.format.safetensors_io import iter_file_chunks  # noqa: E402

ENGINE_PRESETS = {
    # the shape: ~650M elements (1.3 GB of bf16), 223 tensors, tied embeddings
    "engine-1.3g": Shape(hidden=1536, intermediate=4608, layers=20, heads=16, kv_heads=8, head_dim=128, vocab=32768),
    # a few MB: the smoke test of the benchmark itself
    "engine-tiny": Shape(hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=1024),
    # the real Qwen3-4B layout: 8.0 GB of bf16, 398 tensors (bigbox.sh)
    "qwen3-4b": Shape(hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936),
}
SHARD_NBYTES = 1 << 30


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator, *, norm: bool) -> np.ndarray:
    """bf16 bits (uint16) of N(0, 0.02), or of N(1, 0.05) for a norm weight."""
    x = rng.standard_normal(int(np.prod(shape)), dtype=np.float32)
    x *= 0.05 if norm else 0.02
    if norm:
        x += 1.0
    return (x.view(np.uint32) >> 16).astype(np.uint16).reshape(shape)


def config_json(shape: Shape, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }


def write_model(model_dir: str, tensors: dict[str, np.ndarray], shape: Shape) -> None:
    """A servable HF checkpoint dir: config, a tokenizer trained offline, sharded bf16 weights."""
    from testbed.tiny_qwen3 import EOS_TOKEN, make_tokenizer

    os.makedirs(model_dir, exist_ok=True)
    tokenizer = make_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config_json(shape, tokenizer.convert_tokens_to_ids(EOS_TOKEN)), f, indent=1)
    write_sharded_weights(model_dir, tensors)


def write_sharded_weights(model_dir: str, tensors: dict[str, np.ndarray]) -> None:
    """bf16 safetensors shards of at most SHARD_NBYTES each (names in order) and their index."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > SHARD_NBYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        entries = [(n, "BF16", tuple(tensors[n].shape), tensors[n]) for n in names]
        write_file(os.path.join(model_dir, fname), iter_file_chunks(entries, {"format": "pt"}))
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def flip_fraction(tensors: dict[str, np.ndarray], fraction: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A new version: the lowest mantissa bit of ``fraction`` of each tensor's elements flipped."""
    out = {}
    for name, old in tensors.items():
        new = old.copy()
        flat = new.reshape(-1)
        k = int(round(fraction * flat.size))
        if k:
            positions = np.unique(rng.integers(0, flat.size, size=k, dtype=np.int64))
            flat[positions] ^= np.uint16(1)
        out[name] = new
    return out


def build(work: str, preset: str, fractions: list[float], seed: int = 0) -> tuple[str, str, list[dict]]:
    """(model dir, source dir, per-version facts): v1..vN each change ``fractions[i]`` of v(i-1)."""
    shape = ENGINE_PRESETS[preset]
    rng = np.random.default_rng(seed)
    v0 = {n: random_bf16(s, rng, norm=len(s) == 1) for n, s in qwen3_tensors(shape).items()}
    model_dir = os.path.join(work, "model")
    source_dir = os.path.join(work, "source")
    write_model(model_dir, v0, shape)
    pub = Publisher(source_dir)
    pub.seed_snapshot({n: RawTensor("BF16", tuple(a.shape), a) for n, a in v0.items()})
    versions = []
    cur = v0
    for version, fraction in enumerate(fractions, start=1):
        cur = flip_fraction(cur, fraction, rng)
        res = pub.publish(version, {n: RawTensor("BF16", tuple(a.shape), a) for n, a in cur.items()})
        versions.append(dict(version=version, kind=res.kind, changed=res.changed_fraction, wire_nbytes=res.wire_nbytes))
    pub.close()
    return model_dir, source_dir, versions


def build_or_reuse(data_dir: str, preset: str, fractions: list[float]) -> tuple[str, str, list[dict]]:
    """``build`` into ``data_dir`` once; later calls with the same preset and fractions reuse it."""
    facts_path = os.path.join(data_dir, "facts.json")
    want = {"preset": preset, "fractions": list(fractions)}
    try:
        with open(facts_path) as f:
            facts = json.load(f)
        if {k: facts.get(k) for k in want} == want:
            return os.path.join(data_dir, "model"), os.path.join(data_dir, "source"), facts["versions"]
    except (OSError, ValueError):
        pass
    for sub in ("model", "source"):
        shutil.rmtree(os.path.join(data_dir, sub), ignore_errors=True)
    model_dir, source_dir, versions = build(data_dir, preset, fractions)
    with open(facts_path, "w") as f:
        json.dump({**want, "versions": versions}, f)
    return model_dir, source_dir, versions
