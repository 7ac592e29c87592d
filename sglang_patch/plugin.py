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
- ``sglang.srt.managers.tokenizer_manager``: ``/update_weights_from_disk`` is timed (``metrics``);
  ``continue_generation`` waits for a live-apply transaction (``tokenizer_side``).

The layout: this module and its neighbours at the top are the sglang glue (hooks, IPC types,
routes, flags); the two features live in packages that import no glue: ``pull`` (the pull, its
coordinator and helper process) and ``live`` (live apply). ``paths`` and ``compat`` are leaves
every part may use. Every decision (paths, errors, merging, the collective protocol, the live
transaction) lives in modules that import no sglang and are tested without it.

A part that fails to install (an sglang whose internals differ) never takes the engine down: one
error line is logged, the failure is recorded (``parts.unavailable_reason``), sglang serves on, and the
route answers 503 with the reason. The scheduler's part guards itself the same way
(``scheduler_side``).
"""

from __future__ import annotations

import logging

from ._post_import import when_imported
from .parts import guarded

log = logging.getLogger(__name__)

_loaded = False


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
        from . import live_hooks, scheduler_side

        live_hooks.register_hooks()  # before scheduler_side applies every registered hook
        scheduler_side.install()

    def tokenizer(module):
        from . import tokenizer_side

        tokenizer_side.install(module)
        tokenizer_side.install_live(module)

    def route(module):
        from . import http_route

        http_route.install(module)

    def continue_wait(_module):
        from . import tokenizer_side

        tokenizer_side.install_continue_wait()

    def reload_metrics(_module):
        from . import metrics

        metrics.install()

    when_imported("sglang.srt.server_args", guarded("flags", flags))
    when_imported("sglang.srt.managers.io_struct", guarded("ipc types", types))
    when_imported("sglang.srt.managers.scheduler", guarded("scheduler", scheduler))
    when_imported("sglang.srt.managers.tokenizer_control_mixin", guarded("tokenizer", tokenizer))
    when_imported("sglang.srt.entrypoints.http_server", guarded("route", route))
    when_imported("sglang.srt.managers.tokenizer_manager", guarded("metrics", reload_metrics))
    when_imported("sglang.srt.managers.tokenizer_manager", guarded("continue wait", continue_wait))
    log.info("weightsync pull_weights plugin loaded")
