"""Live apply's sglang glue: the scheduler hooks that give every rank its ``LiveApplyState``.

- after ``init_request_dispatcher``: build the rank's state (its TP group, its stage's channel,
  its label, the seed dir, the operator's options, the engine's scope) and route
  ``UpdateWeightsFromPulledReqInput`` and ``WeightsDigestReqInput`` to it;
- after ``process_input_requests`` (every loop iteration): start the map once, poll the
  transaction's stage gather, run one bounded slice of staging or proof work;
- around ``update_weights_from_disk``: the reload witness (what the engine loaded, if anything
  certain); around every other sglang entry point that writes parameters (``compat.WEIGHT_WRITERS``:
  tensors, distributed, IPC, memory occupation, the weight-update session, ``/weights_checker``'s
  ``reset_tensors``, RPC, elastic EP): the live version becomes unknown and staging is voided;
- from the pull's glue, once a rank's checkpoint holds a verified version: staging.

How live apply works: ``docs/LIVE_APPLY.md`` and the ``live`` package.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from . import compat, io_types, scheduler_side
from .live import transaction as tx
from .live.mapping import scope as live_scope
from .live.state import LiveApplyState, Stager
from .scheduler_context import rank_context_of
from .server_flags import options_of

log = logging.getLogger(__name__)

LIVE_STATE_ATTR = "_weightsync_live"
TRANSFORM_ENV = "WEIGHTSYNC_TEST_POST_LOAD_TRANSFORM"


def state_of(scheduler: Any) -> Optional[LiveApplyState]:
    return getattr(scheduler, LIVE_STATE_ATTR, None) if scheduler is not None else None


def stage_for(scheduler: Any, local_dir: str, source_dir: str, target_version: int, stager: Stager) -> None:
    """Called by the pull thread once the local checkpoint holds ``target_version`` verified;
    ``stager`` runs the heavy half of staging (in the rank's pull helper process)."""
    state = state_of(scheduler)
    if state is not None:
        state.stage_after_pull(local_dir, source_dir, target_version, stager)


def make_state(scheduler: Any) -> LiveApplyState:
    ctx = rank_context_of(scheduler)
    options = options_of(scheduler.server_args)
    gather = tx.StageGather(pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, leader=ctx.leader, channel=ctx.channel,
                            send=compat.control_output_sender(scheduler))
    return LiveApplyState(
        scheduler=scheduler,
        group=ctx.group,
        gather=gather,
        host=ctx.host,
        rank=ctx.rank,
        seed_dir=ctx.seed_dir,
        allowed_roots=options.allowed_roots,
        max_changed_fraction=options.live_max_changed_fraction,
        scope=live_scope.EngineScope(scheduler.server_args, scheduler),
        pull_is_running=lambda: scheduler_side.pull_is_pending(scheduler),
    )


def _safely(fn):
    def hook(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception:
            log.exception("live apply: hook %s failed", fn.__name__)
        return None

    hook.__name__ = fn.__name__
    return hook


@_safely
def _after_init_request_dispatcher(result, scheduler, *args, **kwargs):
    if state_of(scheduler) is None:
        setattr(scheduler, LIVE_STATE_ATTR, make_state(scheduler))
    state = state_of(scheduler)

    def update(request):
        return state.handle_update(request, reply_type=io_types.UpdateWeightsFromPulledReqOutput)

    def digest(request):
        return state.handle_digest(request, reply_type=io_types.WeightsDigestReqOutput, rank_type=io_types.RankDigests)

    scheduler._request_dispatcher += type(scheduler._request_dispatcher)(
        [(io_types.UpdateWeightsFromPulledReqInput, update), (io_types.WeightsDigestReqInput, digest)]
    )


@_safely
def _after_process_input_requests(result, scheduler, *args, **kwargs):
    state = state_of(scheduler)
    if state is not None:
        state.ensure_map_started()
        state.gather.poll()
        state.loop.run_slice()


@_safely
def _before_reload(manager, recv_req=None, *args, **kwargs):
    state = state_of(getattr(manager, "scheduler", None))
    if state is not None:
        state.begin_reload(getattr(recv_req, "model_path", None))


@_safely
def _after_reload(result, manager, recv_req=None, *args, **kwargs):
    state = state_of(getattr(manager, "scheduler", None))
    if state is not None:
        state.after_reload(getattr(recv_req, "model_path", None), bool(getattr(result, "success", False)))


def _other_update(writer: compat.WeightWriter, after: bool):
    """A hook before (or after) ``writer``'s method: the call writes parameters behind live apply's
    back (for ``check_weights``, only its writing actions), so the live version is unknown and any
    staging is void. Before: a staging or proof in flight cannot finish against the old bytes;
    after: none that started during the call survives it either."""
    how = f"{writer.method} ({writer.request}"

    @_safely
    def hook(*args, **kwargs):
        owner, request = (args[1], args[2] if len(args) > 2 else None) if after else (args[0], args[1] if len(args) > 1 else None)
        request = kwargs.get("recv_req", request)
        if not compat.writes_weights(writer, request):
            return
        scheduler = owner if writer.owner == "scheduler" else getattr(owner, "scheduler", None)
        state = state_of(scheduler)
        if state is not None:
            action = getattr(request, "action", None) or getattr(request, "method", None)
            state.after_other_update(how + (f", {action})" if action else ")"))

    hook.__name__ = f"{'after' if after else 'before'}_{writer.method}"
    return hook


def _transform_after_load(result, model, *args, **kwargs):
    """Test-only: a post-load transform of one parameter (``WEIGHTSYNC_TEST_POST_LOAD_TRANSFORM``)."""
    import torch

    name = os.environ.get(TRANSFORM_ENV)
    if not name:
        return None
    params = dict(model.named_parameters())
    if name in params:
        with torch.no_grad():
            flat = params[name].data.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        log.warning("test-only post-load transform: nudged %s[0] by one ulp", name)
    return None


_installed = False


def register_hooks(*_ignored) -> None:
    """Register the live-apply hooks; ``scheduler_side.install`` applies them with its own.

    Live apply also learns from the pull's glue when a rank's checkpoint holds a verified version
    (``scheduler_side.add_verified_listener``): it stages its update then.

    sglang's HookRegistry patches a target once: hooks on a target registered after it was
    patched are ignored, so both sides' hooks must be registered before the one apply.
    """
    global _installed
    if _installed:
        return
    _installed = True
    scheduler_side.add_verified_listener(stage_for)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="pull_weights", dist_name="weightsync")
    sched = "sglang.srt.managers.scheduler.Scheduler"
    manager = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    HookRegistry.register(f"{sched}.init_request_dispatcher", _after_init_request_dispatcher, HookType.AFTER, source=source)
    HookRegistry.register(f"{sched}.process_input_requests", _after_process_input_requests, HookType.AFTER, source=source)
    HookRegistry.register(f"{manager}.update_weights_from_disk", _before_reload, HookType.BEFORE, source=source)
    HookRegistry.register(f"{manager}.update_weights_from_disk", _after_reload, HookType.AFTER, source=source)
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    for owner, cls, path in (("manager", SchedulerWeightUpdaterManager, manager), ("scheduler", Scheduler, sched)):
        for writer in compat.weight_writers_of(cls, owner):  # those this release has
            HookRegistry.register(f"{path}.{writer.method}", _other_update(writer, after=False), HookType.BEFORE, source=source)
            HookRegistry.register(f"{path}.{writer.method}", _other_update(writer, after=True), HookType.AFTER, source=source)
    if os.environ.get(TRANSFORM_ENV):
        HookRegistry.register(
            "sglang.srt.model_loader.loader.DefaultModelLoader.postprocess_weights",
            _transform_after_load, HookType.AFTER, source=source,
        )
