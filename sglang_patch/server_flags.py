"""Server flags of the pull endpoint, added to sglang's CLI from the plugin.

Flags (accepted by ``python -m sglang.launch_server`` and ``sglang serve``):

- ``--custom-pull-weights-pre-read-hook pkg.mod.fn``: called as ``fn(source_dir, target_version)``
  once per host per pull that has work to do, before the source is read (e.g. to refresh an
  object-store-backed mount). Passed to the core ``pull(..., pre_read_hook=...)``.
- ``--pull-weights-allowed-roots DIR[,DIR...]``: the only directories a request may read
  (``source_dir``) or write (``local_checkpoint_dir``); see ``sglang_patch.paths``. Default: none,
  so ``/pull_weights`` refuses every request (403) until the operator names its roots.
- ``--pull-weights-timeout-s S`` (default 600): the deadline of one pull. When it passes, every
  rank agrees the pull failed (504 ``pull_timeout``); a thread stuck in a hung read is abandoned
  (the applied-version marker still names only verified bytes).

How the flags reach every process: sglang 0.5.23's ``ServerArgs`` is a msgspec Struct assembled
from field namespaces when ``sglang.srt.server_args`` is imported, before any plugin loads, so a
plugin cannot add a field. Instead the plugin hooks ``ServerArgs.add_cli_args`` (adds the flags to
the parser) and ``ServerArgs.from_cli_args`` (validates the values and stores them as one
bookkeeping attribute, ``server_args._pull_weights_options``). ``ServerArgs`` keeps such
underscore attributes when pickled to scheduler processes (its ``__reduce__`` carries
``__dict__``; sglang's own ``_launch_command`` travels the same way), so every scheduler reads the
same options. For ``sglang.Engine(...)`` (no command line) the environment variables
``SGLANG_CUSTOM_PULL_WEIGHTS_PRE_READ_HOOK``, ``SGLANG_PULL_WEIGHTS_ALLOWED_ROOTS`` and
``SGLANG_PULL_WEIGHTS_TIMEOUT_S`` give the same settings; a flag wins over its variable.

The fleet's BitTorrent swarm (docs/FLEET.md) has no flag on purpose: its settings are the host's,
not the engine's (``WEIGHTSYNC_SWARM_PEERS``, ``WEIGHTSYNC_SWARM_LISTEN``,
``WEIGHTSYNC_SWARM_TRACKER``, like ``WEIGHTSYNC_HTTP_ORIGIN``), set in the server's environment,
which every pull helper inherits (``sglang_patch.pull.process``), so the core's ``pull()`` reads
them on each host as a trainer-side pull does. ``check_swarm_environment`` checks them at start:
a setting that cannot be used stops the server; a swarm named on a host without libtorrent is
logged at start and each HTTP pull replies ``swarm_unavailable`` (400) naming the extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
from typing import Any, Optional


from .pull.coordinator import DEFAULT_TIMEOUT_S
from .pull.options import DEFAULT_LIVE_MAX_CHANGED_FRACTION, PullWeightsOptions
from .paths import ALLOWED_ROOTS_FLAG, parse_allowed_roots

log = logging.getLogger(__name__)

PRE_READ_HOOK_FLAG = "--custom-pull-weights-pre-read-hook"
PRE_READ_HOOK_ENV = "SGLANG_CUSTOM_PULL_WEIGHTS_PRE_READ_HOOK"
ALLOWED_ROOTS_ENV = "SGLANG_PULL_WEIGHTS_ALLOWED_ROOTS"
TIMEOUT_FLAG = "--pull-weights-timeout-s"
TIMEOUT_ENV = "SGLANG_PULL_WEIGHTS_TIMEOUT_S"
OPTIONS_ATTR = "_pull_weights_options"
_PRE_READ_HOOK_DEST = "custom_pull_weights_pre_read_hook"
_ALLOWED_ROOTS_DEST = "pull_weights_allowed_roots"
LIVE_MAX_FRACTION_FLAG = "--update-weights-live-max-changed-fraction"
LIVE_MAX_FRACTION_ENV = "SGLANG_UPDATE_WEIGHTS_LIVE_MAX_CHANGED_FRACTION"
_LIVE_MAX_FRACTION_DEST = "update_weights_live_max_changed_fraction"
_TIMEOUT_DEST = "pull_weights_timeout_s"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the endpoint's flags to sglang's server parser (idempotent)."""
    existing = {opt for action in parser._actions for opt in action.option_strings}
    if PRE_READ_HOOK_FLAG not in existing:
        parser.add_argument(
            PRE_READ_HOOK_FLAG,
            dest=_PRE_READ_HOOK_DEST,
            type=str,
            default=None,
            metavar="IMPORT.PATH",
            help="POST /pull_weights: function 'pkg.mod.fn' called as fn(source_dir, target_version) "
            "once per host per pull that has work to do, before the source is read.",
        )
    if ALLOWED_ROOTS_FLAG not in existing:
        parser.add_argument(
            ALLOWED_ROOTS_FLAG,
            dest=_ALLOWED_ROOTS_DEST,
            type=str,
            default=None,
            metavar="DIR[,DIR...]",
            help="POST /pull_weights: the only directories a request may read (source_dir) or "
            "write (local_checkpoint_dir). Default: none, so every pull is refused (403).",
        )
    if LIVE_MAX_FRACTION_FLAG not in existing:
        parser.add_argument(
            LIVE_MAX_FRACTION_FLAG,
            dest=_LIVE_MAX_FRACTION_DEST,
            type=str,
            default=None,
            metavar="FRACTION",
            help="POST /update_weights_from_pulled: reload instead of patching live when more than this "
            f"fraction of a rank's mapped elements changed (default {DEFAULT_LIVE_MAX_CHANGED_FRACTION}).",
        )
    if TIMEOUT_FLAG not in existing:
        parser.add_argument(
            TIMEOUT_FLAG,
            dest=_TIMEOUT_DEST,
            type=str,
            default=None,
            metavar="SECONDS",
            help=f"POST /pull_weights: the deadline of one pull (default {DEFAULT_TIMEOUT_S:g}). When it "
            "passes the pull fails with 504 pull_timeout on every rank.",
        )


def options_from_values(
    pre_read_hook: Optional[str],
    allowed_roots: Optional[str],
    live_max_changed_fraction: Optional[str] = None,
    timeout_s: Optional[str] = None,
) -> PullWeightsOptions:
    """Validated options; raises ``ValueError`` with the flag's name for a bad value."""
    hook = (pre_read_hook or "").strip() or None
    if hook is not None:
        check_hook_path(hook)
    return PullWeightsOptions(
        pre_read_hook=hook,
        allowed_roots=parse_allowed_roots(allowed_roots),
        live_max_changed_fraction=parse_fraction(live_max_changed_fraction),
        timeout_s=parse_timeout(timeout_s),
    )


def parse_fraction(value: Optional[str]) -> float:
    if value is None or not str(value).strip():
        return DEFAULT_LIVE_MAX_CHANGED_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"{LIVE_MAX_FRACTION_FLAG}: {value!r} is not a number") from None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{LIVE_MAX_FRACTION_FLAG}: {fraction} is outside [0, 1] (0 disables live apply)")
    return fraction


def parse_timeout(value: Optional[str]) -> float:
    """The pull deadline in seconds: a positive finite number (default when unset)."""
    if value is None or not str(value).strip():
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_FLAG}: {value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{TIMEOUT_FLAG}: {value!r} must be a positive number of seconds")
    return seconds


def check_hook_path(hook: str) -> None:
    """A hook must look like 'pkg.mod.fn' and its module must be importable (not imported here)."""
    module, _, attr = hook.rpartition(".")
    if not module or not attr or not all(part.isidentifier() for part in hook.split(".")):
        raise ValueError(f"{PRE_READ_HOOK_FLAG}: {hook!r} is not an import path like 'package.module.function'")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{PRE_READ_HOOK_FLAG}: module {module!r} of {hook!r} cannot be found: {exc}") from None
    if found is None:
        raise ValueError(f"{PRE_READ_HOOK_FLAG}: module {module!r} of {hook!r} cannot be found on sys.path")


def attach_options(server_args: Any, namespace: argparse.Namespace) -> None:
    """Store the parsed flags on ``server_args`` (a bookkeeping attribute that survives pickling)."""
    hook = getattr(namespace, _PRE_READ_HOOK_DEST, None)
    roots = getattr(namespace, _ALLOWED_ROOTS_DEST, None)
    fraction = getattr(namespace, _LIVE_MAX_FRACTION_DEST, None)
    timeout = getattr(namespace, _TIMEOUT_DEST, None)
    hook = hook if hook is not None else os.environ.get(PRE_READ_HOOK_ENV)
    roots = roots if roots is not None else os.environ.get(ALLOWED_ROOTS_ENV)
    fraction = fraction if fraction is not None else os.environ.get(LIVE_MAX_FRACTION_ENV)
    timeout = timeout if timeout is not None else os.environ.get(TIMEOUT_ENV)
    setattr(server_args, OPTIONS_ATTR, options_from_values(hook, roots, fraction, timeout))
    check_swarm_environment()


def check_swarm_environment() -> bool:
    """Whether this host's environment names a fleet swarm for its pulls.

    Raises ``ValueError`` (``SwarmConfigError``) for a peer, listen or tracker setting that cannot
    be used: an operator error, caught at start rather than at the first pull. A swarm named
    without libtorrent installed is only logged: the pulls then reply ``swarm_unavailable``.
    """
    from weightsync.errors import SwarmUnavailableError
    from weightsync.storage.swarm import SwarmConfig, check_swarm_available

    config = SwarmConfig.from_env()
    if config is None:
        return False
    try:
        check_swarm_available()
    except SwarmUnavailableError as exc:
        log.warning("pull_weights: %s Every pull from an HTTP source will be refused until then.", exc)
    return True


def options_of(server_args: Any) -> PullWeightsOptions:
    """The options a process should use: from ``server_args``, else from the environment."""
    options = getattr(server_args, OPTIONS_ATTR, None) if server_args is not None else None
    if isinstance(options, PullWeightsOptions):
        return options
    return options_from_values(
        os.environ.get(PRE_READ_HOOK_ENV),
        os.environ.get(ALLOWED_ROOTS_ENV),
        os.environ.get(LIVE_MAX_FRACTION_ENV),
        os.environ.get(TIMEOUT_ENV),
    )


# --- sglang hooks (registered by sglang_patch.plugin) ----------------------------------------


def _after_add_cli_args(result, parser, *args, **kwargs):
    add_cli_args(parser)
    return result


def _after_from_cli_args(server_args, cls, namespace, *args, **kwargs):
    attach_options(server_args, namespace)
    return server_args


_installed = False


def install() -> None:
    """Register the ServerArgs hooks (call when ``sglang.srt.server_args`` is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="pull_weights", dist_name="weightsync")

    base = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{base}.add_cli_args", _after_add_cli_args, HookType.AFTER, source=source)
    HookRegistry.register(f"{base}.from_cli_args", _after_from_cli_args, HookType.AFTER, source=source)
    HookRegistry.apply_hooks()
