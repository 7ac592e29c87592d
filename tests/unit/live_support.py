"""Shared helpers of the live-apply unit tests (``sglang_patch.live_*``): torch only, no sglang.

Role: the changed positions between two versions as a pull would list them, a checkpoint reader
over tensors in memory, a model with one parameter per checkpoint tensor, one rank's
``LiveApplyState`` serving that model from a real local checkpoint, a tiny published chain
pulled at v1, a recorder of the new tensors a block makes (also used by the GPU kit,
``benchmarks/gpu_check.py``), and sglang imported with the CPU-test stand-ins.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


SCAFFOLDING = str(Path(__file__).resolve().parents[1] / "cpu_scaffolding")


@contextlib.contextmanager
def cpu_standins_on_path():
    """Import sglang with the CPU-test stand-ins, then take them off the path again so that
    other tests in this process do not see a fake ``torchvision``."""
    before_meta = list(sys.meta_path)
    sys.path.insert(0, SCAFFOLDING)
    try:
        yield
    finally:
        sys.path.remove(SCAFFOLDING)
        sys.meta_path[:] = [f for f in sys.meta_path if f in before_meta or not type(f).__name__.startswith("_StandIn")]
        for name in list(sys.modules):
            if name.split(".")[0] in ("torchvision", "sgl_kernel", "_cpu_standin"):
                del sys.modules[name]


def tiny_chain_pulled_at_v1(root: Path) -> SimpleNamespace:
    """A tiny Qwen3 checkpoint under ``root``, v1 and v2 published, the local dir pulled to v1."""
    from testbed.feed import VersionFeed
    from testbed.tiny_qwen3 import make_tiny_qwen3
    from weightsync import pull

    model_dir = make_tiny_qwen3(root / "model")
    feed = VersionFeed(model_dir, root / "shared")
    feed.publish(1)
    feed.publish(2)
    local = str(root / "local")
    pull(local, model_dir, feed.source_dir, 1)
    return SimpleNamespace(root=str(root), local=local, model_dir=model_dir, feed=feed, pull=pull)


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
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader, build_coordinate_map
    from sglang_patch.pull.coordinator import SingleRankGroup
    from sglang_patch.live.identity import from_held
    from sglang_patch.live.state import LiveApplyState
    from testbed.tiny_qwen3 import read_state_dict
    from weightsync.puller.positions import held_version

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


class CacheFlushUpdater:
    """The scheduler's weight updater, as far as a commit uses it (the cache flush)."""

    def flush_cache_after_weight_update(self, request):
        return None


def pull_local_v1(served) -> None:
    """The local dir at v1 (from the seed again: deltas only go forward)."""
    served.pull(served.local, served.model_dir, served.feed.source_dir, 0)
    served.pull(served.local, served.model_dir, served.feed.source_dir, 1)


def stage_v2(state, served) -> None:
    """Stage v2 on ``state``, its scheduler loop driven by another thread meanwhile."""
    import threading

    from sglang_patch.live.mapping.stage import stage_job

    stop = threading.Event()

    def scheduler_loop():
        while not stop.is_set():
            state.loop.run_slice()

    loop = threading.Thread(target=scheduler_loop, name="scheduler-loop", daemon=True)
    loop.start()
    try:
        while not state.loop.is_driven:
            pass
        state.stage_after_pull(served.local, served.feed.source_dir, 2, stage_job)
    finally:
        stop.set()
        loop.join(timeout=30)


def staged_state_serving_v1(served):
    """A proven rank serving v1 with v2 pulled and staged (its loop driven by another thread).
    ``served`` is ``tiny_chain_pulled_at_v1``'s. -> (state, model)"""
    import os

    from sglang_patch.live.identity import LiveVersion
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from weightsync.puller.positions import held_version

    pull_local_v1(served)
    state, model = serve_from_local(served.local, served.model_dir, "reload (test)")
    state.proof.prove(CheckpointReader(served.local), state.live, checkpoint_dir=served.local)
    assert state.cmap.proven
    served.pull(served.local, served.model_dir, served.feed.source_dir, 2)
    held = held_version(served.local)
    state.weights.live = LiveVersion(1, os.path.realpath(served.feed.source_dir), "test: serving v1", held.run, held.seed)
    state.scheduler.weight_updater = CacheFlushUpdater()
    state.allowed_roots = (served.root,)
    stage_v2(state, served)
    assert state.weights.staged is not None, state.weights.stage_reason
    return state, model


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class NewTensors(TorchDispatchMode):
    """Entered with ``with``: records every op whose output tensor has a storage none of its
    inputs has (``created``: factory ops, ``.to``/``_to_copy``, ``clone``, a gather's result...;
    views and in-place or ``out=`` ops make none), the storages ops read or wrote (``touched``),
    and factory calls that asked for pinned memory (``pinned``; run unpinned, so that a CPU-only
    build can record them). It sees torch's operators, not what a kernel allocates for itself
    (``torch.cuda.memory_stats`` counts that)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self.touched: set[int] = set()
        self.pinned: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {storage_of(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.touched |= inputs
        if kwargs.get("pin_memory"):
            self.pinned.append(str(func))
            kwargs = {**kwargs, "pin_memory": False}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and storage_of(t) not in inputs:
                self.created.append(f"{func}: {tuple(t.shape)} {t.dtype} on {t.device}")
        return out


def stage_one_position_twice(staged, victim, first=1):
    """The fault the read-back is there for, made for real: entry ``first + 1`` of ``victim``'s
    patch names entry ``first``'s position with another value, so entry ``first``'s write is
    overwritten and does not hold what was staged for it. Returns (position, the two values)."""
    k, p = next((k, p) for k, p in enumerate(staged.patches) if p.param == victim)
    index, values, old = p.index.clone(), p.values.clone(), p.old.clone()
    index[first + 1], old[first + 1] = index[first], old[first]
    values[first + 1] = -values[first] - 1
    a, b = float(values[first]), float(values[first + 1])
    assert a != b
    staged.patches[k] = p._replace(index=index, values=values, old=old)
    return int(index[first]), {a, b}


def assert_names_the_position(message, position, values):
    """The message names ``position`` and the two values staged for it (whichever write won)."""
    import re

    found = re.search(r"first at flat position (\d+): expected (\S+), found (\S+)$", message)
    assert found and int(found[1]) == position, message
    assert {float(found[2]), float(found[3])} == values, message
