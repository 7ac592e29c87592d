"""Shared harness of the unit tests that run real Megatron ranks on gloo, one process per rank.

Role: start the test module itself once per rank as a child process (the module's ``__main__``
runs the rank's work and writes ``<out_dir>/rank<r>.json``), wait for every rank, fail the test
with the tail of each rank's log when any rank failed, and hand back what each rank recorded; in
the rank, a deterministic stand-in for an optimizer step; in the parent, the tiny tied checkpoint
and byte-exact reads of what was published.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(script: str, cfg: dict, ranks: int = 2) -> tuple[list[dict], list[str]]:
    """Run ``script <rank> <cfg as json>`` for every rank at once; -> (each rank's json, each rank's log)."""
    os.makedirs(cfg["out_dir"])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, script, str(rank), json.dumps(cfg)], env=env, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(ranks)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks failed {failed}:\n" + "\n".join(log[-4000:] for log in logs)
    seen = [json.loads((Path(cfg["out_dir"]) / f"rank{r}.json").read_text()) for r in range(ranks)]
    return seen, logs


def move_weights(model, step: int) -> None:
    """A deterministic "optimizer step": 1% of each parameter's elements move."""
    import torch

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(10_000 * step + i)
            flat = p.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            flat[idx] += torch.randn(idx.numel(), generator=g) * 0.05


def full_vocab_logits(model, ids, tp: int):
    """In a rank at PP=1: Megatron's logits for ``ids`` (one sequence), every TP rank's vocab shard gathered
    (a collective: every TP rank calls it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles_updater.megatron_cpu import causal_attention_mask

    n = ids.shape[1]
    with torch.no_grad():
        logits = model(ids, torch.arange(n)[None], causal_attention_mask(n))
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def make_tied_tiny_qwen3(d: Path) -> str:
    """A tiny Qwen3 with tied input/output embeddings (no lm_head.weight in the checkpoint), in ``d``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from testbed.tiny_qwen3 import TINY_QWEN3_CONFIG

    torch.manual_seed(5)
    cfg = Qwen3Config(**{**TINY_QWEN3_CONFIG, "tie_word_embeddings": True}, initializer_range=0.3)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d), max_shard_size="200KB")
    return str(d)


def read_dir(path) -> dict:
    """Every tensor of the safetensors files in ``path``."""
    from safetensors.torch import load_file

    merged = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        merged.update(load_file(str(f)))
    return merged


def bytes_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
