"""Outcomes of a pull: one per rank, merged per host, summarised into one reply. No sglang here.

Every TP rank of every node runs the core ``pull()`` for its host and produces a
``RankPullReport``. Reports are all-gathered over the TP group, merged per host
(``merge_host_results``: co-located ranks share one local checkpoint, so they are one host), and
the DP groups' host lists are merged again on the tokenizer side with the same function.

Invariants:
- A reply is a success only if every host succeeded and holds exactly the target version; an
  empty host list (nobody answered) is a failure.
- A failed reply names one ``error_type`` chosen by a fixed precedence (errors a retry cannot fix
  first), so the HTTP status does not depend on which host answered first.
- No traceback ever enters a report: messages are the errors' own text.
"""

from __future__ import annotations

import socket
from typing import Iterable, Optional, Sequence

import msgspec

from weightsync.errors import WeightSyncError

INTERNAL_ERROR = "internal_error"
CONFLICT = "conflict"

# Failed hosts may disagree on why; the reply names the error a retry cannot fix first.
_ERROR_PRECEDENCE = (
    "bad_request",
    "forbidden",
    "corrupt_artifact",
    "unsupported_format",
    "local_state_corrupt",
    INTERNAL_ERROR,
    CONFLICT,
    "source_not_ready",
)


def host_label(node_rank: int, hostname: Optional[str] = None) -> str:
    """How a host is named in replies: hostname plus sglang node rank (two nodes may share a name)."""
    return f"{hostname or socket.gethostname()}/node{node_rank}"


class RankPullReport(msgspec.Struct, kw_only=True):
    """What one scheduler rank saw of one pull (picklable; all-gathered over the TP group)."""

    host: str
    rank: str  # "dp{d}/tp{t}", for humans
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
    message = str(exc) if isinstance(exc, WeightSyncError) else f"{type(exc).__name__}: {exc}"
    return RankPullReport(
        host=host,
        rank=rank,
        success=False,
        error_type=error_type,
        http_status=http_status,
        message=message,
        applied_version=applied_version,
        seconds=seconds,
    )


def classify_error(exc: BaseException) -> tuple[str, int]:
    """(error_type, http_status) of an exception: the core's own, else an internal error (500)."""
    if isinstance(exc, WeightSyncError):
        return exc.error_type, int(exc.http_status)
    return INTERNAL_ERROR, 500


def _action_rank(action: str) -> int:
    return 0 if action in ("", "noop") else 1


def merge_host_results(items: Iterable[RankPullReport | HostPullResult]) -> list[HostPullResult]:
    """Group rank reports (or already-merged host results) by host, sorted by host name."""
    by_host: dict[str, list] = {}
    for item in items:
        by_host.setdefault(item.host, []).append(item)
    merged = []
    for host in sorted(by_host):
        group = by_host[host]
        ranks: list[str] = []
        for item in group:
            ranks.extend(item.ranks if isinstance(item, HostPullResult) else [item.rank])
        failed = [item for item in group if not item.success]
        # The rank that did the work (not a no-op after waiting for the lock) describes the host.
        worker = max(group, key=lambda item: (_action_rank(item.action), item.seconds))
        versions = {item.applied_version for item in group}
        if failed:
            first = min(failed, key=lambda item: _precedence(item.error_type))
            merged.append(
                HostPullResult(
                    host=host,
                    ranks=sorted(set(ranks)),
                    success=False,
                    error_type=first.error_type,
                    http_status=first.http_status,
                    message=first.message,
                    applied_version=versions.pop() if len(versions) == 1 else None,
                    action=worker.action,
                    reason=worker.reason,
                    seconds=max(item.seconds for item in group),
                    hook_ran=any(item.hook_ran for item in group),
                    nbytes_read=sum(item.nbytes_read for item in group),
                source_nbytes=sum(item.source_nbytes for item in group),
                reseeded=any(item.reseeded for item in group),
                )
            )
            continue
        agreed = len(versions) == 1
        merged.append(
            HostPullResult(
                host=host,
                ranks=sorted(set(ranks)),
                success=agreed,
                error_type=None if agreed else INTERNAL_ERROR,
                http_status=200 if agreed else 500,
                message=worker.reason if agreed else f"ranks disagree on the applied version: {sorted(versions, key=str)}",
                applied_version=versions.pop() if agreed else None,
                action=worker.action,
                reason=worker.reason,
                seconds=max(item.seconds for item in group),
                hook_ran=any(item.hook_ran for item in group),
                nbytes_read=sum(item.nbytes_read for item in group),
                source_nbytes=sum(item.source_nbytes for item in group),
                reseeded=any(item.reseeded for item in group),
            )
        )
    return merged


def _precedence(error_type: Optional[str]) -> int:
    try:
        return _ERROR_PRECEDENCE.index(error_type or INTERNAL_ERROR)
    except ValueError:
        return _ERROR_PRECEDENCE.index(INTERNAL_ERROR)


def summarize(target_version: int, hosts: Sequence[HostPullResult], seconds: float = 0.0) -> dict:
    """The reply's fields (see ``PullWeightsReqOutput``) for the merged host results."""
    hosts = list(hosts)
    ok = bool(hosts) and all(h.success and h.applied_version == target_version for h in hosts)
    applied = {h.applied_version for h in hosts}
    applied_version = applied.pop() if len(applied) == 1 else None
    if ok:
        work = [h for h in hosts if h.action not in ("", "noop")]
        did = ", ".join(f"{h.host}: {h.action} in {h.seconds:.3f}s" for h in work) or "already there everywhere"
        return dict(
            success=True,
            message=f"v{target_version} is on {len(hosts)} host(s), verified ({did})",
            error_type=None,
            http_status=200,
            target_version=target_version,
            applied_version=target_version,
            hosts=hosts,
            seconds=seconds,
        )
    if not hosts:
        return dict(
            success=False,
            message="no scheduler rank answered the pull",
            error_type=INTERNAL_ERROR,
            http_status=500,
            target_version=target_version,
            applied_version=None,
            hosts=[],
            seconds=seconds,
        )
    failed = [h for h in hosts if not (h.success and h.applied_version == target_version)]
    first = min(failed, key=lambda h: _precedence(h.error_type))
    error_type = first.error_type or INTERNAL_ERROR
    http_status = first.http_status if first.error_type else 500
    details = "; ".join(f"{h.host}: {h.message or 'not at the target version'}" for h in failed)
    return dict(
        success=False,
        message=f"pull to v{target_version} failed on {len(failed)} of {len(hosts)} host(s): {details}",
        error_type=error_type,
        http_status=http_status,
        target_version=target_version,
        applied_version=applied_version,
        hosts=hosts,
        seconds=seconds,
    )


def conflict_fields(target_version: int, running_target: Optional[int]) -> dict:
    """Reply fields for a pull refused because another one is still running here."""
    running = f" (to v{running_target})" if running_target is not None else ""
    return dict(
        success=False,
        message=(
            f"another pull{running} is still running on this engine; this request to "
            f"v{target_version} was not queued. Wait for the running pull's reply, then retry."
        ),
        error_type=CONFLICT,
        http_status=409,
        target_version=target_version,
        applied_version=None,
        hosts=[],
        seconds=0.0,
    )


def merge_replies(target_version: int, replies: Sequence[dict]) -> dict:
    """One reply from the DP groups' replies (dicts of reply fields); conflicts dominate."""
    for reply in replies:
        if reply.get("error_type") == CONFLICT and not reply.get("hosts"):
            return dict(reply)
    hosts = merge_host_results(h for reply in replies for h in reply.get("hosts", []))
    seconds = max((reply.get("seconds", 0.0) for reply in replies), default=0.0)
    return summarize(target_version, hosts, seconds)
