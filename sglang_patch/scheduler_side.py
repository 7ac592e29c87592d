"""Scheduler side of ``/pull_weights``: one handler on every TP rank of every node.

Two hooks on sglang's ``Scheduler`` (registered when ``sglang.srt.managers.scheduler`` loads):

- after ``init_request_dispatcher`` (inside ``Scheduler.__init__``): capture the seed dir (the
  model the engine was started from: ``server_args.model_path``, which resolution seals, unlike
  the model runner's path that ``/update_weights_from_disk`` repoints), read the operator's
  options, and route ``PullWeightsReqInput`` to a ``PullCoordinator``;
- after ``process_input_requests`` (every loop iteration, every rank): ``coordinator.poll()``.

How ranks stay together and why the loop never blocks: see ``sglang_patch.coordinator``. The
pull itself (``run_rank_pull``, ``sglang_patch.rank_pull``) is the core's ``weightsync.pull``:
each rank runs it for its host in its own helper process (``sglang_patch.pull_process``: the
scheduler's busy loop would starve it of the GIL), waited for by the coordinator's thread;
co-located ranks serialise on the core's per-host flock and the later ones find the work done
("noop").
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from . import compat, results
from .coordinator import PullCoordinator, SingleRankGroup
from .pull_process import make_rank_puller  # imported here: captures the CPUs before sglang binds them
from .rank_pull import RankPuller
from .server_flags import options_of

log = logging.getLogger(__name__)

STATE_ATTR = "_pull_weights_state"


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


def make_coordinator(scheduler: Any) -> PullCoordinator:
    """Build this rank's coordinator from the scheduler's config and process groups."""
    from sglang.srt.runtime_context import get_parallel

    from .io_types import PullWeightsReqOutput

    server_args = scheduler.server_args
    parallel = get_parallel()
    tp_size = int(parallel.tp_size)
    group = TorchCpuGroup(parallel.tp_group.cpu_group, tp_size) if tp_size > 1 else SingleRankGroup()
    dp_rank = compat.dp_rank_of(scheduler, parallel)
    host = results.host_label(int(getattr(server_args, "node_rank", 0) or 0))
    rank = f"dp{dp_rank if dp_rank is not None else 0}/tp{int(parallel.tp_rank)}"
    seed_dir = resolve_seed_dir(server_args.model_path, getattr(server_args, "download_dir", None))
    options = options_of(server_args)
    log.info(
        "pull_weights ready on %s %s: seed dir %s, allowed roots %s, pre-read hook %s",
        host, rank, seed_dir, list(options.allowed_roots) or "(none: every pull is refused)", options.pre_read_hook,
    )
    from . import live_side

    puller = make_rank_puller(
        RankPuller(options=options, seed_dir=seed_dir, host=host, rank=rank),
        # live apply stages its update once the local checkpoint holds the target, verified
        on_verified=lambda local, source, version: live_side.stage_for(scheduler, local, source, version),
    )

    def failure_report(request: Any, exc: BaseException, seconds: float) -> results.RankPullReport:
        return results.report_failure(host, rank, exc, seconds=seconds)

    def build_reply(request: Any, reports: Sequence[results.RankPullReport], seconds: float):
        hosts = results.merge_host_results(r for r in reports if r is not None)
        return PullWeightsReqOutput(**results.summarize(request.target_version, hosts, seconds))

    def build_conflict(request: Any, running: Any):
        return PullWeightsReqOutput(**results.conflict_fields(request.target_version, running.target_version))

    def build_internal_error(request: Any, exc: BaseException):
        fields = results.summarize(request.target_version, [], 0.0)
        fields["message"] = f"pull_weights failed inside the scheduler: {type(exc).__name__}: {exc}"
        return PullWeightsReqOutput(**fields)

    return PullCoordinator(
        group=group,
        run_rank_pull=puller,
        failure_report=failure_report,
        build_reply=build_reply,
        build_conflict=build_conflict,
        send_reply=compat.control_output_sender(scheduler),
        build_internal_error=build_internal_error,
    )


class _SchedulerPullState:
    """Per-scheduler state; the coordinator is built on first use (process groups exist by then)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.coordinator: Optional[PullCoordinator] = None

    def get_coordinator(self) -> PullCoordinator:
        if self.coordinator is None:
            self.coordinator = make_coordinator(self.scheduler)
        return self.coordinator

    def handle(self, request: Any):
        try:
            return self.get_coordinator().on_request(request)
        except Exception as exc:  # never into the scheduler (the coordinator could not be built)
            log.exception("pull_weights: handler failed")
            from .io_types import PullWeightsReqOutput

            fields = results.summarize(getattr(request, "target_version", -1), [], 0.0)
            fields["message"] = f"pull_weights could not start: {type(exc).__name__}: {exc}"
            return PullWeightsReqOutput(**fields)

    def poll(self) -> None:
        coordinator = self.coordinator
        if coordinator is not None:
            coordinator.poll()


# --- sglang hooks -------------------------------------------------------------------------------


def _after_init_request_dispatcher(result, scheduler, *args, **kwargs):
    from .io_types import PullWeightsReqInput

    state = getattr(scheduler, STATE_ATTR, None)
    if state is None:
        state = _SchedulerPullState(scheduler)
        setattr(scheduler, STATE_ATTR, state)
        # Eager so the seed dir is captured at start-up, before any weight update.
        try:
            state.get_coordinator()
        except Exception:
            log.exception("pull_weights: set-up failed; will retry on the first request")
    # The dispatcher's own class (sglang.utils.TypeBasedDispatcher) merges with ``+=``.
    scheduler._request_dispatcher += type(scheduler._request_dispatcher)([(PullWeightsReqInput, state.handle)])
    return result


def _after_process_input_requests(result, scheduler, *args, **kwargs):
    state = getattr(scheduler, STATE_ATTR, None)
    if state is not None:
        try:
            state.poll()
        except Exception:
            log.exception("pull_weights: poll failed")
    return result


_installed = False


def install(*_ignored) -> None:
    """Register the Scheduler hooks (call when ``sglang.srt.managers.scheduler`` is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="pull_weights", dist_name="weightsync")

    base = "sglang.srt.managers.scheduler.Scheduler"
    for method, hook in (
        ("init_request_dispatcher", _after_init_request_dispatcher),
        ("process_input_requests", _after_process_input_requests),
    ):
        HookRegistry.register(f"{base}.{method}", hook, HookType.AFTER, source=source)
    HookRegistry.apply_hooks()
