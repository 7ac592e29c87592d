"""sglang plugin entry point (``sglang.srt.plugins`` group): adds ``POST /pull_weights``.

sglang 0.5.23 calls ``load_plugin`` early in every process it starts (launcher, tokenizer,
schedulers, detokenizer, DP controller). Each part of the patch is applied when, and only if,
that process imports the sglang module it patches:

- ``sglang.srt.server_args``: the ``--custom-pull-weights-pre-read-hook`` and
  ``--pull-weights-allowed-roots`` flags (``server_flags``);
- ``sglang.srt.managers.io_struct``: the request/reply types join sglang's msgpack IPC (``io_types``);
- ``sglang.srt.managers.scheduler``: the handler on every TP rank (``scheduler_side``);
- ``sglang.srt.managers.tokenizer_control_mixin``: the fan-out to DP groups (``tokenizer_side``);
- ``sglang.srt.entrypoints.http_server``: the route (``http_route``);
- ``sglang.srt.managers.tokenizer_manager``: ``/update_weights_from_disk`` is timed (``metrics``).

Every decision (paths, errors, merging, the collective protocol) lives in modules that import no
sglang and are tested without it: ``paths``, ``request``, ``results``, ``coordinator``.

A part that fails to install (an sglang whose internals differ) never takes the engine down: one
error line is logged, the failure is recorded (``unavailable_reason``), sglang serves on, and the
route answers 503 with the reason. The scheduler's part guards itself the same way
(``scheduler_side``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ._post_import import when_imported

log = logging.getLogger(__name__)

_loaded = False
_failures: dict[str, str] = {}


def unavailable_reason() -> Optional[str]:
    """Why ``/pull_weights`` cannot work in this process (a part failed to install), or None."""
    if not _failures:
        return None
    return "; ".join(f"{part}: {why}" for part, why in sorted(_failures.items()))


def guarded(part: str, install: Callable) -> Callable:
    """``install`` wrapped so that a failure is logged in one line and recorded, never raised."""

    def run(module) -> None:
        try:
            install(module)
        except Exception as exc:
            _failures[part] = f"{type(exc).__name__}: {exc}"
            log.error(
                "weightsync pull_weights: the %s part failed to install (%s); sglang serves on "
                "without it and /pull_weights answers 503",
                part, _failures[part],
            )  # fmt: skip
            log.debug("weightsync pull_weights: %s install traceback", part, exc_info=True)

    return run


def load_plugin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True

    def flags(_module):
        from . import server_flags

        server_flags.install()

    def types(_module):
        from . import io_types

        io_types.register_types()
        io_types.register_live_types()

    def scheduler(_module):
        from . import scheduler_side

        from . import live_side

        live_side.register_hooks()  # before scheduler_side applies every registered hook
        scheduler_side.install()

    def tokenizer(module):
        from . import tokenizer_side

        tokenizer_side.install(module)
        tokenizer_side.install_live(module)

    def route(module):
        from . import http_route

        http_route.install(module)

    def reload_metrics(_module):
        from . import metrics

        metrics.install()

    when_imported("sglang.srt.server_args", guarded("flags", flags))
    when_imported("sglang.srt.managers.io_struct", guarded("ipc types", types))
    when_imported("sglang.srt.managers.scheduler", guarded("scheduler", scheduler))
    when_imported("sglang.srt.managers.tokenizer_control_mixin", guarded("tokenizer", tokenizer))
    when_imported("sglang.srt.entrypoints.http_server", guarded("route", route))
    when_imported("sglang.srt.managers.tokenizer_manager", guarded("metrics", reload_metrics))
    log.info("weightsync pull_weights plugin loaded")
