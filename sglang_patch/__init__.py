"""sglang plugin (0.5.16 to 0.5.23): ``POST /pull_weights`` brings every engine host's local
checkpoint to a published weight version (the core's ``weightsync.pull``), so that the trainer
can then reload the engine with sglang's own ``/update_weights_from_disk``.

Installed through the ``sglang.srt.plugins`` entry point ``pull_weights =
sglang_patch.plugin:load_plugin``; no sglang file is changed. Layout (arrows = imports, one way;
``tests/unit/test_sglang_patch_layout.py`` holds it):

    plugin ──> server_flags, io_types, scheduler_side, live_hooks, tokenizer_side, http_route,
               metrics, parts, scheduler_context                      (the sglang glue, at the top)
                    │
                    ├──> pull/   the pull: request, results, coordinator, rank, process, options
                    │      │
                    │      └──> live/stage (the helper process stages live apply's update)
                    ├──> live/   live apply: state, identity, scope, stage, patch, transaction,
                    │            check, results, coordinate_map, loop_slices
                    └──> paths, compat                                   (leaves: import nothing of ours)
                                         └──> weightsync (the core)

The packages import no glue (what they need from sglang's process is passed in) and no sglang
at import time; they are unit-tested without a server.

- ``paths``: which directories a request may read/write (``--pull-weights-allowed-roots``).
- ``pull.request``: the request body, parsed strictly (a version is a JSON integer, nothing else).
- ``pull.results``: per-rank reports -> per-host results -> one reply with one error type/status;
  every reply's fields are built there.
- ``pull.coordinator``: the pull runs in a thread with a deadline; all TP ranks of a stage finish
  it at the same scheduler loop iteration via a per-iteration all-reduce, later pipeline stages
  report to stage 0 through a side channel, so nobody blocks the loop or deadlocks; a retry of
  the running pull joins it.
- ``pull.rank``: what one rank does for one pull (path checks, the core's ``pull``, its report).
- ``pull.process``: where that runs: a helper process per rank with the engine's whole CPU set,
  out of reach of the scheduler loop's GIL; a killed helper is a typed failure; ``cancel``
  (called at the deadline).
- ``pull.options``: the operator's settings as every scheduler sees them.
- ``live``: live apply (``POST /update_weights_from_pulled``); ``docs/LIVE_APPLY.md`` maps its
  modules.
- ``server_flags``: the CLI flags, carried to every scheduler on ``ServerArgs``.
- ``io_types``: the request/reply IPC messages (pickle and msgpack).
- ``scheduler_side`` / ``live_hooks`` / ``tokenizer_side`` / ``http_route``: the hooks into sglang
  (the pull's and live apply's scheduler hooks, the fan-out to DP groups, the routes).
- ``scheduler_context``: a scheduler's TP group, stage channel, rank label and seed dir.
- ``parts``: which parts of the plugin installed (a failed one makes the routes answer 503).
- ``compat``: the one place that knows how the supported sglang releases (0.5.16 to 0.5.23) differ.
- ``metrics``: the weightsync series on sglang's ``/metrics`` (``--enable-metrics``).
"""
