"""Command-line arguments of the disk-delta weight sync, and their validation.

Role: one argparse group a miles or slime trainer adds to its parser, plus one validation
function it calls after parsing. Both spellings RL users know select the path:
miles ``--update-weight-transfer-mode disk-delta`` and slime
``--update-weight-mode delta --update-weight-transport disk``.

Invariants:
- Adding the group never clashes with flags the host trainer already defines (``--hf-checkpoint``,
  ``--colocate``...): an option string already on the parser is left to its owner.
- ``validate_update_weight_args`` refuses a configuration that cannot work before any rank
  touches a GPU or a file, with a message that says which flag to change and how.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ENCODINGS = ("sparse-v1", "sparse-v2", "auto", "xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
PAUSE_MODES = ("retract", "abort", "in_place")
APPLY_MODES = ("auto", "live", "reload")  # the same registry as engine_sync.APPLY_MODES (a test pins it)
TRANSFER_MODE_DISK_DELTA = "disk-delta"


class UpdateWeightArgsError(ValueError):
    """A weight-sync flag combination that cannot work; the message names the fix."""


@dataclass(frozen=True)
class DiskDeltaConfig:
    """The validated settings the updater runs with (one object instead of loose args)."""

    source_dir: str
    local_checkpoint_dir: str
    hf_checkpoint: str
    encoding: str = "sparse-v1"
    link_bytes_per_s: float | None = None  # encoding "auto": one engine's share of the link (bytes/s)
    checksum: str = "xxh3-128"
    full_every: int = 0
    fallback_fraction: float = 0.5
    full_above_changed_fraction: float = 0.5
    keep_versions: int | None = None
    keep_runs: int = 2
    publish_attempts: int = 3
    publish_retry_backoff_s: float = 1.0
    post_write_path: str | None = None
    pause_mode: str = "retract"
    apply_mode: str = "auto"
    engine_timeout_s: float = 120.0
    pull_timeout_s: float = 1800.0
    not_ready_retry_s: float = 60.0
    engine_wait_timeout_s: float | None = None  # None: no cap, the others wait while rank 0's heartbeat is fresh
    engine_heartbeat_timeout_s: float = 60.0  # the others give up after this long without a beat from rank 0
    history_size: int = 100  # the syncs whose own metrics every rank keeps (SyncHistory; totals cover all)
    converter: str = "builtin"  # builtin | trainer | pkg.mod.fn (miles_updater.converters)
    static_tensors: tuple[str, ...] = ()  # checkpoint tensors (fnmatch patterns) published with the seed's bytes

    @property
    def wait_timeout_s(self) -> float | None:
        """The cap on how long the ranks other than rank 0 wait for its engine phase (None: none;
        they wait while rank 0's heartbeat says it is alive, see ``updater``)."""
        return self.engine_wait_timeout_s

    def engine_timeouts(self):
        """The timeouts every engine client takes (``engines.EngineTimeouts``)."""
        from .engines import EngineTimeouts

        return EngineTimeouts(self.engine_timeout_s, self.pull_timeout_s, self.not_ready_retry_s)


def engine_phase_bound_s(config: "DiskDeltaConfig") -> float:
    """The longest rank 0's engine phase can last under the configured timeouts (the hook aside),
    counted from every call the phase can make (``engine_sync.engine_phase_bound_s``)."""
    from .engine_sync import engine_phase_bound_s as bound_of_timeouts

    return bound_of_timeouts(config.engine_timeouts())


def check_engine_wait(config: "DiskDeltaConfig") -> None:
    """Refuse a wait for rank 0's engine phase that the phase can outlast (at start-up)."""
    wait = config.engine_wait_timeout_s
    bound = engine_phase_bound_s(config)
    if wait is not None and not wait >= bound:
        raise UpdateWeightArgsError(
            f"--update-weight-engine-wait-timeout-s {wait:g} is shorter than rank 0's engine phase can last: "
            f"3 pulls (the baseline, the catch-up of lagging engines, the pull), each up to max("
            f"--update-weight-not-ready-retry-s {config.not_ready_retry_s:g}, --update-weight-pull-timeout-s "
            f"{config.pull_timeout_s:g}) + --update-weight-pull-timeout-s {config.pull_timeout_s:g}, and 10 engine "
            f"calls (pause, live apply, reload, /model_info, continue, twice), each up to "
            f"--update-weight-engine-timeout-s {config.engine_timeout_s:g}: {bound:g} s; the other ranks would give "
            f"up on a sync the engines complete. Raise --update-weight-engine-wait-timeout-s to at least {bound:g} "
            f"(or drop it: by default they wait as long as rank 0 is alive), or lower the timeouts.")


def _add(group, parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    # A host trainer (miles/slime) may already own this flag; its definition wins.
    if flag in parser._option_string_actions:  # noqa: SLF001 - argparse has no public lookup
        return
    group.add_argument(flag, **kwargs)


def add_update_weight_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the disk-delta weight-sync flags to ``parser`` (skipping any it already has)."""
    g = parser.add_argument_group("weight sync over a shared filesystem (disk-delta)")
    _add(g, parser, "--update-weight-transfer-mode", type=str, default=None,
         help="miles spelling: 'disk-delta' publishes each update as a version dir on "
              "--update-weight-disk-dir and engines pull it to a host-local checkpoint.")
    _add(g, parser, "--update-weight-mode", type=str, default=None, choices=("full", "delta"),
         help="slime spelling: 'delta' (with --update-weight-transport disk) selects disk-delta.")
    _add(g, parser, "--update-weight-transport", type=str, default=None,
         help="slime spelling: 'disk' for the shared-filesystem path (the only one delta supports).")
    _add(g, parser, "--update-weight-disk-dir", type=str, default=None,
         help="Shared source dir every engine host can read; version dirs weight_vNNNNNN/ go here. "
              "A bucket URL (s3://bucket/prefix, gs://, az://) works the same; credentials from the environment.")
    _add(g, parser, "--update-weight-local-checkpoint-dir", type=str, default=None,
         help="Host-local dir on each engine host that holds the engine's current checkpoint.")
    _add(g, parser, "--update-weight-delta-encoding", type=str, default="sparse-v1", choices=ENCODINGS,
         help="How changed bytes are encoded in a delta version: sparse-v1 (default); sparse-v2 (about 0.69x "
              "the bytes for a slower pull, and engines reload those versions instead of applying them live); "
              "auto: sparse-v1 or sparse-v2 per version, whichever costs an engine less time given "
              "--update-weight-link-bytes-per-s; xor/overwrite for upstream readers.")
    _add(g, parser, "--update-weight-link-bytes-per-s", type=float, default=None,
         help="For --update-weight-delta-encoding auto: the bytes per second one engine host gets from "
              "--update-weight-disk-dir (its share of the link), e.g. 31e6 for 40 engines behind 10 Gb/s.")
    _add(g, parser, "--update-weight-delta-checksum", type=str, default="xxh3-128", choices=CHECKSUMS,
         help="Checksum recorded per tensor and verified by every pull.")
    _add(g, parser, "--update-weight-full-every", type=int, default=0,
         help="Publish a full version every N versions (0: only when a delta would be too large).")
    _add(g, parser, "--update-weight-fallback-fraction", type=float, default=0.5,
         help="Publish a full version when the delta exceeds this fraction of a full one.")
    _add(g, parser, "--update-weight-full-above-changed-fraction", type=float, default=0.5,
         help="Publish a full version when more than this fraction of the elements changed "
              "(a dense step is cheaper to copy than to apply).")
    _add(g, parser, "--update-weight-keep-versions", type=int, default=None,
         help="The newest N versions the core's pruning never removes (after each publish it prunes what no "
              "cheap pull needs; default: the WEIGHTSYNC_KEEP_VERSIONS knob).")
    _add(g, parser, "--update-weight-keep-runs", type=int, default=2,
         help="Run dirs (run-<id>/) kept in --update-weight-disk-dir, this run included, ordered by their "
              "newest version; older ones are removed once this run has published its first version "
              "(0: keep all).")
    _add(g, parser, "--update-weight-publish-attempts", type=int, default=3,
         help="Attempts at publishing one version (a failed step is retried from that step, with the same "
              "bytes, on every rank); after the last one the sync fails and the next sync publishes it first.")
    _add(g, parser, "--update-weight-publish-retry-backoff-s", type=float, default=1.0,
         help="Wait before the first publish retry (doubling after each).")
    _add(g, parser, "--update-weight-pause-mode", type=str, default="retract", choices=PAUSE_MODES,
         help="sglang pause_generation mode during the reload; 'in_place' keeps the KV cache "
              "(no flush_cache).")
    _add(g, parser, "--update-weight-apply", type=str, default="auto", choices=APPLY_MODES,
         help="How a pulled version reaches the engine's weights in the pause: 'auto' applies the changed "
              "elements live (/update_weights_from_pulled; the engine reloads by itself when it cannot, "
              "and an engine without the route is reloaded), 'live' the same but tried on every sync, "
              "'reload' always /update_weights_from_disk.")
    _add(g, parser, "--update-weight-engine-timeout-s", type=float, default=120.0,
         help="HTTP timeout of pause/flush/reload/continue calls to an engine.")
    _add(g, parser, "--update-weight-pull-timeout-s", type=float, default=1800.0,
         help="HTTP timeout of one /pull_weights call.")
    _add(g, parser, "--update-weight-not-ready-retry-s", type=float, default=60.0,
         help="How long to retry an engine answering 'source not ready' (HTTP 404) with backoff.")
    _add(g, parser, "--update-weight-engine-wait-timeout-s", type=float, default=None,
         help="A cap on how long the trainer ranks other than rank 0 wait while rank 0 drives the engines. "
              "Default: none, they wait as long as rank 0's heartbeat says it is alive (the training group's "
              "collective timeout does not apply). A cap shorter than the engine phase can last (3 pulls and "
              "10 engine calls at their timeouts) is refused.")
    _add(g, parser, "--update-weight-engine-heartbeat-timeout-s", type=float, default=60.0,
         help="The ranks other than rank 0 give up on a sync when rank 0 has not said it is alive for this long "
              "(it beats every second while it drives the engines).")
    _add(g, parser, "--update-weight-history-size", type=int, default=100,
         help="The syncs whose own metrics every rank keeps (the newest N); totals cover every sync.")
    _add(g, parser, "--update-weight-converter", type=str, default="builtin",
         help="Megatron -> HF conversion after the gather: 'builtin' (Qwen2/3, Qwen3-MoE, Llama, GLM-4.5 MoE, "
              "DeepSeek-V3 MLA names), 'trainer' (miles' or slime's own convert_to_hf, whichever is importable), "
              "or 'pkg.mod.fn' called as fn(args) returning a converter (name, full tensor) -> [(hf_name, tensor)].")
    _add(g, parser, "--update-weight-static-tensors", type=str, nargs="*", default=None,
         help="Checkpoint tensors the trainer does not train (names or fnmatch patterns, e.g. 'model.visual.*'): "
              "every version carries the seed's bytes for them, logged at start-up.")
    _add(g, parser, "--custom-update-weight-post-write-path", type=str, default=None,
         help="Import path 'pkg.mod.fn' called as fn(args, version_dir, rollout_engines) after a "
              "version is published and before engines pull it (e.g. to flush a cache tier).")
    _add(g, parser, "--hf-checkpoint", type=str, default=None,
         help="Local HF checkpoint dir the run starts from (the bytes of version 0).")
    _add(g, parser, "--colocate", action="store_true", default=False,
         help="Trainer and engines share GPUs.")
    return parser


def is_disk_delta(args: argparse.Namespace) -> bool:
    """Whether the flags select the disk-delta path (either spelling)."""
    return (getattr(args, "update_weight_transfer_mode", None) == TRANSFER_MODE_DISK_DELTA
            or getattr(args, "update_weight_mode", None) == "delta")


def validate_update_weight_args(args: argparse.Namespace) -> DiskDeltaConfig | None:
    """Check the weight-sync flags; return the config, or None when disk-delta is not selected.

    Raises:
        UpdateWeightArgsError: the combination cannot work; the message names the flag to change.
    """
    if not is_disk_delta(args):
        return None
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    transport = g("update_weight_transport")
    if g("update_weight_mode") == "delta" and transport != "disk":
        raise UpdateWeightArgsError(
            f"--update-weight-mode delta needs --update-weight-transport disk, got "
            f"--update-weight-transport {transport!r}: deltas travel only through the shared "
            f"filesystem. Add '--update-weight-transport disk' or drop '--update-weight-mode delta'.")
    mode = g("update_weight_transfer_mode")
    if mode is not None and mode != TRANSFER_MODE_DISK_DELTA:
        raise UpdateWeightArgsError(
            f"--update-weight-mode delta conflicts with --update-weight-transfer-mode {mode!r}; "
            f"use '--update-weight-transfer-mode disk-delta' or drop one of the two.")
    if transport is not None and transport != "disk":
        raise UpdateWeightArgsError(
            f"--update-weight-transfer-mode disk-delta conflicts with --update-weight-transport "
            f"{transport!r}; use '--update-weight-transport disk' or drop it.")
    if g("colocate", False):
        raise UpdateWeightArgsError(
            "disk-delta weight sync does not support --colocate: colocated engines share the "
            "trainer's GPUs and get weights through CUDA IPC, not files. Drop --colocate (separate "
            "rollout GPUs) or drop the disk-delta flags.")
    source_dir = g("update_weight_disk_dir")
    if not source_dir:
        raise UpdateWeightArgsError(
            "disk-delta needs --update-weight-disk-dir: a shared directory the trainer writes "
            "versions to and every engine host can read (e.g. an NFS or Lustre path).")
    if "://" in source_dir:
        # A bucket (s3://, gs://, az://): the same layout; credentials and endpoint come from
        # the environment only. A URL that names more than a bucket and a prefix is refused here.
        from weightsync.errors import WeightSyncError
        from weightsync.storage.url import parse_bucket_url

        try:
            source_dir = str(parse_bucket_url(source_dir))
        except WeightSyncError as e:
            raise UpdateWeightArgsError(f"--update-weight-disk-dir {source_dir!r}: {e}") from None
    local_dir = g("update_weight_local_checkpoint_dir")
    if not local_dir:
        raise UpdateWeightArgsError(
            "disk-delta needs --update-weight-local-checkpoint-dir: a host-local directory on each "
            "engine host (e.g. /tmp/weight_sync/ckpt) where the engine's checkpoint is kept current.")
    hf = g("hf_checkpoint")
    if not hf:
        raise UpdateWeightArgsError(
            "disk-delta needs --hf-checkpoint: the local HF checkpoint dir of the starting weights "
            "(version 0 of every delta chain).")
    if not os.path.isdir(hf):
        raise UpdateWeightArgsError(
            f"--hf-checkpoint {hf!r} is not a local directory; disk-delta seeds every engine host "
            f"from its files. Download it first (e.g. 'huggingface-cli download {hf} --local-dir "
            f"/data/models/NAME') and pass that directory.")
    if _same_path(hf, local_dir):
        raise UpdateWeightArgsError(
            f"--update-weight-local-checkpoint-dir {local_dir!r} is the --hf-checkpoint dir; pulls "
            f"rewrite the local checkpoint in place and would destroy the seed. Pick another dir.")
    if _same_path(source_dir, local_dir) or _same_path(source_dir, hf):
        raise UpdateWeightArgsError(
            f"--update-weight-disk-dir {source_dir!r} must differ from --hf-checkpoint and from "
            f"--update-weight-local-checkpoint-dir.")
    full_every = int(g("update_weight_full_every", 0) or 0)
    if full_every < 0:
        raise UpdateWeightArgsError(f"--update-weight-full-every must be >= 0, got {full_every}.")
    fallback = float(g("update_weight_fallback_fraction", 0.5))
    if not 0.0 <= fallback <= 1.0:
        raise UpdateWeightArgsError(
            f"--update-weight-fallback-fraction must be in [0, 1], got {fallback}.")
    dense = float(g("update_weight_full_above_changed_fraction", 0.5))
    if not 0.0 <= dense <= 1.0:
        raise UpdateWeightArgsError(
            f"--update-weight-full-above-changed-fraction must be in [0, 1], got {dense}.")
    keep = g("update_weight_keep_versions")
    if keep is not None and int(keep) < 0:
        raise UpdateWeightArgsError(
            f"--update-weight-keep-versions must be >= 0 (the newest N versions the core never prunes), "
            f"got {keep}.")
    keep_runs = int(g("update_weight_keep_runs", 2))
    if keep_runs < 0:
        raise UpdateWeightArgsError(
            f"--update-weight-keep-runs must be >= 0 (run dirs kept, this run included; 0 keeps all), got {keep_runs}.")
    attempts = int(g("update_weight_publish_attempts", 3))
    if attempts < 1:
        raise UpdateWeightArgsError(f"--update-weight-publish-attempts must be >= 1, got {attempts}.")
    backoff = float(g("update_weight_publish_retry_backoff_s", 1.0))
    if backoff < 0:
        raise UpdateWeightArgsError(f"--update-weight-publish-retry-backoff-s must be >= 0, got {backoff}.")
    encoding = g("update_weight_delta_encoding", "sparse-v1")
    link = g("update_weight_link_bytes_per_s")
    if encoding == "auto" and (link is None or not float(link) > 0 or float(link) == float("inf")):
        raise UpdateWeightArgsError(
            f"--update-weight-delta-encoding auto needs --update-weight-link-bytes-per-s > 0 (the bytes per second "
            f"one engine host gets from the shared dir; it trades wire time against apply time), got {link!r}.")
    timeouts = {}
    for flag, name, default in (("--update-weight-engine-timeout-s", "update_weight_engine_timeout_s", 120.0),
                                ("--update-weight-pull-timeout-s", "update_weight_pull_timeout_s", 1800.0),
                                ("--update-weight-not-ready-retry-s", "update_weight_not_ready_retry_s", 60.0)):
        value, zero_ok = float(g(name, default)), name == "update_weight_not_ready_retry_s"
        if not (0 <= value < float("inf")) or (value == 0 and not zero_ok):
            raise UpdateWeightArgsError(
                f"{flag} must be a finite number of seconds {'>=' if zero_ok else '>'} 0, got {value:g}.")
        timeouts[name] = value
    wait = g("update_weight_engine_wait_timeout_s")
    heartbeat = float(g("update_weight_engine_heartbeat_timeout_s", 60.0))
    if not 0 < heartbeat < float("inf"):
        raise UpdateWeightArgsError(
            f"--update-weight-engine-heartbeat-timeout-s must be a finite number of seconds > 0, got {heartbeat:g}.")
    history_size = int(g("update_weight_history_size", 100))
    if history_size < 1:
        raise UpdateWeightArgsError(f"--update-weight-history-size must be >= 1, got {history_size}.")
    post = g("custom_update_weight_post_write_path")
    converter = g("update_weight_converter", "builtin") or "builtin"
    if converter not in ("builtin", "trainer") and "." not in converter:
        raise UpdateWeightArgsError(
            f"--update-weight-converter {converter!r} is not 'builtin', 'trainer' or an import path "
            f"'package.module.function'.")
    if post is not None and "." not in post:
        raise UpdateWeightArgsError(
            f"--custom-update-weight-post-write-path {post!r} is not an import path; expected "
            f"'package.module.function'.")
    config = DiskDeltaConfig(
        source_dir=source_dir,
        local_checkpoint_dir=local_dir,
        hf_checkpoint=hf,
        encoding=encoding,
        link_bytes_per_s=None if link is None else float(link),
        checksum=g("update_weight_delta_checksum", "xxh3-128"),
        full_every=full_every,
        fallback_fraction=fallback,
        full_above_changed_fraction=dense,
        keep_versions=None if keep is None else int(keep),
        keep_runs=keep_runs,
        publish_attempts=attempts,
        publish_retry_backoff_s=backoff,
        post_write_path=post,
        converter=converter,
        static_tensors=tuple(g("update_weight_static_tensors") or ()),
        pause_mode=g("update_weight_pause_mode", "retract"),
        apply_mode=g("update_weight_apply", "auto"),
        engine_timeout_s=timeouts["update_weight_engine_timeout_s"],
        pull_timeout_s=timeouts["update_weight_pull_timeout_s"],
        not_ready_retry_s=timeouts["update_weight_not_ready_retry_s"],
        engine_wait_timeout_s=None if wait is None else float(wait),
        engine_heartbeat_timeout_s=heartbeat,
        history_size=history_size,
    )
    check_engine_wait(config)
    return config


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
