"""The request and reply of ``POST /pull_weights`` as sglang IPC messages.

Both are keyword-only, module-level, direct subclasses of sglang's ``BaseReq`` (a tagged,
array-like msgspec Struct): sglang pickles them between processes by default
(``SGLANG_USE_PICKLE_IPC``), and with msgpack IPC decodes them through a union built from the
known message types, which ``register_types`` extends (it must run in every process that decodes
them: tokenizer, DP controller, schedulers). The reply nests ``HostPullResult``, a plain typed
Struct, so both codecs carry it without a pickle wrapper.
"""

from typing import List, Optional

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from .pull.results import HostPullResult


class PullWeightsReqInput(BaseReq, kw_only=True):
    """Bring every host's ``local_checkpoint_dir`` to ``target_version`` from ``source_dir``."""

    local_checkpoint_dir: str
    source_dir: str
    target_version: int


class PullWeightsReqOutput(BaseReq, kw_only=True):
    """One DP group's (scheduler side) or the whole engine's (tokenizer side) pull outcome."""

    success: bool
    message: str
    error_type: Optional[str] = None
    http_status: int = 200
    target_version: int = -1
    applied_version: Optional[int] = None
    hosts: List[HostPullResult] = msgspec.field(default_factory=list)
    seconds: float = 0.0


def register_types(*_ignored) -> None:
    """Let sglang's msgpack IPC decode the pull messages in this process (idempotent)."""
    hook_custom_types(PullWeightsReqInput, PullWeightsReqOutput)


def reply_fields(output: PullWeightsReqOutput) -> dict:
    """The reply's fields as a dict (what ``results.merge_replies`` and ``results.http_body`` take)."""
    return {
        "success": output.success,
        "message": output.message,
        "error_type": output.error_type,
        "http_status": output.http_status,
        "target_version": output.target_version,
        "applied_version": output.applied_version,
        "hosts": list(output.hosts),
        "seconds": output.seconds,
    }


# --- live apply (``POST /update_weights_from_pulled``) and its debug call (``POST /weights_digest``)

from typing import Any, Dict  # noqa: E402

from .live.results import LiveDecision, LiveHostResult, LiveRankReport, RankCheck  # noqa: E402


class UpdateWeightsFromPulledReqInput(BaseReq, kw_only=True):
    """Serve ``target_version`` from ``local_checkpoint_dir``: patched live, else reloaded."""

    local_checkpoint_dir: str
    target_version: int
    flush_cache: bool = True
    torch_empty_cache: bool = False  # read by sglang's own post-update flush
    # the engine-wide transaction (``live.transaction``): which phase, of which transaction, and
    # why (a reload's or a rollback's reason, decided on the tokenizer from every rank's items)
    phase: str = "vote"
    txn: str = ""
    reason: Optional[str] = None


class UpdateWeightsFromPulledReqOutput(BaseReq, kw_only=True):
    success: bool
    message: str
    mode: str = "reload"
    reason: Optional[str] = None
    error_type: Optional[str] = None
    http_status: int = 200
    target_version: int = -1
    weight_version: Optional[int] = None
    elements_scattered: int = 0
    pause_s: float = 0.0
    rolled_back: bool = False
    hosts: List[LiveHostResult] = msgspec.field(default_factory=list)
    # what the mode was chosen by (live.results.choose_mode): the engine's estimated pause each way
    live_estimate_s: Optional[float] = None
    reload_estimate_s: Optional[float] = None
    # how the mode was chosen (live.results.decide_mode): by a vote, the estimates, or a probe of
    # the losing mode, and how long ago (updates, pause seconds) each mode was last measured
    mode_choice: Optional[Dict[str, Any]] = None
    # the check after the update (live.check): elements compared equal, and those that were not,
    # summed over ranks (per rank: each host's ``checks``); a mismatch after a live apply made
    # every rank reload the local checkpoint (``reloaded_after_check``)
    verified_elements: int = 0
    mismatches: int = 0
    not_checkable_params: int = 0
    reloaded_after_check: bool = False
    failed_checks: List[RankCheck] = msgspec.field(default_factory=list)  # the ranks' checks that found them
    # one phase's items of every rank of the DP group (every stage), for the tokenizer's decision
    votes: List[LiveDecision] = msgspec.field(default_factory=list)
    reports: List[LiveRankReport] = msgspec.field(default_factory=list)


class RankDigests(msgspec.Struct, kw_only=True):
    """Every parameter's digest on one rank, with the rank's live version and map summary."""

    host: str
    rank: str
    digests: Dict[str, str]
    data_ptrs: Dict[str, int] = {}  # a live apply must leave every storage where it was (CUDA graphs)
    live_version: Optional[int] = None
    live_reason: str = ""
    coordinate_map: Dict[str, Any] = {}


class WeightsDigestReqInput(BaseReq, kw_only=True):
    """Debug (tests): digest every parameter on every rank; ``names`` limits it to some."""

    names: Optional[List[str]] = None


class WeightsDigestReqOutput(BaseReq, kw_only=True):
    ranks: List[RankDigests] = msgspec.field(default_factory=list)
    success: bool = True
    message: str = ""


def register_live_types(*_ignored) -> None:
    hook_custom_types(UpdateWeightsFromPulledReqInput, UpdateWeightsFromPulledReqOutput)
    hook_custom_types(WeightsDigestReqInput, WeightsDigestReqOutput)


def live_reply_fields(output: UpdateWeightsFromPulledReqOutput) -> dict:
    skip = ("rid", "http_worker_ipc", "votes", "reports")
    return {f: getattr(output, f) for f in UpdateWeightsFromPulledReqOutput.__struct_fields__ if f not in skip}


def live_http_body(output: UpdateWeightsFromPulledReqOutput) -> dict:
    body = {k: v for k, v in live_reply_fields(output).items() if k not in ("http_status",)}
    body["hosts"] = msgspec.to_builtins(output.hosts)
    body["failed_checks"] = msgspec.to_builtins(output.failed_checks)
    return body
