"""Scheduler side of ``/pull_weights``: one handler on every rank (TP and PP) of every node.

Two hooks on sglang's ``Scheduler`` (registered when ``sglang.srt.managers.scheduler`` loads):

- after ``init_request_dispatcher`` (inside ``Scheduler.__init__``): capture the seed dir (the
  model the engine was started from: ``server_args.model_path``, which resolution seals, unlike
  the model runner's path that ``/update_weights_from_disk`` repoints), read the operator's
  options, and route ``PullWeightsReqInput`` to a ``PullCoordinator``. If that fails (an sglang
  whose internals differ), one error line is logged and the engine serves on: pull requests
  are answered 503 with the reason, and the scheduler never dies of the plugin;
- after ``process_input_requests`` (every loop iteration, every rank): ``coordinator.poll()``.

Pipeline stages: every stage runs a coordinator and its pull; stage k > 0 posts its reports to
stage 0 through the torch.distributed store of the DP group's world (``StoreStageChannel``), the
one channel every stage of every node already shares and that never blocks the loop.

How ranks stay together and why the loop never blocks: see ``sglang_patch.pull.coordinator``. The
pull itself (``run_rank_pull``, ``sglang_patch.pull.rank``) is the core's ``weightsync.pull``:
each rank runs it for its host in its own helper process (``sglang_patch.pull.process``: the
scheduler's busy loop would starve it of the GIL), waited for by the coordinator's thread;
co-located ranks serialise on the core's per-host flock and the later ones find the work done
("noop").
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from weightsync.errors import EngineUnavailableError

from . import compat
from .pull import results
from .pull.coordinator import PullCoordinator, Stage
from .pull.process import make_rank_puller  # imported here: captures the CPUs before sglang binds them
from .pull.rank import RankPuller
from .scheduler_context import rank_context_of
from .server_flags import options_of

log = logging.getLogger(__name__)

STATE_ATTR = "_pull_weights_state"

# ``listener(scheduler, local_dir, source_dir, version, stager)``, called once a rank's local
# checkpoint holds a version verified: live apply (``live_hooks``) stages its update there. A
# registry rather than an import, so the pull's glue never imports live apply's.
VerifiedListener = Callable[[Any, str, str, int, Any], None]
_verified_listeners: list[VerifiedListener] = []


def add_verified_listener(listener: VerifiedListener) -> None:
    if listener not in _verified_listeners:
        _verified_listeners.append(listener)


def _tell_verified(scheduler: Any, local_dir: str, source_dir: str, version: int, stager: Any) -> None:
    for listener in _verified_listeners:
        listener(scheduler, local_dir, source_dir, version, stager)


def pull_is_pending(scheduler: Any) -> bool:
    """Whether this rank's coordinator has a pull under way (a reload meanwhile cannot name it)."""
    state = getattr(scheduler, STATE_ATTR, None)
    coordinator = getattr(state, "coordinator", None)
    return bool(coordinator is not None and coordinator.is_pending)


def make_coordinator(scheduler: Any) -> PullCoordinator:
    """Build this rank's coordinator from the scheduler's config and process groups."""
    from .io_types import PullWeightsReqOutput

    ctx = rank_context_of(scheduler)
    host, rank, seed_dir = ctx.host, ctx.rank, ctx.seed_dir
    stage = Stage(pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, leader=ctx.leader, channel=ctx.channel)
    options = options_of(scheduler.server_args)
    log.info(
        "pull_weights ready on %s %s: seed dir %s, allowed roots %s, pre-read hook %s, deadline %gs",
        host, rank, seed_dir, list(options.allowed_roots) or "(none: every pull is refused)", options.pre_read_hook,
        options.timeout_s,
    )  # fmt: skip
    puller = make_rank_puller(
        RankPuller(options=options, seed_dir=seed_dir, host=host, rank=rank),
        # live apply stages its update once the local checkpoint holds the target, verified
        on_verified=lambda local, source, version, stager: _tell_verified(scheduler, local, source, version, stager),
    )
    return PullCoordinator(
        group=ctx.group,
        run_rank_pull=puller,
        host=host,
        rank=rank,
        make_reply=lambda fields: PullWeightsReqOutput(**fields),
        send_reply=compat.control_output_sender(scheduler),
        timeout_s=options.timeout_s,
        stage=stage,
    )


def unavailable_reply(request: Any, reason: str):
    """A 503 reply: the plugin could not set itself up in this scheduler."""
    from .io_types import PullWeightsReqOutput

    exc = EngineUnavailableError(f"/pull_weights is unavailable on this engine: {reason}")
    return PullWeightsReqOutput(**results.error_reply_fields(getattr(request, "target_version", -1), exc))


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
            return unavailable_reply(request, f"the scheduler could not set the pull up: {results.describe_error(exc)}")

    def poll(self) -> None:
        coordinator = self.coordinator
        if coordinator is not None:
            coordinator.poll()


# --- sglang hooks -------------------------------------------------------------------------------


def _after_init_request_dispatcher(result, scheduler, *args, **kwargs):
    try:
        route_pulls_to_coordinator(scheduler)
    except Exception as exc:  # never take the engine down
        reason = f"the plugin could not hook this sglang's scheduler ({results.describe_error(exc)})"
        log.error("weightsync pull_weights: disabled: %s; sglang serves on without it (the route answers 503)", reason)
        try:
            answer_pulls_unavailable(scheduler, reason)
        except Exception as inner:
            log.error("weightsync pull_weights: could not even answer pulls with 503: %s", results.describe_error(inner))
    return result


def route_pulls_to_coordinator(scheduler: Any) -> None:
    """Route ``PullWeightsReqInput`` to this rank's coordinator (built now: captures the seed dir)."""
    from .io_types import PullWeightsReqInput

    state = getattr(scheduler, STATE_ATTR, None) or _SchedulerPullState(scheduler)
    # The dispatcher's own class (sglang.utils.TypeBasedDispatcher) merges with ``+=``.
    dispatcher = scheduler._request_dispatcher
    dispatcher += type(dispatcher)([(PullWeightsReqInput, state.handle)])
    scheduler._request_dispatcher = dispatcher
    setattr(scheduler, STATE_ATTR, state)
    # Eager so the seed dir is captured at start-up, before any weight update.
    try:
        state.get_coordinator()
    except Exception:
        log.exception("pull_weights: set-up failed; will retry on the first request")


def answer_pulls_unavailable(scheduler: Any, reason: str) -> None:
    """Wrap the scheduler's dispatch so that a pull request gets a 503 instead of killing the
    scheduler as an unknown request type; every other request goes where it went before."""
    from .io_types import PullWeightsReqInput

    inner = scheduler._request_dispatcher

    def dispatch(request):
        if isinstance(request, PullWeightsReqInput):
            return unavailable_reply(request, reason)
        return inner(request)

    scheduler._request_dispatcher = dispatch


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
