"""A tiny Qwen3 checkpoint built offline, and transformers' greedy output as the reference.

Role: tests and the demo need a real HF checkpoint that sglang serves on the CPU in seconds.
``make_tiny_qwen3`` writes one (bf16 safetensors, sharded with an index, plus a byte-level BPE
tokenizer trained locally); ``greedy_token_ids`` computes what a correct server must generate
greedily for the weights in a directory, and ``assert_server_greedy_equals`` checks a server
against it, id for id.

Invariants:
- No network: the tokenizer is trained from an in-code corpus, the model is randomly initialised.
- Deterministic: the same ``seed`` gives the same bytes (weights and tokenizer).
- The weights are initialised with a wide ``initializer_range`` so greedy next-token margins are
  large; with both sides computing in fp32 (``SERVER_COMPUTE_ARGS``, ``REFERENCE_DTYPE``) sglang's
  and transformers' greedy outputs agree exactly (``assert_server_greedy_equals``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_QWEN3_CONFIG = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
TOKENIZER_VOCAB_SIZE = 1000
# A variant for the coordinate map: lm_head tied to the embedding, and a vocab (the tokenizer's
# 1000) that sglang pads to a multiple of 64 per TP rank, so the padded rows come from nowhere.
TIED_PADDED_VOCAB = dict(tie_word_embeddings=True, vocab_size=TOKENIZER_VOCAB_SIZE)
EOS_TOKEN = "<|endoftext|>"
# Wide init: greedy next-token margins are large, so greedy decoding is stable across implementations.
INITIALIZER_RANGE = 0.3
# Small shards so even the tiny model is split over several files with an index.
MAX_SHARD_SIZE = "200KB"

_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while weights move from trainer to engine "
    "every version of the model is published as a delta of changed bytes and pulled by each "
    "rollout host which verifies checksums before the engine reloads its local checkpoint "
    "reinforcement learning needs fresh policy weights on every inference server quickly "
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } - + = / * "
).split()


def _training_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(_CORPUS_WORDS) for _ in range(n)))
    return lines


def make_tokenizer(out_dir: str | os.PathLike, seed: int = 0):
    """Train a ~1000-token byte-level BPE offline and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_qwen3(dir: str | os.PathLike, seed: int = 0, **config_overrides) -> str:
    """Write a tiny random Qwen3 (bf16, sharded safetensors + index) and its tokenizer to ``dir``.

    ``config_overrides`` replace entries of ``TINY_QWEN3_CONFIG`` (e.g. ``TIED_PADDED_VOCAB``).
    Returns ``dir`` as a string. The directory is created if needed; existing files are
    overwritten.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        stale.unlink()  # a shard count from an earlier layout must not linger beside the new one
    tokenizer = make_tokenizer(out, seed=seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    config = Qwen3Config(
        **{**TINY_QWEN3_CONFIG, **config_overrides},
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    # RMSNorm weights initialise to exactly 1; nudge them so every tensor carries real bytes
    # (a delta of a norm weight is then as observable as any other).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(str(out), max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    _ensure_index(out)
    return str(out)


def _ensure_index(out: Path) -> None:
    """transformers writes an index only when it shards; make the sharded layout explicit."""
    index = out / "model.safetensors.index.json"
    if not index.exists():
        raise RuntimeError(
            f"expected a sharded checkpoint with {index.name} in {out}; "
            f"lower MAX_SHARD_SIZE (now {MAX_SHARD_SIZE})"
        )
    json.loads(index.read_text())


# The dtype a test server computes in (``SglangCpuServer(extra_args=SERVER_COMPUTE_ARGS)``) and
# the reference's: the checkpoint stays bf16 on disk, both sides upcast its exact values to fp32.
# In bf16, sglang's kernels and transformers' eager path round differently, and for a random tiny
# model the top two logits are often closer than that noise; in fp32 they agree exactly.
SERVER_COMPUTE_ARGS = ("--dtype", "float32")
REFERENCE_DTYPE = "float32"


def load_model(model_dir: str | os.PathLike, dtype: str = "bfloat16"):
    """Load ``model_dir`` with transformers on the CPU (eval mode), computing in ``dtype``.

    ``bfloat16`` (default) keeps the checkpoint's own dtype; ``float32`` upcasts its values exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    return model


def greedy_token_ids(
    model_dir: str | os.PathLike, prompt: str, max_new_tokens: int, *, model=None
) -> list[int]:
    """Transformers' greedy continuation (token ids) of ``prompt`` for the weights in ``model_dir``.

    End-of-sequence does not stop decoding (the server side is asked with ``ignore_eos``), so
    exactly ``max_new_tokens`` ids come back. Plain argmax over a full forward pass per step: no
    KV-cache or generation-config logic that could differ from the server's. Computed in
    ``REFERENCE_DTYPE`` unless a ``model`` is given.
    """
    return greedy_reference(model_dir, prompt, max_new_tokens, model=model)[0]


def greedy_reference(
    model_dir: str | os.PathLike, prompt: str, max_new_tokens: int, *, model=None, tokenizer=None
) -> tuple[list[int], list[float]]:
    """(greedy ids, top-1 minus top-2 logit gap at each step) from transformers, in fp32 by default."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(model_dir))
    model = model if model is not None else load_model(model_dir, REFERENCE_DTYPE)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            next_id = int(top.indices[0])
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out, margins


# Prompts whose greedy ids a server must reproduce exactly. Smallest fp32 top-1/top-2 gap over 8
# steps, for the versions the engine tests serve (seed 0, ``testbed.feed.VersionFeed``):
# v0 0.048, v2 0.023, v3 0.00093 ("publish a delta of changed bytes", step 0), v4 0.0026. The
# fp32 difference between sglang's kernels and transformers' is ~100x smaller (measured at TP=2 on
# v0: top-5 logprobs of every step agree within 9e-6), so exact equality holds with room to spare.
REFERENCE_PROMPTS = (
    "the quick brown fox",
    "weights move from trainer to engine",
    "every version of the model",
    "numbers 0 1 2 3",
    "reinforcement learning needs fresh policy",
    "the lazy dog while",
    "publish a delta of changed bytes",
    "each rollout host verifies checksums",
    "fresh policy weights on every inference server",
    "( ) [ ] { } - + = / *",
)


def assert_server_greedy_equals(
    generate_ids,
    model_dir: str | os.PathLike,
    *,
    prompts=REFERENCE_PROMPTS,
    max_new_tokens: int = 8,
) -> dict[str, list[int]]:
    """Assert a server's greedy ids equal transformers' for the weights in ``model_dir``, exactly.

    ``generate_ids(prompt, max_new_tokens) -> ids`` asks the server (greedy, ``ignore_eos``); the
    server must compute in fp32 (``SERVER_COMPUTE_ARGS``), as the reference does
    (``REFERENCE_DTYPE``, the bf16 checkpoint loaded upcast). No tolerance: every id of every
    prompt must match. A failure names the first differing step and transformers' top-1/top-2 gap
    there, so a genuine near-tie (a gap of ~1e-5, which fp32 rounding could flip) is told apart
    from wrong weights (which miss by whole logits); the remedy for a near-tie is a prompt with a
    clear margin, not a tolerance. Returns the server's ids per prompt.
    """
    from transformers import AutoTokenizer

    model = load_model(model_dir, REFERENCE_DTYPE)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    served: dict[str, list[int]] = {}
    for prompt in prompts:
        got = list(generate_ids(prompt, max_new_tokens))
        want, margins = greedy_reference(model_dir, prompt, max_new_tokens, model=model, tokenizer=tokenizer)
        if got != want:
            step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            gap = f"{margins[step]:.3g}" if step < len(margins) else "n/a"
            raise AssertionError(
                f"{prompt!r}: server's greedy ids {got} != transformers' {want} for {model_dir} "
                f"(first difference at step {step}; transformers' top-1/top-2 gap there: {gap})"
            )
        served[prompt] = got
    return served


def read_state_dict(model_dir: str | os.PathLike) -> dict:
    """All tensors of an HF safetensors checkpoint dir, by name (torch tensors, CPU)."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def to_raw_tensors(tensors: dict) -> dict:
    """torch tensors -> ``weightsync.RawTensor`` (safetensors dtype names, raw bytes)."""
    import torch
    from weightsync import RawTensor

    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
    out = {}
    for name, t in tensors.items():
        t = t.contiguous()
        out[name] = RawTensor(names[t.dtype], tuple(t.shape), t.view(torch.uint8).reshape(-1).numpy())
    return out


def perturb_state_dict(
    tensors: dict, step: int, *, fraction: float = 0.05, scale: float = 0.5, seed: int = 0, names=None
) -> dict:
    """A new state dict: ``fraction`` of each tensor's elements get noise (deterministic per step).

    Large enough changes (``scale`` relative to the init range) that greedy output moves.
    ``names`` (default: all) limits the change to some tensors.
    """
    import torch

    gen = torch.Generator().manual_seed(seed * 100003 + step)
    out = {}
    for name in sorted(tensors):
        t = tensors[name].clone()
        if names is not None and name not in names:
            out[name] = t
            continue
        mask = torch.rand(t.shape, generator=gen) < fraction
        noise = torch.randn(t.shape, generator=gen) * scale
        out[name] = torch.where(mask, (t.float() + noise).to(t.dtype), t)
    return out


def write_trained_copy(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int = 1,
                       fraction: float = 0.05, seed: int = 0) -> str:
    """``model_dir`` copied to ``out_dir`` (same shards, config and tokenizer) with ``fraction``
    of every tensor's elements changed, as a training step would (``perturb_state_dict``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError("the trained copy needs a directory of its own")
    shutil.copytree(src, out, dirs_exist_ok=True)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = perturb_state_dict(load_file(str(shard)), step, fraction=fraction, seed=seed)
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    return str(out)


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m testbed.tiny_qwen3",
        description="Write a tiny random Qwen3 (bf16 safetensors in shards, with its tokenizer; about 1 MiB, "
                    "no network), or with --from a copy of one with some elements changed, as after a training step.",
        epilog="examples:\n"
               "  python -m testbed.tiny_qwen3 /tmp/ws/model                                 # version 0\n"
               "  python -m testbed.tiny_qwen3 /tmp/ws/step1 --from /tmp/ws/model --step 1   # the weights of step 1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", metavar="OUT", help="directory to write (created; its safetensors files are replaced)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights and the tokenizer (default: %(default)s)")
    p.add_argument("--from", dest="base", metavar="MODEL", default=None,
                   help="copy MODEL and change some of its elements instead of making a new model (default: a new model)")
    p.add_argument("--step", type=int, default=1, help="with --from: which step's changes (default: %(default)s)")
    p.add_argument("--change", type=float, default=0.05, metavar="F",
                   help="with --from: the fraction of each tensor's elements changed (default: %(default)s)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.base:
        out = write_trained_copy(args.base, args.out, step=args.step, fraction=args.change, seed=args.seed)
    else:
        out = make_tiny_qwen3(args.out, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
