"""sglang plugin (0.5.16 to 0.5.23): ``POST /pull_weights`` brings every engine host's local
checkpoint to a published weight version (the core's ``weightsync.pull``), so that the trainer
can then reload the engine with sglang's own ``/update_weights_from_disk``.

Installed through the ``sglang.srt.plugins`` entry point ``pull_weights =
sglang_patch.plugin:load_plugin``; no sglang file is changed. Layout (arrows = imports):

    plugin ──> server_flags, io_types, scheduler_side, tokenizer_side, http_route   (touch sglang)
                    │             │            │               │
                    └──> paths, request, results, coordinator, pull_process -> rank_pull  (no sglang, unit-tested)
                                         └──> weightsync (the core)

- ``paths``: which directories a request may read/write (``--pull-weights-allowed-roots``).
- ``request``: the request body, parsed strictly (a version is a JSON integer, nothing else).
- ``results``: per-rank reports -> per-host results -> one reply with one error type/status;
  every reply's fields are built there.
- ``coordinator``: the pull runs in a thread with a deadline; all TP ranks of a stage finish it
  at the same scheduler loop iteration via a per-iteration all-reduce, later pipeline stages
  report to stage 0 through a side channel, so nobody blocks the loop or deadlocks; a retry of
  the running pull joins it.
- ``rank_pull``: what one rank does for one pull (path checks, the core's ``pull``, its report).
- ``pull_process``: where that runs: a helper process per rank with the engine's whole CPU set,
  out of reach of the scheduler loop's GIL; a killed helper is a typed failure; ``cancel``
  (called at the deadline).
- ``server_flags``: the CLI flags, carried to every scheduler on ``ServerArgs``.
- ``io_types``: the request/reply IPC messages (pickle and msgpack).
- ``scheduler_side`` / ``tokenizer_side`` / ``http_route``: the few lines that hook sglang.
- ``compat``: the one place that knows how the supported sglang releases (0.5.16 to 0.5.23) differ.
- ``metrics``: the weightsync series on sglang's ``/metrics`` (``--enable-metrics``).
"""
