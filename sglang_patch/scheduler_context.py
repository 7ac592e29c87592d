"""What a scheduler process knows of its place in the engine, as both features need it.

Its TP group's collectives over gloo (``TorchCpuGroup``), the channel between pipeline stages over
the torch.distributed store (``StoreStageChannel``), its rank's label, and the engine's own model
as a local dir (version 0). Used by the pull's and live apply's glue (``scheduler_side``,
``live_hooks``), which is why it lives in neither.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

from . import compat
from .pull.coordinator import SingleRankGroup
from .pull.results import host_label


class TorchCpuGroup:
    """The coordinator's collectives over a gloo (CPU) process group."""

    def __init__(self, cpu_group: Any, size: int) -> None:
        self.cpu_group = cpu_group
        self.size = size

    def all_min(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())

    def all_gather(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


class StoreStageChannel:
    """The coordinator's ``StageChannel`` over a torch.distributed store (set/check/get/delete)."""

    PREFIX = "weightsync/pull_weights/"

    def __init__(self, store: Any) -> None:
        self.store = store

    def post(self, key: str, value: Any) -> None:
        self.store.set(self.PREFIX + key, pickle.dumps(value))

    def take(self, key: str) -> Any:
        key = self.PREFIX + key
        if not self.store.check([key]):
            return None
        value = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return value


def resolve_seed_dir(model_path: Optional[str], download_dir: Optional[str] = None) -> Optional[str]:
    """The engine's own model as a local dir (version 0), or None if it is not one."""
    if not model_path:
        return None
    if os.path.isdir(model_path):
        return os.path.realpath(model_path)
    try:  # a hub id that sglang downloaded at start-up: its local snapshot
        from huggingface_hub import snapshot_download

        return os.path.realpath(snapshot_download(model_path, cache_dir=download_dir, local_files_only=True))
    except Exception:
        return None


def rank_label(dp_rank: int, pp_rank: int, pp_size: int, tp_rank: int) -> str:
    """'dp0/tp1', or 'dp0/pp1/tp0' with pipeline stages."""
    return f"dp{dp_rank}/pp{pp_rank}/tp{tp_rank}" if pp_size > 1 else f"dp{dp_rank}/tp{tp_rank}"


def stage_channel() -> StoreStageChannel:
    import torch.distributed as dist

    return StoreStageChannel(dist.distributed_c10d._get_default_store())


@dataclass(frozen=True)
class RankContext:
    """One scheduler rank's place in the engine, as the pull and live apply both set up from."""

    host: str  # 'h/node0'
    rank: str  # 'dp0/tp1', 'dp0/pp1/tp0'
    tp_rank: int
    pp_rank: int
    pp_size: int
    group: Any  # the TP group's collectives (TorchCpuGroup, or SingleRankGroup without TP)
    channel: Optional[StoreStageChannel]  # to the other pipeline stages (None without them)
    seed_dir: Optional[str]  # the engine's own model as a local dir (version 0)

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0


def rank_context_of(scheduler: Any) -> RankContext:
    """This scheduler's ``RankContext`` (call once its process groups exist)."""
    from sglang.srt.runtime_context import get_parallel

    server_args = scheduler.server_args
    parallel = get_parallel()
    tp_size, tp_rank = int(parallel.tp_size), int(parallel.tp_rank)
    pp_size, pp_rank = int(getattr(parallel, "pp_size", 1) or 1), int(getattr(parallel, "pp_rank", 0) or 0)
    dp_rank = compat.dp_rank_of(scheduler, parallel)
    return RankContext(
        host=host_label(int(getattr(server_args, "node_rank", 0) or 0)),
        rank=rank_label(dp_rank or 0, pp_rank, pp_size, tp_rank),
        tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pp_size,
        group=TorchCpuGroup(parallel.tp_group.cpu_group, tp_size) if tp_size > 1 else SingleRankGroup(),
        channel=stage_channel() if pp_size > 1 else None,
        seed_dir=resolve_seed_dir(server_args.model_path, getattr(server_args, "download_dir", None)),
    )
