"""miles_updater: the trainer side of disk-delta weight sync for miles/slime (Megatron + Ray).

Each sync gathers the Megatron weights as the HF checkpoint's tensors (one source rank per
pipeline stage), publishes them as version v on a shared filesystem (a delta of the changed
bytes, or a full checkpoint), then has every rollout engine pull v to its host-local
checkpoint while it keeps generating, and reloads it. Depends on the ``weightsync`` core; the
core never imports this package. torch, megatron-core and ray are imported by the modules that
need them (``gather``, ``updater``, ``cpu_trainer``), not here.

    args         the argparse group and its validation (miles and slime spellings)
    hf_mapping   Megatron <-> HF names and layouts (Qwen3, Llama; dense and MoE)
    gather       TP/EP gathers, dtype cast, checks against --hf-checkpoint, PP de-duplication
    engines      the sglang HTTP client (timeouts, retries) and engine groups (threads, Ray)
    engine_sync  EngineSync: the engine call order, live apply or reload, SyncMetrics (no torch)
    updater      DiskDeltaWeightUpdater (every rank): gather, publish (with retries), then EngineSync
    engine_wait  the other ranks' wait for rank 0's engine phase: the store, a heartbeat, no collective
    runs         run dirs under the disk dir: numbering across restarts, retention
    torch_publish TorchWeightSync: the same from any PyTorch model or state dict (no Megatron)
    megatron_cpu CPU scaffolding: Megatron's CPU shims, a GPTModel from an HF config
    cpu_trainer  a Megatron trainer as Ray actors on the CPU (demo, end-to-end tests)
    demo         ``python -m miles_updater.demo``
"""

from .args import (
    DiskDeltaConfig,
    UpdateWeightArgsError,
    add_update_weight_arguments,
    is_disk_delta,
    validate_update_weight_args,
)
from .engines import EngineCallError, EngineSyncError, SGLangEngineClient

__all__ = [
    "DiskDeltaConfig",
    "UpdateWeightArgsError",
    "add_update_weight_arguments",
    "is_disk_delta",
    "validate_update_weight_args",
    "EngineCallError",
    "EngineSyncError",
    "SGLangEngineClient",
    "DiskDeltaWeightUpdater",
    "EngineSync",
    "SyncMetrics",
    "HFWeightGatherer",
    "TorchWeightSync",
]


def __getattr__(name):  # lazy: torch/megatron load only when these are used
    if name in ("EngineSync", "SyncMetrics"):
        from . import engine_sync

        return getattr(engine_sync, name)
    if name == "DiskDeltaWeightUpdater":
        from .updater import DiskDeltaWeightUpdater

        return DiskDeltaWeightUpdater
    if name == "TorchWeightSync":
        from .torch_publish import TorchWeightSync

        return TorchWeightSync
    if name == "HFWeightGatherer":
        from .gather import HFWeightGatherer

        return HFWeightGatherer
    raise AttributeError(name)
