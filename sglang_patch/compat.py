"""The one place that knows how the sglang releases we support differ (0.5.16 up to 0.5.23).

Everything else in the plugin is written against what the releases share: the plugin framework
(``srt/plugins``, ``HookRegistry``), ``io_struct.BaseReq`` and ``hook_custom_types``, the
declarative ``tokenizer_control_mixin._COMMUNICATOR_SPECS``, ``runtime_context.get_parallel()``
(tp size/rank and the TP group's gloo group), ``ServerArgs.add_cli_args``/``from_cli_args`` and
``utils.auth``. Where they differ, a function here looks for the newer attribute and otherwise
uses the older spelling, naming the release of each. Tested on both:
``tests/e2e/test_engine_pull_tp2.py`` runs against each venv (see the Makefile).

Differences found (each row is one function below):

| what                         | 0.5.16                                              | 0.5.23                              |
|------------------------------|-----------------------------------------------------|-------------------------------------|
| answer a control request     | ``scheduler.ipc_channels.send_to_tokenizer.send_output`` | ``scheduler.send_control_output`` |
| this scheduler's DP rank     | ``scheduler.ps.dp_rank`` (``ParallelContext`` has none) | ``get_parallel().dp_rank``       |
| flush the cache after an update | ``flush_cache_after_weight_update(req)``: None, asserts | ``(req, success, message)`` -> ``(ok, message)`` |
| record the weight version    | on the tokenizer only (no scheduler method)         | ``record_weight_version_after_update(v)`` |
| sglang's refusal of online updates | none                                        | ``_unsupported_derived_weight_cache_error(model)`` |
| calls that move the weights  | ``release/resume_memory_occupation``                | also ``begin/end_weight_update``    |
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional


def control_output_sender(scheduler: Any) -> Callable[[Any, Any], None]:
    """``send(output, request)``: answer a control request later than its dispatch.

    0.5.23 has ``Scheduler.send_control_output`` (it also routes to an embedded Rust server);
    0.5.16 answers through the tokenizer channel directly, as its own dispatch loop does.
    """
    send = getattr(scheduler, "send_control_output", None)
    if send is not None:
        return send
    channel = scheduler.ipc_channels.send_to_tokenizer
    return lambda output, request: channel.send_output(output, request)


def dp_rank_of(scheduler: Any, parallel: Any) -> Optional[int]:
    """This scheduler's data-parallel rank, or None when the engine runs without DP."""
    try:  # 0.5.23: ParallelContext.dp_rank (its dynamic lookup raises when unpublished)
        rank = parallel.dp_rank
    except Exception:  # 0.5.16: no such attribute; the scheduler keeps its own parallel state
        rank = getattr(getattr(scheduler, "ps", None), "dp_rank", None)
    return None if rank is None else int(rank)


def flush_cache_after_weight_update(manager: Any, request: Any, message: str) -> tuple[bool, str]:
    """Flush the cache the old weights produced, as sglang does after its own updates; never raises.

    0.5.23: ``flush_cache_after_weight_update(recv_req, success, message) -> (ok, message)`` (a
    flush refused because requests still run fails the call); 0.5.16:
    ``flush_cache_after_weight_update(recv_req)`` returns None and asserts that the flush happened.
    """
    flush = manager.flush_cache_after_weight_update
    try:
        if len(inspect.signature(flush).parameters) >= 3:
            ok, out = flush(request, True, message)
            return bool(ok), str(out)
        flush(request)
        return True, message
    except Exception as exc:  # 0.5.16's assertion, or anything the flush raised
        return False, f"the cache could not be flushed after the update: {type(exc).__name__}: {exc}"


def record_weight_version(manager: Any, version: int) -> None:
    """Tell the scheduler the weight version it now serves (0.5.23; 0.5.16 keeps it on the tokenizer
    only, where ``tokenizer_side`` sets it once the call succeeded)."""
    record = getattr(manager, "record_weight_version_after_update", None)
    if record is not None:
        record(str(version))


def derived_weight_cache_error(model: Any) -> Optional[str]:
    """sglang's own reason to refuse an online weight update of ``model``, or None.

    0.5.23: ``weight_updater._unsupported_derived_weight_cache_error(model)`` (caches derived
    from the weights that in-place writes do not refresh: the Hopper FP8 BF16 cache, the DSA
    indexer, megakernels, packed FP8, compensated mHC splits, ``_derived_weight_cache_error``
    on any module). 0.5.16 has no such check: its loaders keep none of those caches.
    """
    try:
        from sglang.srt.model_executor.model_runner_components import weight_updater
    except ImportError:
        return None
    check = getattr(weight_updater, "_unsupported_derived_weight_cache_error", None)
    if check is None:  # 0.5.16
        return None
    return check(model)


# The scheduler weight-updater manager's calls that move or replace weights behind live apply's
# back (after each, the live version is unknown). 0.5.16 has the memory-occupation pair only;
# 0.5.23 adds the begin/end_weight_update session.
WEIGHT_MOVING_CALLS = ("release_memory_occupation", "resume_memory_occupation", "begin_weight_update", "end_weight_update")


def weight_moving_calls(manager_cls: Any) -> list[str]:
    """The ``WEIGHT_MOVING_CALLS`` this release's manager class has (a hook on a missing one fails)."""
    return [name for name in WEIGHT_MOVING_CALLS if callable(getattr(manager_cls, name, None))]
