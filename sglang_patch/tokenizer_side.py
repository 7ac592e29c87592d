"""Tokenizer side of ``/pull_weights``: fan the request out to every DP group, merge the replies.

The plugin appends ``("pull_weights", PullWeightsReqOutput)`` to sglang's declarative
communicator list, so ``TokenizerManager.init_communicators`` builds
``tokenizer_manager.pull_weights_communicator`` (a ``FanOutCommunicator`` expecting one reply per
DP group) and routes the reply type to it, like every built-in control request.

Invariants:
- One pull at a time per tokenizer, run as its own task: an HTTP request that goes away (a client
  timeout) does not cancel it, so its schedulers' reply is always consumed by it and can never be
  taken for the reply of a later pull.
- A request for the pull that is running (same dirs, same target: a trainer's retry after its own
  timeout) waits for it and gets its result. A pull to anything else is answered 409
  ``PullInProgress`` at once, never queued (the schedulers decide the same way for requests from
  another tokenizer worker).
- Shutdown (SIGTERM) answers every waiting request 503 at once and refuses new ones, so the HTTP
  server can close its connections and exit instead of waiting for a reply that cannot come.
- Generation is not paused: a pull only writes the host-local checkpoint; the served weights
  change only at the caller's later ``/update_weights_from_disk``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from weightsync.errors import EngineUnavailableError, PullInProgressError

from .pull import results
from .pull.coordinator import is_same_pull
from .io_types import PullWeightsReqInput, PullWeightsReqOutput, reply_fields

log = logging.getLogger(__name__)

COMMUNICATOR_NAME = "pull_weights"
_RUNNING_ATTR = "_pull_weights_running"
SHUTDOWN_POLL_S = 0.2


@dataclass
class _RunningPull:
    request: PullWeightsReqInput
    task: asyncio.Task


async def pull_weights_fields(tokenizer_manager: Any, body: Any) -> dict:
    """The reply's fields for a parsed request body (``sglang_patch.pull.request.PullRequestBody``)."""
    request = PullWeightsReqInput(
        local_checkpoint_dir=body.local_checkpoint_dir, source_dir=body.source_dir, target_version=body.target_version
    )
    return reply_fields(await pull_weights(tokenizer_manager, request))


async def pull_weights(tokenizer_manager: Any, request: PullWeightsReqInput) -> PullWeightsReqOutput:
    """Run the pull on every DP group (or join the same one running); one merged reply."""
    if is_shutting_down(tokenizer_manager):
        return PullWeightsReqOutput(**results.shutting_down_fields(request.target_version))
    running = getattr(tokenizer_manager, _RUNNING_ATTR, None)
    if running is not None and not running.task.done():
        if not is_same_pull(request, running.request):
            log.warning("pull_weights: v%s refused, a pull to v%s is running", request.target_version, running.request.target_version)
            refusal = PullInProgressError(request.target_version, running.request.target_version)
            return PullWeightsReqOutput(**results.error_reply_fields(request.target_version, refusal))
        log.info("pull_weights: a request for the running pull to v%s waits for its result", request.target_version)
    else:
        if not request.rid:  # every pipeline stage keys its report by it
            request.rid = f"pull-{uuid.uuid4().hex}"
        running = _RunningPull(request, asyncio.get_running_loop().create_task(_run_pull(tokenizer_manager, request)))
        setattr(tokenizer_manager, _RUNNING_ATTR, running)
    return await _result_unless_shutdown(tokenizer_manager, running)


async def _run_pull(tokenizer_manager: Any, request: PullWeightsReqInput) -> PullWeightsReqOutput:
    start = time.monotonic()
    tokenizer_manager.auto_create_handle_loop()
    communicator = getattr(tokenizer_manager, f"{COMMUNICATOR_NAME}_communicator", None)
    if communicator is None:
        raise EngineUnavailableError(
            "/pull_weights is unavailable on this engine: the tokenizer has no pull_weights "
            "communicator (the plugin's tokenizer part did not install into this sglang)"
        )
    replies = await communicator(request)
    merged = results.merge_replies(request.target_version, [reply_fields(r) for r in replies])
    merged["seconds"] = time.monotonic() - start
    output = PullWeightsReqOutput(**merged)
    log.info("pull_weights: v%d -> %s (%s)", request.target_version, output.http_status, output.message)
    return output


async def _result_unless_shutdown(tokenizer_manager: Any, running: _RunningPull) -> PullWeightsReqOutput:
    """The running pull's reply; a 503 as soon as the server starts shutting down."""
    while True:
        # asyncio.wait never cancels the task, even if this request is cancelled.
        done, _ = await asyncio.wait({running.task}, timeout=SHUTDOWN_POLL_S)
        if done:
            return running.task.result()
        if is_shutting_down(tokenizer_manager):
            log.warning("pull_weights: v%s answered 503, the server is shutting down", running.request.target_version)
            return PullWeightsReqOutput(**results.shutting_down_fields(running.request.target_version))


def is_shutting_down(tokenizer_manager: Any) -> bool:
    """sglang's own flag, set by its SIGTERM handler before it drains and stops."""
    try:
        return bool(getattr(tokenizer_manager, "gracefully_exit", False))
    except Exception:
        return False


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


LIVE_TXN_LOCK_ATTR = "_weightsync_live_txn_lock"
TXN_GATE_ENV = "WEIGHTSYNC_TEST_TXN_GATE"


def live_transaction_lock(tokenizer_manager: Any) -> asyncio.Lock:
    """This tokenizer's live-apply transaction lock, held from the vote to the commit or rollback
    whether or not generation is paused: two transactions never interleave their phases (each
    rank keeps one open transaction; a second vote replaced the first's and its apply failed), and
    ``continue_generation`` waits for it (``_around_continue_generation``)."""
    lock = getattr(tokenizer_manager, LIVE_TXN_LOCK_ATTR, None)
    if lock is None:
        lock = asyncio.Lock()
        setattr(tokenizer_manager, LIVE_TXN_LOCK_ATTR, lock)
    return lock


async def _wait_at_txn_gate(phase: str, timeout_s: float = 120.0) -> None:
    """Test-only (``WEIGHTSYNC_TEST_TXN_GATE``, a dir): while it holds ``hold-<phase>``, the
    transaction waits before it sends ``phase`` (after it created ``at-<phase>`` there), so a test
    can land another writer of the weights, or a ``continue_generation``, between two phases."""
    directory = os.environ.get(TXN_GATE_ENV)
    if not directory or not os.path.exists(os.path.join(directory, f"hold-{phase}")):
        return
    open(os.path.join(directory, f"at-{phase}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while os.path.exists(os.path.join(directory, f"hold-{phase}")) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def update_weights_from_pulled(tokenizer_manager: Any, request):
    """Run the update as one transaction over every DP group (``live.transaction``) while
    generation is held off: our own transaction lock always (``live_transaction_lock``), and, unless
    the engine is paused, sglang's model-update writer lock, as its ``update_weights_from_disk``
    takes it (paused, requests paused in place hold reader locks: the writer lock would wait for
    ever). Both are held from the vote to the commit or rollback. A writer of the weights that
    neither lock keeps out (a reload while paused, ``reset_tensors``) is caught by the ranks'
    generation check at every phase (``live.apply``)."""
    from contextlib import nullcontext

    import msgspec

    from .live import results as live_results
    from .live import transaction as tx
    from .io_types import UpdateWeightsFromPulledReqOutput

    tokenizer_manager.auto_create_handle_loop()
    start = time.monotonic()
    txn = tx.new_transaction_id()
    communicator = getattr(tokenizer_manager, f"{LIVE_COMMUNICATOR_NAME}_communicator")

    async def send(phase: str, reason):
        await _wait_at_txn_gate(phase)
        replies = await communicator(msgspec.structs.replace(request, phase=phase, txn=txn, reason=reason))
        return tx.PhaseReplies(votes=[v for r in replies for v in r.votes], reports=[x for r in replies for x in r.reports])

    async def transaction() -> dict:
        lock_ = live_transaction_lock(tokenizer_manager)
        gate = os.environ.get(TXN_GATE_ENV)
        if gate and lock_.locked():  # test-only: tell the test that this transaction waits for another
            open(os.path.join(gate, "txn-waiting"), "w").close()
        async with lock_:
            async with tokenizer_manager.is_pause_cond:
                paused = tokenizer_manager.is_pause
            lock = tokenizer_manager.model_update_lock.writer_lock if not paused else nullcontext()
            async with lock:
                return await tx.run_transaction(send, request.target_version)

    # its own task, shielded: a client that goes away between the writes and the commit or
    # rollback must not leave the ranks holding uncommitted writes under the old version
    merged = await asyncio.shield(asyncio.get_running_loop().create_task(transaction()))
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
    if not request.rid:  # every pipeline stage keys its ranks' digests by it
        request.rid = f"digest-{uuid.uuid4().hex}"
    replies = await communicator(request)
    return WeightsDigestReqOutput(ranks=[r for reply in replies for r in reply.ranks])


async def _around_continue_generation(original, tokenizer_manager, *args, **kwargs):
    """sglang's ``continue_generation``, once no live-apply transaction is open: paused, the
    transaction holds no writer lock, and serving resumed between its apply and its commit would
    send tokens of uncommitted, unchecked writes."""
    lock = live_transaction_lock(tokenizer_manager)
    gate = os.environ.get(TXN_GATE_ENV)
    if gate and lock.locked():  # test-only: tell the test that it waits
        open(os.path.join(gate, "continue-waiting"), "w").close()
    async with lock:
        return await original(tokenizer_manager, *args, **kwargs)


_continue_hooked = False


def install_continue_wait(*_ignored) -> None:
    """Make ``continue_generation`` wait for a live-apply transaction (call when
    ``sglang.srt.managers.tokenizer_manager`` loads)."""
    global _continue_hooked
    if _continue_hooked:
        return
    _continue_hooked = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="pull_weights", dist_name="weightsync")
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.continue_generation",
                          _around_continue_generation, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()


def install_live(module: Any = None) -> None:
    if module is None:
        from sglang.srt.managers import tokenizer_control_mixin as module
    from .io_types import UpdateWeightsFromPulledReqOutput, WeightsDigestReqOutput

    specs = module._COMMUNICATOR_SPECS
    for name, out_type in ((LIVE_COMMUNICATOR_NAME, UpdateWeightsFromPulledReqOutput), (DIGEST_COMMUNICATOR_NAME, WeightsDigestReqOutput)):
        if not any(spec[0] == name for spec in specs):
            specs.append((name, out_type))
