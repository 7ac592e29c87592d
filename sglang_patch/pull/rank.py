"""What one scheduler rank does for one ``/pull_weights`` request, wherever it runs.

``RankPuller`` checks the request's paths against the operator's allowed roots, runs the core's
``weightsync.pull`` for this rank's host and turns the outcome into a ``RankPullReport``. It
never raises: every exception becomes a failed report (traceback to the log). No sglang and no
torch here: it runs in the pull helper process (``sglang_patch.pull.process``) and, as the
fallback, in a thread of the scheduler process.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import weightsync
from weightsync.errors import InvalidRequestError, WeightSyncError

from . import results
from ..paths import CheckedPaths, check_request_paths
from .options import PullWeightsOptions

log = logging.getLogger(__name__)


class RankPuller:
    """One rank's pull: ``puller(request) -> RankPullReport`` for a request with
    ``local_checkpoint_dir``, ``source_dir`` and ``target_version``."""

    def __init__(self, *, options: PullWeightsOptions, seed_dir: Optional[str], host: str, rank: str) -> None:
        self.options = options
        self.seed_dir = seed_dir
        self.host = host
        self.rank = rank

    def __call__(self, request: Any) -> results.RankPullReport:
        start = time.monotonic()
        checked = None
        try:
            checked = self.check_paths(request)
            if self.seed_dir is None:
                raise InvalidRequestError(
                    "the engine's model path is not a local directory, so version 0 (the seed) is "
                    "unknown; start the engine from a local checkpoint dir"
                )
            outcome = weightsync.pull(
                checked.local_checkpoint_dir,
                self.seed_dir,
                checked.source_dir,
                request.target_version,
                pre_read_hook=self.options.pre_read_hook,
                # Reply once the bytes are verified in the page cache (the engine reloads from
                # there); the flush and the marker finish in the background, and co-located
                # ranks return as soon as the verified version is noted.
                durability="deferred",
            )
            log.info(
                "pull_weights %s: v%d %s in %.3fs (%s)",
                self.rank, outcome.applied_version, outcome.action, outcome.seconds, outcome.reason,
            )
            return results.report_success(self.host, self.rank, outcome)
        except Exception as exc:
            if isinstance(exc, WeightSyncError) and exc.http_status < 500:  # routine: refused, not there yet
                log.warning("pull_weights %s: v%s: %s", self.rank, request.target_version, results.describe_error(exc))
            else:
                log.exception("pull_weights %s: pull to v%s failed", self.rank, getattr(request, "target_version", "?"))
            return self.failure(request, exc, time.monotonic() - start, checked=checked)

    def check_paths(self, request: Any) -> CheckedPaths:
        return check_request_paths(
            request.local_checkpoint_dir, request.source_dir, self.options.allowed_roots, seed_dir=self.seed_dir
        )

    def failure(
        self, request: Any, exc: BaseException, seconds: float, *, checked: Optional[CheckedPaths] = None
    ) -> results.RankPullReport:
        """A failed report that also says which version the host's local checkpoint holds."""
        applied = None
        try:
            if checked is None:
                checked = self.check_paths(request)
            # only a dir that passed the path checks has its marker read
            applied = weightsync.applied_version(checked.local_checkpoint_dir)
        except Exception:
            applied = None
        return results.report_failure(self.host, self.rank, exc, seconds=seconds, applied_version=applied)
