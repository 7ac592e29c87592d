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
| calls that write the weights | ``WEIGHT_WRITERS`` (reloads, tensors, distributed, IPC, memory occupation, ``reset_tensors``, RPC, elastic EP) | also ``begin/end_weight_update`` |
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Optional


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


# --- every sglang entry point that writes the model's parameters --------------------------------
#
# Live apply stages an update against the bytes the weights hold (the undo log, the sample compared
# at staging) and votes on the weights' generation; anything else that writes a parameter must bump
# that generation and make the live version unknown, or a staged patch lands on other bytes and the
# reply says "live" for a version the engine does not hold (issue 28, point 1: sglang's own
# ``/weights_checker {"action": "reset_tensors"}`` was missing here).
#
# Read from sglang's source, 0.5.16 and 0.5.23: every request type ``Scheduler.init_request_dispatcher``
# routes is in exactly one of the two tables below, and every public method of
# ``SchedulerWeightUpdaterManager`` and every action of ``WeightChecker.handle`` too
# (``tests/unit/test_sglang_weight_writers.py`` parses the installed release's source, on both
# releases, and fails on a name in neither: a release that adds a writer cannot slip past).


class WeightWriter(NamedTuple):
    """One way into sglang that writes parameters: the request type the scheduler dispatches, the
    method that handles it (``owner``: ``manager`` = ``SchedulerWeightUpdaterManager``, ``scheduler``
    = ``Scheduler``), the releases that have it, and the actions that write (None: every call)."""

    request: str
    owner: str
    method: str
    releases: str
    writing_actions: Optional[tuple] = None


# ``update_weights_from_disk`` is hooked on its own (the reload witness: a reload of a dir that names
# a verified version keeps a known live version); every other writer makes the live version unknown.
RELOAD_REQUEST = "UpdateWeightFromDiskReqInput"
WEIGHT_WRITERS: tuple[WeightWriter, ...] = (
    WeightWriter("UpdateWeightFromDiskReqInput", "manager", "update_weights_from_disk", "0.5.16, 0.5.23"),
    WeightWriter("UpdateWeightsFromTensorReqInput", "manager", "update_weights_from_tensor", "0.5.16, 0.5.23"),
    WeightWriter("UpdateWeightsFromDistributedReqInput", "manager", "update_weights_from_distributed", "0.5.16, 0.5.23"),
    WeightWriter("UpdateWeightsFromIPCReqInput", "manager", "update_weights_from_ipc", "0.5.16, 0.5.23"),
    # frees the weights' memory (tags "weights"), and the resume brings back whatever the memory
    # saver restores: the live version is unknown after either
    WeightWriter("ReleaseMemoryOccupationReqInput", "manager", "release_memory_occupation", "0.5.16, 0.5.23"),
    WeightWriter("ResumeMemoryOccupationReqInput", "manager", "resume_memory_occupation", "0.5.16, 0.5.23"),
    # a session that unpacks in-place-packed weights and re-runs post_load_weights at its end
    WeightWriter("BeginWeightUpdateReqInput", "manager", "begin_weight_update", "0.5.23"),
    WeightWriter("EndWeightUpdateReqInput", "manager", "end_weight_update", "0.5.23"),
    # the RL self-check (snapshot, reset_tensors, update, compare): reset_tensors copies random
    # values into every parameter; snapshot, compare and checksum only read
    WeightWriter("CheckWeightsReqInput", "manager", "check_weights", "0.5.16, 0.5.23", ("reset_tensors",)),
    # calls any Scheduler method by name: which one writes cannot be told, so every call counts
    WeightWriter("RpcReqInput", "scheduler", "handle_rpc_request", "0.5.16, 0.5.23"),
    # elastic EP scale-up moves and loads expert weights onto the new ranks
    WeightWriter("ScaleElasticEPReqInput", "scheduler", "handle_scale_elastic_ep", "0.5.16, 0.5.23"),
)

# The request types the scheduler dispatches that write no parameter of the served model, and why.
NOT_WEIGHT_WRITING_REQUESTS: dict[str, str] = {
    "TokenizedGenerateReqInput": "generation reads the weights",
    "TokenizedEmbeddingReqInput": "generation reads the weights",
    "BatchTokenizedGenerateReqInput": "generation reads the weights",
    "BatchTokenizedEmbeddingReqInput": "generation reads the weights",
    "FlushCacheReqInput": "the KV cache, not the weights",
    "ClearHiCacheReqInput": "the KV cache, not the weights",
    "AttachHiCacheStorageReqInput": "the KV cache, not the weights",
    "DetachHiCacheStorageReqInput": "the KV cache, not the weights",
    "AbortReq": "requests only",
    "OpenSessionReqInput": "requests only",
    "CloseSessionReqInput": "requests only",
    "InitWeightsUpdateGroupReqInput": "builds a process group; the writes come with UpdateWeightsFromDistributed",
    "DestroyWeightsUpdateGroupReqInput": "destroys a process group",
    "InitWeightsSendGroupForRemoteInstanceReqInput": "builds a group to send the weights: reads them",
    "SendWeightsToRemoteInstanceReqInput": "sends the weights: reads them",
    "UpdateWeightVersionReqInput": "the version label only (the live version stays ours)",
    "GetWeightsByNameReqInput": "reads a parameter",
    "SlowDownReqInput": "a test pacing knob",
    "PdRoleSwitchReqInput": "switches prefill/decode queues; the weights stay",
    "ProfileReq": "the profiler",
    "FreezeGCReq": "the garbage collector",
    "ShutdownReq": "stops the scheduler",
    "GetInternalStateReq": "reads server state",
    "SetInternalStateReq": "server args and limits, not the weights",
    "GetHiCacheL3LayoutReq": "the KV cache layout",
    "ExpertDistributionReq": "records expert statistics; EPLB itself makes live apply reload-only (mapping/scope)",
    "LoadLoRAAdapterReqInput": "a LoRA adapter's own tensors, beside the base parameters",
    "LoadLoRAAdapterFromTensorsReqInput": "a LoRA adapter's own tensors, beside the base parameters",
    "UnloadLoRAAdapterReqInput": "a LoRA adapter's own tensors, beside the base parameters",
    "PauseGenerationReqInput": "scheduling only",
    "ContinueGenerationReqInput": "scheduling only (the tokenizer waits for a live-apply transaction)",
    "ConfigureLoggingReq": "logging",
    "DumperControlReqInput": "a debugging dumper of activations",
    "AddExternalCorpusReqInput": "an n-gram corpus for speculative decoding, not the weights",
    "RemoveExternalCorpusReqInput": "an n-gram corpus for speculative decoding, not the weights",
    "ListExternalCorporaReqInput": "an n-gram corpus for speculative decoding, not the weights",
}

# The ``SchedulerWeightUpdaterManager`` methods that write nothing (the writers are WEIGHT_WRITERS').
NOT_WEIGHT_WRITING_MANAGER_METHODS: dict[str, str] = {
    "flush_cache_after_weight_update": "the KV cache",
    "record_weight_version_after_update": "the version label",
    "init_weights_update_group": "a process group",
    "destroy_weights_update_group": "a process group",
    "get_weights_by_name": "reads",
    "save_remote_model": "reads the weights to save them",
    "save_sharded_model": "reads the weights to save them",
}

# ``WeightChecker.handle``'s actions that only read (the others are CheckWeightsReqInput's writing_actions).
READ_ONLY_WEIGHT_CHECKER_ACTIONS = ("snapshot", "compare", "checksum")


def weight_writers_of(owner_cls: Any, owner: str) -> list[WeightWriter]:
    """The writers (other than the witnessed reload) this release's ``owner`` class has."""
    return [w for w in WEIGHT_WRITERS if w.owner == owner and w.request != RELOAD_REQUEST
            and callable(getattr(owner_cls, w.method, None))]


def writes_weights(writer: WeightWriter, request: Any) -> bool:
    """Whether this call of ``writer`` writes parameters (``check_weights``: only its writing actions)."""
    if writer.writing_actions is None:
        return True
    return getattr(request, "action", None) in writer.writing_actions
