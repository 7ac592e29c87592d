"""A Megatron trainer as Ray actors on the CPU: real optimizer steps, then a disk-delta sync.

Role: the trainer side of the demo and of the end-to-end tests. Each actor is one Megatron
rank (gloo on 127.0.0.1), owns a tiny GPTModel loaded from ``--hf-checkpoint``, takes real Adam
steps on a fixed language-modelling batch, and syncs through ``DiskDeltaWeightUpdater``, exactly
as a miles/slime Megatron actor would. Rank 0 also drives the engines and can say what the
trainer's current weights generate greedily (transformers on the very bytes it published).
"""

from __future__ import annotations

import logging
import os

import ray


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("megatron", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


@ray.remote(num_cpus=1)
class MegatronCPUTrainer:
    """One trainer rank. Construct ``world`` of them with the same ``master_port``."""

    def __init__(self, rank: int, world: int, master_port: int, config, *, tp: int = 1, pp: int = 1,
                 lr: float = 3e-4, seed: int = 0, run_id: str | None = None, threads: int = 1,
                 device: str = "cpu", resume_from: str | None = None):
        import warnings

        warnings.filterwarnings("ignore")
        _setup_logging()
        import torch

        torch.set_num_threads(threads)
        from .gather import load_hf_checkpoint
        from .megatron_cpu import build_gpt_model, init_distributed_cpu
        from .updater import DiskDeltaWeightUpdater

        self.rank = rank
        self.config = config
        self.device = device
        if device == "cuda":  # the GPU test: Ray gives each actor one GPU (device 0 for it)
            torch.cuda.set_device(0)
        init_distributed_cpu(rank, world, master_port, tp=tp, pp=pp, seed=seed,
                             backend="nccl" if device == "cuda" else "gloo")
        self.model = build_gpt_model(config.hf_checkpoint)
        load_hf_checkpoint([self.model], config.hf_checkpoint)
        self.model.to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        if resume_from is not None:  # a restarted trainer: the model and optimizer of a saved step
            state = torch.load(os.path.join(resume_from, f"rank{rank}.pt"), map_location=device)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.updater = DiskDeltaWeightUpdater(config, [self.model], run_id=run_id)
        self.batch = self._make_batch(seed)
        self._reference_model = None

    def _make_batch(self, seed: int):
        """A fixed 2 x 64-token batch of in-domain text (next-token labels)."""
        import torch
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.config.hf_checkpoint)
        text = ("every version of the model is published as a delta of changed bytes and pulled by each "
                "rollout host which verifies checksums before the engine reloads its local checkpoint ") * 4
        ids = torch.tensor(tok(text).input_ids)
        rows = torch.stack([ids[seed % 7: seed % 7 + 65], ids[20 + seed % 5: 20 + seed % 5 + 65]])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def connect_rollout_engines(self, engine_handles, names=None) -> None:
        self.updater.connect_rollout_engines(engine_handles, names)

    def start(self) -> dict:
        self.updater.start()
        return {"run_id": self.updater.run_id, "source_dir": self.updater.source_dir,
                "snapshot_nbytes": self.updater.snapshot_nbytes()}

    def train_step(self) -> float:
        """One real optimizer step (forward, backward, Adam) on the fixed batch; the loss."""
        import torch

        from .megatron_cpu import causal_attention_mask

        inputs, labels = (t.to(self.device) for t in self.batch)
        seq = inputs.shape[1]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        positions = torch.arange(seq, device=self.device)[None].expand_as(inputs)
        losses = self.model(inputs, positions, causal_attention_mask(seq).to(self.device), labels=labels)
        loss = losses.float().mean()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def save_checkpoint(self, directory: str) -> None:
        """This rank's model and optimizer state (what a resumed trainer loads with ``resume_from``)."""
        import torch

        os.makedirs(directory, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   os.path.join(directory, f"rank{self.rank}.pt"))

    def update_weights(self, update_engines: bool = True) -> dict:
        """Publish the next version and (by default) bring the engines to it (every rank calls this)."""
        return self.updater.update_weights(update_engines=update_engines).as_dict()

    def update_engines_to(self, version: int | None = None) -> dict:
        """Bring the engines to an already published version (every rank calls this)."""
        return self.updater.update_engines_to(version).as_dict()

    def source_dir(self) -> str:
        return self.updater.source_dir

    def reference_greedy(self, prompt: str, max_new_tokens: int) -> list[int]:  # noqa: D401
        """What the trainer's current weights generate greedily: transformers on the published bytes.

        Uses the staging buffers of the last gather (the exact bytes of the last published
        version); rank 0 of a PP=1 trainer holds every tensor.
        """
        return greedy_from_tensors(self.config.hf_checkpoint, self.published_tensors(), prompt, max_new_tokens)

    def published_tensors(self) -> dict:
        """name -> torch tensor (checkpoint dtype) of the last version this rank published."""
        import torch

        from .gather import ST_TO_TORCH

        out = {}
        for name, raw in self.updater.gatherer.owned_tensors().items():
            t = torch.frombuffer(bytearray(raw.data), dtype=torch.uint8) if raw.data.size else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(ST_TO_TORCH[raw.dtype]).reshape(raw.shape)
        return out

    def published_digests(self) -> dict:
        """name -> xxh3-128 of the bytes this rank published last (cheap to ship, for big models)."""
        import xxhash

        return {n: xxhash.xxh3_128_hexdigest(t.data) for n, t in self.updater.gatherer.owned_tensors().items()}

    def close(self) -> None:
        self.updater.close()


def greedy_from_tensors(hf_dir: str, tensors: dict, prompt: str, max_new_tokens: int,
                        compute_dtype=None) -> list[int]:
    """Transformers' greedy continuation for ``tensors`` (an HF state dict) with ``hf_dir``'s config.

    A plain argmax over a full forward pass per step, EOS not stopping: the same rule a greedy
    ``/generate`` with ``ignore_eos`` follows. ``compute_dtype`` (default float32) is the dtype
    the model computes in; the weights' values are exactly the given (bf16) bytes either way.
    Computing in fp32 on both sides (the engines run ``--dtype float32``) keeps near-tied
    logits of a model mid-training from flipping greedy choices between two bf16 kernels.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype or torch.float32)
    model.load_state_dict(tensors, strict=not getattr(config, "tie_word_embeddings", False))
    model.eval()
    ids = AutoTokenizer.from_pretrained(hf_dir)(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(torch.argmax(model(ids).logits[0, -1].float()))
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out
