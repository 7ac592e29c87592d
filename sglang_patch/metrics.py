"""Prometheus metrics of the weight sync, served by sglang's own ``/metrics`` (``--enable-metrics``).

sglang serves ``/metrics`` in Prometheus multiprocess mode: ``--enable-metrics`` makes it set
``PROMETHEUS_MULTIPROC_DIR`` before it starts any child process, every process writes its values
to files there, and the HTTP process's ``MultiProcessCollector`` merges them at scrape time.
Without that variable there is no ``/metrics`` to serve, so every function here is a no-op.

Everything is recorded in the HTTP (tokenizer) process, where each pull's merged reply and each
weight update (``/update_weights_from_disk``, timed by a hook here; ``/update_weights_from_pulled``,
which reports its own pause and mode) are seen once: counters and histograms are summed over processes by the
collector; gauges use ``multiprocess_mode="mostrecent"`` so several tokenizer workers (or a
restarted one) never add versions up. The metrics are created on first use, after sglang has
set the variable (``prometheus_client`` picks its storage when a metric is created).

Metrics (glossary of docs/FORMAT.md):

| name | type | labels | meaning |
|---|---|---|---|
| ``weightsync_pulls_total`` | counter | ``outcome``, ``error_type`` | ``POST /pull_weights`` replies (``none`` for a success) |
| ``weightsync_pull_seconds`` | histogram | ``outcome`` | a pull's wall time as the HTTP process saw it |
| ``weightsync_pull_source_read_bytes_total`` | counter | ``host`` | bytes read from the source dir (the core's ``PullResult.source_nbytes``: delta shards, a full version's files) |
| ``weightsync_applied_version`` | gauge | ``host`` | the version each host's local checkpoint holds (last reply that said) |
| ``weightsync_live_weight_version`` | gauge | | the version the engine serves (0: the model it started from) |
| ``weightsync_reseeds_total`` | counter | ``host`` | pulls that found the local state torn or corrupt and reseeded |
| ``weightsync_weight_update_pause_seconds`` | histogram | ``mode`` | how long a weight update held generation: ``reload`` (``/update_weights_from_disk``) or ``live`` |
| ``weightsync_update_mode_choices_total`` | counter | ``mode``, ``by`` | how each ``/update_weights_from_pulled`` chose its mode (``live.results.decide_mode``): by ``vote``, ``nothing to write``, ``unmeasured``, ``estimate`` or ``probe`` (the losing mode measured again) |
| ``weightsync_update_checks_total`` | counter | ``outcome`` | ranks' checks of the live weights after a ``/update_weights_from_pulled`` (``live.check``): ``ok``, ``mismatch``, ``failed`` (the check could not run: the reply is not a success), or ``unchecked`` (no sample drawn: the detail says why) |
| ``weightsync_update_check_mismatches_total`` | counter | | parameter elements those checks found different from the published bytes |
| ``weightsync_update_check_reloads_total`` | counter | | live applies whose check found a mismatch, after which every rank reloaded |
| ``weightsync_update_check_seconds`` | histogram | ``part`` | what each rank's check cost: inside the pause, ``written`` (every element a live apply wrote, read back in the scatter, and the storages' check at commit) and ``sample`` (its checkpoint sample); at a live apply's staging, while serving, ``sample_at_staging`` (the sampled elements already at the target's bytes) |
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
SUCCESS = "success"
FAILURE = "failure"
NO_ERROR = "none"
UPDATE_MODES = ("reload", "live")
PULL_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
PAUSE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
CHECK_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.pulls = Counter(
            "weightsync_pulls_total", "POST /pull_weights replies by outcome and error type.",
            ["outcome", "error_type"],
        )  # fmt: skip
        self.pull_seconds = Histogram(
            "weightsync_pull_seconds", "Wall time of a POST /pull_weights, as the HTTP process saw it.",
            ["outcome"], buckets=PULL_SECONDS_BUCKETS,
        )  # fmt: skip
        self.source_read_bytes = Counter(
            "weightsync_pull_source_read_bytes", "Bytes read from the source dir by pulls, per host.", ["host"]
        )
        self.applied_version = Gauge(
            "weightsync_applied_version", "The weight version each host's local checkpoint holds.",
            ["host"], multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.live_version = Gauge(
            "weightsync_live_weight_version",
            "The weight version the engine serves (0: the model it started from).",
            multiprocess_mode="mostrecent",
        )
        self.reseeds = Counter(
            "weightsync_reseeds", "Pulls that found the local state torn or corrupt and reseeded.", ["host"]
        )
        self.pause_seconds = Histogram(
            "weightsync_weight_update_pause_seconds",
            "How long a weight update held generation, by mode (reload: /update_weights_from_disk; live).",
            ["mode"], buckets=PAUSE_SECONDS_BUCKETS,
        )  # fmt: skip
        self.mode_choices = Counter(
            "weightsync_update_mode_choices",
            "How each update from a pulled checkpoint chose its mode (vote, estimate, probe...).", ["mode", "by"],
        )  # fmt: skip
        self.update_checks = Counter(
            "weightsync_update_checks", "Ranks' checks of the live weights after an update, by outcome.", ["outcome"]
        )
        self.update_check_mismatches = Counter(
            "weightsync_update_check_mismatches", "Parameter elements found different from the published bytes."
        )
        self.update_check_reloads = Counter(
            "weightsync_update_check_reloads", "Live applies whose check found a mismatch (every rank then reloaded)."
        )
        self.update_check_seconds = Histogram(
            "weightsync_update_check_seconds",
            "What each rank's check after an update cost, by part (written, sample: in the pause; sample_at_staging: while serving).",
            ["part"], buckets=CHECK_SECONDS_BUCKETS,
        )  # fmt: skip
        self.live_version.set(0)


_lock = threading.Lock()
_metrics: Optional[_Metrics] = None
# The versions that successful pulls left in each local checkpoint dir (this process's view),
# so that a reload from one of them can name the version it now serves.
_pulled_versions: dict[str, int] = {}
_MAX_REMEMBERED_DIRS = 64


def is_enabled() -> bool:
    """True when sglang runs with ``--enable-metrics`` (it then sets ``PROMETHEUS_MULTIPROC_DIR``)."""
    return bool(os.environ.get(MULTIPROC_DIR_ENV))


def _get() -> Optional[_Metrics]:
    global _metrics
    if _metrics is None and is_enabled():
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


def observe_pull(reply: Mapping[str, Any], local_checkpoint_dir: Optional[str] = None) -> None:
    """Record one ``/pull_weights`` reply (its JSON fields: success, error_type, seconds, hosts).

    Never raises: a metrics problem is logged and the reply goes out as it is.
    """
    try:
        _record_pull(reply, local_checkpoint_dir)
    except Exception:
        log.exception("weightsync metrics: recording a pull failed")


def _record_pull(reply: Mapping[str, Any], local_checkpoint_dir: Optional[str]) -> None:
    metrics = _get()
    success = bool(reply.get("success"))
    if success and local_checkpoint_dir and reply.get("applied_version") is not None:
        path = os.path.realpath(local_checkpoint_dir)
        _pulled_versions.pop(path, None)
        _pulled_versions[path] = int(reply["applied_version"])
        while len(_pulled_versions) > _MAX_REMEMBERED_DIRS:  # bounded however many dirs callers use
            _pulled_versions.pop(next(iter(_pulled_versions)))
    if metrics is None:
        return
    outcome = SUCCESS if success else FAILURE
    metrics.pulls.labels(outcome, NO_ERROR if success else str(reply.get("error_type") or "internal_error")).inc()
    metrics.pull_seconds.labels(outcome).observe(float(reply.get("seconds") or 0.0))
    for host in reply.get("hosts") or ():
        name = _field(host, "host")
        metrics.source_read_bytes.labels(name).inc(int(_field(host, "source_nbytes", 0) or 0))
        if _field(host, "reseeded", False):
            metrics.reseeds.labels(name).inc()
        applied = _field(host, "applied_version")
        if applied is not None:
            metrics.applied_version.labels(name).set(int(applied))


def observe_weight_update_pause(mode: str, seconds: float) -> None:
    """Record how long one weight update held generation; ``mode`` is ``reload`` or ``live``."""
    if mode not in UPDATE_MODES:
        raise ValueError(f"weight update mode {mode!r} is not one of {UPDATE_MODES}")
    metrics = _get()
    if metrics is not None:
        metrics.pause_seconds.labels(mode).observe(float(seconds))


def set_live_weight_version(version: int) -> None:
    """Record the weight version the engine now serves (after a reload or a live apply)."""
    metrics = _get()
    if metrics is not None:
        metrics.live_version.set(int(version))


def observe_update_from_pulled(reply: Mapping[str, Any]) -> None:
    """Record one ``/update_weights_from_pulled`` reply: its pause by mode, and the served version.

    Never raises (like ``observe_pull``).
    """
    try:
        _record_checks(reply)
        _record_mode_choice(reply)
        if not reply.get("success"):
            return
        mode = reply.get("mode")
        if mode in UPDATE_MODES:
            observe_weight_update_pause(mode, float(reply.get("pause_s") or 0.0))
        version = reply.get("weight_version")
        if version is None:
            version = reply.get("target_version")
        if version is not None and int(version) >= 0:
            set_live_weight_version(int(version))
    except Exception:
        log.exception("weightsync metrics: recording a weight update failed")


def _record_checks(reply: Mapping[str, Any]) -> None:
    metrics = _get()
    if metrics is None:
        return
    final = [c for host in reply.get("hosts") or () for c in (_field(host, "checks") or ())]
    # failed_checks repeats the hosts' own checks that did not hold (live.results.summarize): once each
    seen = {_check_key(c) for c in final}
    checks = [c for c in reply.get("failed_checks") or () if _check_key(c) not in seen] + final
    for check in checks:
        mismatches = int(_field(check, "mismatches", 0) or 0)
        compared = int(_field(check, "sampled_elements", 0) or 0) + int(_field(check, "scattered_elements", 0) or 0)
        outcome = "mismatch" if mismatches else ("failed" if _field(check, "failed") else ("ok" if compared else "unchecked"))
        metrics.update_checks.labels(outcome).inc()
        metrics.update_check_mismatches.inc(mismatches)
        if int(_field(check, "scattered_elements", 0) or 0):
            metrics.update_check_seconds.labels("written").observe(  # the read-back in the scatter and the storages' check
                float(_field(check, "written_read_back_s", 0.0) or 0.0) + float(_field(check, "scattered_check_s", 0.0) or 0.0))
        if int(_field(check, "sampled_elements", 0) or 0):
            metrics.update_check_seconds.labels("sample").observe(float(_field(check, "sample_check_s", 0.0) or 0.0))
        if int(_field(check, "sampled_before_pause", 0) or 0):  # outside the pause
            metrics.update_check_seconds.labels("sample_at_staging").observe(
                float(_field(check, "sample_before_pause_s", 0.0) or 0.0))
    if reply.get("reloaded_after_check"):
        metrics.update_check_reloads.inc()


def _record_mode_choice(reply: Mapping[str, Any]) -> None:
    choice = reply.get("mode_choice")
    metrics = _get()
    if metrics is None or not isinstance(choice, Mapping):
        return
    metrics.mode_choices.labels(str(choice.get("mode")), str(choice.get("by"))).inc()


def _check_key(check: Any) -> tuple:
    return tuple(_field(check, f) for f in ("rank", "mismatches", "failed", "detail", "verified_elements", "check_s"))


def observe_reload(model_path: Optional[str], success: bool, seconds: float) -> None:
    """Record one ``/update_weights_from_disk``: its pause, and on success the version it serves.

    The version is the one a successful pull left in ``model_path``; a reload from any other
    directory serves weights this plugin did not sync, reported as -1.
    """
    observe_weight_update_pause("reload", seconds)
    if success:
        version = _pulled_versions.get(os.path.realpath(model_path)) if model_path else None
        set_live_weight_version(-1 if version is None else version)


def _field(item: Any, name: str, default: Any = None) -> Any:
    if isinstance(item, Mapping):
        return item.get(name, default)
    return getattr(item, name, default)


# --- sglang hook (registered by sglang_patch.plugin) -----------------------------------------


async def _around_update_weights_from_disk(original, tokenizer_manager, obj, *args, **kwargs):
    import time

    start = time.monotonic()
    success = False
    try:
        result = await original(tokenizer_manager, obj, *args, **kwargs)
        success = bool(result[0])
        return result
    finally:
        try:
            observe_reload(getattr(obj, "model_path", None), success, time.monotonic() - start)
        except Exception:  # metrics never break a weight update
            log.exception("weightsync metrics: recording a reload failed")


_installed = False


def install(*_ignored) -> None:
    """Time ``/update_weights_from_disk`` (call when ``sglang.srt.managers.tokenizer_manager`` loads)."""
    global _installed
    if _installed:
        return
    _installed = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="pull_weights", dist_name="weightsync")
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_weights_from_disk",
        _around_update_weights_from_disk, HookType.AROUND, source=source,
    )  # fmt: skip
    HookRegistry.apply_hooks()
