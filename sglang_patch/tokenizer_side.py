"""Tokenizer side of ``/pull_weights``: fan the request out to every DP group, merge the replies.

The plugin appends ``("pull_weights", PullWeightsReqOutput)`` to sglang's declarative
communicator list, so ``TokenizerManager.init_communicators`` builds
``tokenizer_manager.pull_weights_communicator`` (a ``FanOutCommunicator`` expecting one reply per
DP group) and routes the reply type to it, like every built-in control request.

Invariants: a second pull while one is in flight on this tokenizer is answered 409 at once, never
queued behind the first (the schedulers refuse it as well, for requests from another tokenizer
worker). Generation is not paused: a pull only writes the host-local checkpoint; the served
weights change only at the caller's later ``/update_weights_from_disk``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import results
from .io_types import PullWeightsReqInput, PullWeightsReqOutput, reply_fields

log = logging.getLogger(__name__)

COMMUNICATOR_NAME = "pull_weights"
_RUNNING_ATTR = "_pull_weights_running_target"


async def pull_weights(tokenizer_manager: Any, request: PullWeightsReqInput) -> PullWeightsReqOutput:
    """Send the pull to every DP group and wait for all of them; one merged reply."""
    running = getattr(tokenizer_manager, _RUNNING_ATTR, None)
    if running is not None:
        log.warning("pull_weights: v%s refused, a pull to v%s is running", request.target_version, running)
        return PullWeightsReqOutput(**results.conflict_fields(request.target_version, running))
    setattr(tokenizer_manager, _RUNNING_ATTR, request.target_version)
    start = time.monotonic()
    try:
        tokenizer_manager.auto_create_handle_loop()
        communicator = getattr(tokenizer_manager, f"{COMMUNICATOR_NAME}_communicator")
        replies = await communicator(request)
    finally:
        setattr(tokenizer_manager, _RUNNING_ATTR, None)
    merged = results.merge_replies(request.target_version, [reply_fields(r) for r in replies])
    merged["seconds"] = time.monotonic() - start
    output = PullWeightsReqOutput(**merged)
    log.info("pull_weights: v%d -> %s (%s)", request.target_version, output.http_status, output.message)
    return output


def install(module: Any = None) -> None:
    """Declare the communicator (call when ``tokenizer_control_mixin`` is imported)."""
    if module is None:
        from sglang.srt.managers import tokenizer_control_mixin as module
    specs = module._COMMUNICATOR_SPECS
    if not any(spec[0] == COMMUNICATOR_NAME for spec in specs):
        specs.append((COMMUNICATOR_NAME, PullWeightsReqOutput))


# --- live apply ---------------------------------------------------------------------------------

LIVE_COMMUNICATOR_NAME = "update_weights_from_pulled"
DIGEST_COMMUNICATOR_NAME = "weights_digest"


async def update_weights_from_pulled(tokenizer_manager: Any, request):
    """Fan the update out to every DP group while generation is held off, like sglang's
    ``update_weights_from_disk`` (the model-update writer lock, unless the engine is paused)."""
    from contextlib import nullcontext

    from . import live_results
    from .io_types import UpdateWeightsFromPulledReqOutput, live_reply_fields

    tokenizer_manager.auto_create_handle_loop()
    async with tokenizer_manager.is_pause_cond:
        paused = tokenizer_manager.is_pause
    lock = tokenizer_manager.model_update_lock.writer_lock if not paused else nullcontext()
    start = time.monotonic()
    async with lock:
        communicator = getattr(tokenizer_manager, f"{LIVE_COMMUNICATOR_NAME}_communicator")
        replies = await communicator(request)
    merged = live_results.merge_replies(request.target_version, [live_reply_fields(r) for r in replies])
    output = UpdateWeightsFromPulledReqOutput(**merged)
    if output.success:
        if output.mode == live_results.RELOAD:
            load_format = getattr(tokenizer_manager.server_args, "load_format", None)
            tokenizer_manager._update_model_path_info(request.local_checkpoint_dir, load_format)
        tokenizer_manager._update_weight_version_if_provided(str(request.target_version))
    log.info(
        "update_weights_from_pulled: v%d %s (%s) in %.3fs: %s", request.target_version, output.mode,
        output.reason or "live", time.monotonic() - start, output.message,
    )
    return output


async def weights_digest(tokenizer_manager: Any, request):
    from .io_types import WeightsDigestReqOutput

    tokenizer_manager.auto_create_handle_loop()
    communicator = getattr(tokenizer_manager, f"{DIGEST_COMMUNICATOR_NAME}_communicator")
    replies = await communicator(request)
    return WeightsDigestReqOutput(ranks=[r for reply in replies for r in reply.ranks])


def install_live(module: Any = None) -> None:
    if module is None:
        from sglang.srt.managers import tokenizer_control_mixin as module
    from .io_types import UpdateWeightsFromPulledReqOutput, WeightsDigestReqOutput

    specs = module._COMMUNICATOR_SPECS
    for name, out_type in ((LIVE_COMMUNICATOR_NAME, UpdateWeightsFromPulledReqOutput), (DIGEST_COMMUNICATOR_NAME, WeightsDigestReqOutput)):
        if not any(spec[0] == name for spec in specs):
            specs.append((name, out_type))
