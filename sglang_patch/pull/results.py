"""Outcomes of a pull: one per rank, merged per host, summarised into one reply. No sglang here.

Every rank (each TP rank of each pipeline stage, on every node) runs the core ``pull()`` for its
host and produces a ``RankPullReport``. Reports are all-gathered over the stage's TP group, the
other stages' reports join stage 0's, they are merged per host (``merge_host_results``:
co-located ranks share one local checkpoint, so they are one host), and the DP groups' host
lists are merged again on the tokenizer side with the same function.

Every reply's fields are built here, once: ``reply_fields`` (the shape), ``summarize`` (a pull's
outcome), ``error_reply_fields`` (a request answered with an error before or instead of a pull:
PullInProgress, shutting down, plugin unavailable, internal error).

Invariants:
- A reply is a success only if every host succeeded and holds exactly the target version; an
  empty host list (nobody answered) is a failure.
- A failed reply names one ``error_type`` chosen by a fixed precedence (errors a retry cannot fix
  first), so the HTTP status does not depend on which host answered first.
- No traceback ever enters a report, and no message is longer than ``MAX_MESSAGE_CHARS``: a
  request can carry a 100 KB path, and the reply must not echo it back whole.
"""

from __future__ import annotations

import errno
import socket
from typing import Iterable, Optional, Sequence

import msgspec

from weightsync.errors import EngineUnavailableError, InvalidRequestError, PullInProgressError, WeightSyncError

INTERNAL_ERROR = "internal_error"
PULL_IN_PROGRESS = PullInProgressError.error_type
MAX_MESSAGE_CHARS = 2000
# OS errors that name a problem with the request's own path, not with the disk or the source.
_REQUEST_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP, errno.EISDIR})

# Failed hosts may disagree on why; the reply names the error a retry cannot fix first.
_ERROR_PRECEDENCE = (
    "bad_request",
    "forbidden",
    "corrupt_artifact",
    "unsupported_format",
    "local_state_corrupt",
    INTERNAL_ERROR,
    "pull_timeout",
    "unavailable",
    PULL_IN_PROGRESS,
    "conflict",
    "source_not_ready",
)


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 40)
    return f"{text[:keep]}... ({len(text) - keep} more characters cut)"


def host_label(node_rank: int, hostname: Optional[str] = None) -> str:
    """How a host is named in replies: hostname plus sglang node rank (two nodes may share a name)."""
    return f"{hostname or socket.gethostname()}/node{node_rank}"


class RankPullReport(msgspec.Struct, kw_only=True):
    """What one scheduler rank saw of one pull (picklable; all-gathered over the TP group)."""

    host: str
    rank: str  # "dp{d}/tp{t}" ("dp{d}/pp{p}/tp{t}" with pipeline stages), for humans
    success: bool
    error_type: Optional[str] = None
    http_status: int = 200
    message: str = ""
    applied_version: Optional[int] = None
    action: str = ""
    reason: str = ""
    seconds: float = 0.0
    lock_wait_s: float = 0.0
    hook_ran: bool = False
    nbytes_read: int = 0
    source_nbytes: int = 0  # read from the source dir (the weightsync_pull_source_read_bytes metric)
    reseeded: bool = False


class HostPullResult(msgspec.Struct, kw_only=True):
    """One host's outcome in the reply: ranks on it, whether it holds the verified target."""

    host: str
    ranks: list[str]
    success: bool
    error_type: Optional[str] = None
    http_status: int = 200
    message: str = ""
    applied_version: Optional[int] = None
    action: str = ""  # what the rank that did the work did: seed, chain, seed+chain, noop
    reason: str = ""
    seconds: float = 0.0  # slowest rank on the host, including its wait for the host lock
    hook_ran: bool = False
    nbytes_read: int = 0
    source_nbytes: int = 0  # read from the source dir (the weightsync_pull_source_read_bytes metric)
    reseeded: bool = False


def report_success(host: str, rank: str, result) -> RankPullReport:
    """A rank's report from a core ``PullResult``."""
    return RankPullReport(
        host=host,
        rank=rank,
        success=True,
        applied_version=result.applied_version,
        action=result.action,
        reason=result.reason,
        seconds=float(result.seconds),
        lock_wait_s=float(getattr(result, "lock_wait_s", 0.0)),
        hook_ran=bool(result.hook_ran),
        nbytes_read=int(result.nbytes_read),
        source_nbytes=int(getattr(result, "source_nbytes", 0)),
        reseeded=bool(getattr(result, "reseeded", False)),
    )


def report_failure(
    host: str, rank: str, exc: BaseException, *, seconds: float = 0.0, applied_version: Optional[int] = None
) -> RankPullReport:
    """A rank's report from an exception: typed core errors keep their type and status."""
    error_type, http_status = classify_error(exc)
    return RankPullReport(
        host=host,
        rank=rank,
        success=False,
        error_type=error_type,
        http_status=http_status,
        message=describe_error(exc),
        applied_version=applied_version,
        seconds=seconds,
    )


def classify_error(exc: BaseException) -> tuple[str, int]:
    """(error_type, http_status) of an exception: the core's own; a request path the OS refuses
    (name too long, a file where a dir must be) is a bad request; anything else is internal (500)."""
    if isinstance(exc, WeightSyncError):
        return exc.error_type, int(exc.http_status)
    if isinstance(exc, OSError) and exc.errno in _REQUEST_PATH_ERRNOS:
        return InvalidRequestError.error_type, InvalidRequestError.http_status
    return INTERNAL_ERROR, 500


def describe_error(exc: BaseException) -> str:
    """The error's own text (no traceback), cut short; an OS error's file name is cut too."""
    if isinstance(exc, WeightSyncError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}: {shorten(str(exc.filename), 300)!r}"
        if exc.errno in _REQUEST_PATH_ERRNOS:
            text = f"the request's path cannot be used on this host ({text}); use a shorter, plain directory path"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return shorten(text)


def _action_rank(action: str) -> int:
    return 0 if action in ("", "noop") else 1


def merge_host_results(items: Iterable[RankPullReport | HostPullResult]) -> list[HostPullResult]:
    """Group rank reports (or already-merged host results) by host, sorted by host name."""
    by_host: dict[str, list] = {}
    for item in items:
        by_host.setdefault(item.host, []).append(item)
    return [_merge_one_host(host, by_host[host]) for host in sorted(by_host)]


def _merge_one_host(host: str, group: list) -> HostPullResult:
    """One host's result: failed if any rank failed (the worst error), or if ranks disagree."""
    ranks = sorted({rank for item in group for rank in (item.ranks if isinstance(item, HostPullResult) else [item.rank])})
    # The rank that did the work (not a no-op after waiting for the lock) describes the host.
    worker = max(group, key=lambda item: (_action_rank(item.action), item.seconds))
    versions = {item.applied_version for item in group}
    agreed_version = next(iter(versions)) if len(versions) == 1 else None
    failed = [item for item in group if not item.success]
    if failed:
        worst = min(failed, key=lambda item: _precedence(item.error_type))
        error_type, http_status = worst.error_type, worst.http_status
        # Name the rank (a pipeline stage may be the only one that failed on this host).
        message = worst.message if isinstance(worst, HostPullResult) else f"{worst.rank}: {worst.message}"
        if len(failed) > 1:
            message += f" (and {len(failed) - 1} more failed report(s) on this host)"
    elif len(versions) != 1:
        error_type, http_status = INTERNAL_ERROR, 500
        message = f"ranks disagree on the applied version: {sorted(versions, key=str)}"
    else:
        error_type, http_status, message = None, 200, worker.reason
    return HostPullResult(
        host=host,
        ranks=ranks,
        success=error_type is None,
        error_type=error_type,
        http_status=http_status,
        message=message,
        applied_version=agreed_version,
        action=worker.action,
        reason=worker.reason,
        seconds=max(item.seconds for item in group),
        hook_ran=any(item.hook_ran for item in group),
        nbytes_read=sum(item.nbytes_read for item in group),
        source_nbytes=sum(item.source_nbytes for item in group),
        reseeded=any(item.reseeded for item in group),
    )


def _precedence(error_type: Optional[str]) -> int:
    try:
        return _ERROR_PRECEDENCE.index(error_type or INTERNAL_ERROR)
    except ValueError:
        return _ERROR_PRECEDENCE.index(INTERNAL_ERROR)


def reply_fields(
    target_version: int,
    *,
    success: bool,
    message: str,
    error_type: Optional[str] = None,
    http_status: int = 200,
    applied_version: Optional[int] = None,
    hosts: Sequence[HostPullResult] = (),
    seconds: float = 0.0,
) -> dict:
    """The fields of a reply (``PullWeightsReqOutput``): the one place their shape is written."""
    return dict(
        success=success,
        message=shorten(message, 4 * MAX_MESSAGE_CHARS),
        error_type=error_type,
        http_status=http_status,
        target_version=target_version,
        applied_version=applied_version,
        hosts=list(hosts),
        seconds=seconds,
    )


def summarize(target_version: int, hosts: Sequence[HostPullResult], seconds: float = 0.0) -> dict:
    """The reply's fields for the merged host results of a pull."""
    hosts = list(hosts)
    if not hosts:
        return reply_fields(
            target_version, success=False, message="no scheduler rank answered the pull",
            error_type=INTERNAL_ERROR, http_status=500, seconds=seconds,
        )  # fmt: skip
    failed = [h for h in hosts if not (h.success and h.applied_version == target_version)]
    if not failed:
        work = [h for h in hosts if h.action not in ("", "noop")]
        did = ", ".join(f"{h.host}: {h.action} in {h.seconds:.3f}s" for h in work) or "already there everywhere"
        return reply_fields(
            target_version, success=True, message=f"v{target_version} is on {len(hosts)} host(s), verified ({did})",
            applied_version=target_version, hosts=hosts, seconds=seconds,
        )  # fmt: skip
    applied = {h.applied_version for h in hosts}
    first = min(failed, key=lambda h: _precedence(h.error_type))
    details = "; ".join(f"{h.host}: {h.message or 'not at the target version'}" for h in failed)
    return reply_fields(
        target_version,
        success=False,
        message=f"pull to v{target_version} failed on {len(failed)} of {len(hosts)} host(s): {details}",
        error_type=first.error_type or INTERNAL_ERROR,
        http_status=first.http_status if first.error_type else 500,
        applied_version=applied.pop() if len(applied) == 1 else None,
        hosts=hosts,
        seconds=seconds,
    )


def error_reply_fields(target_version: int, exc: BaseException, *, where: str = "") -> dict:
    """Reply fields for a request answered with an error instead of a pull's outcome.

    A ``PullInProgressError`` names the running pull's target in ``target_version`` (what a
    trainer compares with its own target); a typed error keeps its type and status; anything else
    is an internal error (500) that says where it happened.
    """
    error_type, http_status = classify_error(exc)
    message = describe_error(exc)
    if error_type == INTERNAL_ERROR and where:
        message = f"pull_weights failed {where}: {message}"
    if isinstance(exc, PullInProgressError) and exc.running_target_version is not None:
        target_version = exc.running_target_version
    return reply_fields(
        target_version, success=False, message=message, error_type=error_type, http_status=http_status
    )


def shutting_down_fields(target_version: int) -> dict:
    """Reply fields for a pull that the server's shutdown interrupted or refused."""
    return error_reply_fields(
        target_version,
        EngineUnavailableError(
            f"the server is shutting down (SIGTERM); the pull to v{target_version} was not finished "
            "here. The applied-version marker names only verified bytes; retry against the "
            "restarted server."
        ),
    )


def http_body(fields: dict) -> dict:
    """The JSON body of the HTTP reply: the reply's fields but ``http_status``, no traceback."""
    body = {name: value for name, value in fields.items() if name != "http_status"}
    body["hosts"] = msgspec.to_builtins(list(fields.get("hosts", [])))
    return body


def merge_replies(target_version: int, replies: Sequence[dict]) -> dict:
    """One reply from the DP groups' replies (dicts of reply fields); an error without hosts
    (PullInProgress, unavailable, internal) dominates."""
    for reply in replies:
        if not reply.get("success") and not reply.get("hosts"):
            return dict(reply)
    hosts = merge_host_results(h for reply in replies for h in reply.get("hosts", []))
    seconds = max((reply.get("seconds", 0.0) for reply in replies), default=0.0)
    return summarize(target_version, hosts, seconds)
