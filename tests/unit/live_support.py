"""Shared helpers of the live-apply unit tests (``sglang_patch.live_*``): torch only, no sglang.

Role: the changed positions between two versions as a pull would list them, a checkpoint reader
over tensors in memory, a model with one parameter per checkpoint tensor, and one rank's
``LiveApplyState`` serving that model from a real local checkpoint.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch


def changed_positions(v0: dict, v1: dict):
    """(name, None, flat positions that differ) for each tensor ``v1`` changed, in name order."""
    for name in sorted(v0):
        pos = np.flatnonzero((v0[name] != v1[name]).reshape(-1).numpy()).astype(np.int64)
        if pos.size:
            yield name, None, pos


class TensorReader:
    """A checkpoint reader over tensors held in memory."""

    def __init__(self, tensors):
        self.tensors = tensors

    def tensor(self, name):
        return self.tensors[name]


class FlatModel(torch.nn.Module):
    """One parameter per checkpoint tensor, loaded by a plain copy."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        self.names = sorted(tensors)
        for i, name in enumerate(self.names):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros_like(tensors[name]), requires_grad=False))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[f"p{self.names.index(name)}"].data.copy_(t)


def serve_from_local(local: str, model_dir: str, live_reason: str):
    """One rank's ``LiveApplyState`` whose engine (a ``FlatModel``) reloaded from ``local`` at the
    version it holds; its map built, not proven. -> (state, model)"""
    from sglang_patch.live.coordinate_map import CheckpointReader, build_coordinate_map
    from sglang_patch.pull.coordinator import SingleRankGroup
    from sglang_patch.live.identity import from_held
    from sglang_patch.live.state import LiveApplyState
    from testbed.tiny_qwen3 import read_state_dict
    from weightsync.codecs.positions import held_version

    tensors = read_state_dict(local)
    model = FlatModel(tensors)
    model.load_weights(tensors.items())
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    state = LiveApplyState(scheduler=scheduler, group=SingleRankGroup(), host="host/node0", rank="dp0/tp0",
                           seed_dir=model_dir, allowed_roots=(), max_changed_fraction=0.1)
    state.proof.cmap = build_coordinate_map(model, CheckpointReader(local).specs())
    state.weights.live = from_held(held_version(local), live_reason)
    state.weights.live_dir = local
    return state, model
