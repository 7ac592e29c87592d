"""The trainer-side disk-delta weight updater: publish a version, then drive every engine to it.

Role: runs in every trainer rank (a miles/slime Megatron actor). Each sync:

1. gather: every rank joins the TP/EP gathers; one source rank per PP stage stages its HF tensors;
2. publish version v: every source rank diffs against its snapshot (the previous version's bytes,
   seeded from ``--hf-checkpoint`` at start, not from the gathered values) and writes its shards;
   all ranks agree on delta vs full from the summed sizes; after a barrier rank 0 writes the
   index (the commit point);
3. on rank 0 only, the engines: post-write hook -> ``pull_weights(v)`` on every engine at once
   while they keep generating -> ``pause_generation`` -> ``flush_cache`` (not when pausing in
   place) -> ``update_weights_from_disk(local checkpoint dir, weight_version=v)`` ->
   ``continue_generation`` (always, once paused, even when the reload failed).

At start nothing is published: ``pull_weights(0)`` goes to every engine without waiting, so the
local copy of the seed overlaps the first rollout; the first sync waits for it. Each run
publishes under its own ``run-<id>/`` source dir and starts every engine host from version 0, so
a host's local state from an earlier run is never taken for this run's (the core also refuses
local state recorded for another source dir).

Invariant: a failure on any rank is raised on every rank (no rank is left in a collective).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch.distributed as dist

from weightsync import Publisher
from weightsync.hooks import load_callable
from weightsync.layout import version_dir

from .args import DiskDeltaConfig
from .engines import EngineGroup, RayEngineGroup, ThreadEngineGroup
from .gather import HFWeightGatherer

log = logging.getLogger(__name__)


class WeightSyncFailed(RuntimeError):
    """A sync step failed on some rank; raised on every rank with that rank's message."""


@dataclass
class SyncMetrics:
    """What one sync cost and changed; returned to the caller and logged."""

    version: int
    kind: str = ""
    reason: str = ""
    changed_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    full_nbytes: int = 0
    wire_nbytes: int = 0
    gather_s: float = 0.0
    encode_s: float = 0.0
    publish_s: float = 0.0
    hook_s: float = 0.0
    baseline_wait_s: float = 0.0
    pull_s: float = 0.0
    reload_s: float = 0.0
    total_s: float = 0.0
    staging_nbytes: int = 0
    snapshot_nbytes: int = 0
    pulls: list = field(default_factory=list)

    @property
    def changed_fraction_bytes(self) -> float:
        return self.changed_bytes / self.full_nbytes if self.full_nbytes else 0.0

    @property
    def changed_fraction_elements(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["changed_fraction_bytes"] = self.changed_fraction_bytes
        d["changed_fraction_elements"] = self.changed_fraction_elements
        return d

    def summary(self) -> str:
        return (f"v{self.version} {self.kind} ({self.reason}): changed {self.changed_fraction_bytes:.2%} of bytes, "
                f"{self.changed_fraction_elements:.2%} of elements; wire {self.wire_nbytes} B of {self.full_nbytes} B "
                f"full; gather {self.gather_s:.2f}s encode {self.encode_s:.2f}s publish {self.publish_s:.2f}s "
                f"pull {self.pull_s:.2f}s reload {self.reload_s:.2f}s")


def load_hook(path: str | Callable | None) -> Callable | None:
    return load_callable(path, what="--custom-update-weight-post-write-path", error=ValueError)


class EngineSync:
    """The engine side of a sync, run by one trainer rank (rank 0).

    Args:
        engines: an ``EngineGroup`` (Ray actor handles or HTTP clients).
        source_dir: the run's source dir (holding ``weight_vNNNNNN/``).
        local_checkpoint_dir: the host-local checkpoint dir on every engine host.
        pause_mode: sglang's pause mode; ``in_place`` keeps the KV cache, so no flush.
        post_write_hook: called ``hook(args, version_dir, rollout_engines)`` before the pulls.
        hook_args: the ``args`` passed to the hook; rollout_engines: what the hook gets as engines.
    """

    def __init__(self, engines: EngineGroup, *, source_dir: str, local_checkpoint_dir: str,
                 pause_mode: str = "retract", post_write_hook: str | Callable | None = None,
                 hook_args: Any = None, rollout_engines: Any = None):
        self.engines = engines
        self.source_dir = source_dir
        self.local_checkpoint_dir = local_checkpoint_dir
        self.pause_mode = pause_mode
        self.hook = load_hook(post_write_hook)
        self.hook_args = hook_args
        self.rollout_engines = rollout_engines if rollout_engines is not None else engines
        self._baseline = None
        self.baseline_results: list | None = None

    def start_baseline(self) -> None:
        """Send ``pull_weights(0)`` to every engine without waiting (overlaps the first rollout)."""
        log.info("baseline: asking %d engine(s) to reset their local checkpoint to version 0", len(self.engines.names))
        self._baseline = self.engines.submit("pull_weights", self.local_checkpoint_dir, self.source_dir, 0)

    def finish_baseline(self) -> list | None:
        """Wait for the baseline pulls (raises if any failed); None when none is pending."""
        if self._baseline is None:
            return None
        pending, self._baseline = self._baseline, None
        self.baseline_results = self.engines.wait(pending)
        return self.baseline_results

    def update(self, version: int, version_dir: str, metrics: SyncMetrics) -> SyncMetrics:
        """Hook -> pull everywhere -> pause -> flush -> reload -> continue, timing each part."""
        t0 = time.perf_counter()
        self.finish_baseline()
        metrics.baseline_wait_s = time.perf_counter() - t0
        if self.hook is not None:
            t = time.perf_counter()
            self.hook(self.hook_args, version_dir, self.rollout_engines)
            metrics.hook_s = time.perf_counter() - t
        t = time.perf_counter()
        pulls = self.engines.wait(self.engines.submit(
            "pull_weights", self.local_checkpoint_dir, self.source_dir, version))
        metrics.pull_s = time.perf_counter() - t
        metrics.pulls = [_pull_summary(name, r) for name, r in zip(self.engines.names, pulls)]
        t = time.perf_counter()
        failure: BaseException | None = None
        try:
            self.engines.wait(self.engines.submit("pause_generation", self.pause_mode))
            in_place = self.pause_mode == "in_place"
            if not in_place:
                self.engines.wait(self.engines.submit("flush_cache"))
            self.engines.wait(self.engines.submit(
                "update_weights_from_disk", self.local_checkpoint_dir, str(version), not in_place))
        except BaseException as e:  # noqa: BLE001 - re-raised below, after resuming
            failure = e
        # Resume every engine even after a failed pause or reload: some may have paused, sglang
        # restores the old weights when a reload fails, and a paused engine stalls the rollout.
        try:
            self.engines.wait(self.engines.submit("continue_generation"))
        except BaseException:
            if failure is None:
                raise
            log.exception("continue_generation also failed after: %s", failure)
        if failure is not None:
            raise failure
        metrics.reload_s = time.perf_counter() - t
        return metrics


def _pull_summary(name: str, result: Any) -> dict:
    """One engine's pull reply, reduced to what the metrics need (per-host actions kept)."""
    if not isinstance(result, dict):
        return {"engine": name, "result": result}
    hosts = result.get("hosts") or []
    return {
        "engine": name,
        "applied_version": result.get("applied_version"),
        "seconds": result.get("seconds"),
        "actions": [h.get("action") for h in hosts] or [result.get("action")],
        "nbytes_read": sum(int(h.get("nbytes_read") or 0) for h in hosts) or int(result.get("nbytes_read") or 0),
        "message": result.get("message"),
    }


def as_engine_group(engines: Any, names: Sequence[str] | None = None) -> EngineGroup:
    """Accept an EngineGroup, a list of Ray actor handles, or a list of HTTP clients."""
    if hasattr(engines, "submit") and hasattr(engines, "wait"):
        return engines
    engines = list(engines)
    if engines and all(hasattr(e, "pull_weights") and not hasattr(getattr(e, "pull_weights"), "remote")
                       for e in engines):
        return ThreadEngineGroup(engines)
    return RayEngineGroup(engines, names)


class DiskDeltaWeightUpdater:
    """Publishes Megatron weights as versions and brings rollout engines to them (every rank).

    Args:
        config: the validated flags (``validate_update_weight_args``).
        model_chunks: this rank's Megatron model chunks.
        args: the trainer's args namespace (passed to the post-write hook).
        group: a process group spanning every trainer rank (default: the world).
        run_id: names this run's source subdir (default: a fresh id agreed by all ranks).
    """

    def __init__(self, config: DiskDeltaConfig, model_chunks, *, args: Any = None, group=None,
                 run_id: str | None = None):
        self.config = config
        self.args = args
        self.group = group
        self.rank = dist.get_rank(group)
        self.gatherer = HFWeightGatherer(model_chunks, config.hf_checkpoint, group=group)
        self.plan = self.gatherer.plan
        box = [run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.run_id = box[0]
        self.source_dir = os.path.join(config.source_dir, f"run-{self.run_id}")
        self.publisher: Publisher | None = None
        if self.plan.is_source:
            self.publisher = Publisher(
                self.source_dir, encoding=config.encoding, checksum=config.checksum,
                rank=self.plan.source_rank, world_size=self.plan.num_sources,
                template_dir=config.hf_checkpoint, full_every=config.full_every,
                fallback_fraction=config.fallback_fraction,
                full_above_changed_fraction=config.full_above_changed_fraction, keep_versions=config.keep_versions,
            )
        self.engine_sync: EngineSync | None = None
        self.version = 0
        self.history: list[SyncMetrics] = []
        self._version_dirs: dict[int, str] = {}  # version -> its dir (rank 0 knows it from commit)
        self._started = False

    # --- set-up ---------------------------------------------------------------------------

    def connect_rollout_engines(self, rollout_engines: Any, names: Sequence[str] | None = None) -> None:
        """Rank 0 drives the engines (Ray actor handles, clients or an EngineGroup)."""
        if self.rank != 0:
            return
        self.engine_sync = EngineSync(
            as_engine_group(rollout_engines, names), source_dir=self.source_dir,
            local_checkpoint_dir=self.config.local_checkpoint_dir, pause_mode=self.config.pause_mode,
            post_write_hook=self.config.post_write_path, hook_args=self.args, rollout_engines=rollout_engines,
        )

    def start(self) -> None:
        """Seed the snapshot from ``--hf-checkpoint`` and start the baseline pulls (collective)."""
        error = None
        try:
            if self.publisher is not None:
                self.publisher.seed_snapshot_from_checkpoint(self.config.hf_checkpoint, names=set(self.plan.owned))
            if self.rank == 0 and self.engine_sync is not None:
                self.engine_sync.start_baseline()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            log.exception("start failed")
            error = f"{type(e).__name__}: {e}"
        self._raise_if_any(error, "start")
        self._started = True
        log.info("disk-delta updater ready: run %s, source dir %s, %d source rank(s), snapshot %d B on this rank",
                 self.run_id, self.source_dir, self.plan.num_sources, self.snapshot_nbytes())

    def snapshot_nbytes(self) -> int:
        return self.publisher.snapshot_nbytes() if self.publisher is not None else 0

    # --- a sync ---------------------------------------------------------------------------

    def update_weights(self, *, update_engines: bool = True) -> SyncMetrics:
        """Publish the next version and bring every engine to it (collective; returns metrics).

        With ``update_engines=False`` only the publish happens; ``update_engines_to`` then brings
        the engines to it (also the way to retry the engine part of a sync that failed).
        """
        if not self._started:
            self.start()
        version = self.version + 1
        m = SyncMetrics(version=version)
        t_start = time.perf_counter()
        t = time.perf_counter()
        tensors = self.gatherer.gather()  # raises on every rank together
        m.gather_s = time.perf_counter() - t
        m.staging_nbytes = self.gatherer.staging_nbytes()

        t = time.perf_counter()
        error, prepared = None, None
        try:
            if self.publisher is not None:
                prepared = self.publisher.prepare(version, tensors)
        except Exception as e:  # noqa: BLE001
            log.exception("prepare v%d failed", version)
            error = f"prepare: {type(e).__name__}: {e}"
        stats = self._all_gather(None if prepared is None else (
            prepared.delta_nbytes, prepared.full_nbytes, prepared.changed_bytes, prepared.changed_elements,
            prepared.total_elements, prepared.encode_s), error)
        totals = [sum(s[i] for s in stats if s) for i in range(5)]
        m.encode_s = max((s[5] for s in stats if s), default=0.0)
        m.changed_bytes, m.changed_elements, m.total_elements = totals[2], totals[3], totals[4]
        m.full_nbytes = totals[1]
        # Same totals everywhere -> the same choice on every source rank.
        if self.publisher is not None:
            m.kind, m.reason = self.publisher.choose_kind(version, totals[0], totals[1], totals[3], totals[4])

        error, manifest = None, None
        try:
            if self.publisher is not None:
                manifest = self.publisher.write(prepared, m.kind)
        except Exception as e:  # noqa: BLE001
            log.exception("write v%d failed", version)
            error = f"write: {type(e).__name__}: {e}"
        prepared = None  # release the compressed payloads before the engines pull
        manifests = self._all_gather(manifest, error)  # also the barrier: every shard is durable
        m.wire_nbytes = sum(x.nbytes for x in manifests if x)
        error, vdir = None, None
        try:
            if self.rank == 0:
                vdir = self.publisher.commit(version, m.kind, [x for x in manifests if x])
        except Exception as e:  # noqa: BLE001
            log.exception("commit v%d failed", version)
            error = f"commit: {type(e).__name__}: {e}"
        kinds = self._all_gather((m.kind, m.reason), error)
        m.kind, m.reason = next(k for k in kinds if k and k[0])
        m.publish_s = time.perf_counter() - t
        self.version = version
        m.snapshot_nbytes = self.snapshot_nbytes()

        self._version_dirs[version] = vdir
        if update_engines:
            m = self._update_engines(version, m, t_start)
        else:
            m = self._share(m, None, t_start)
        self.history.append(m)
        return m

    def update_engines_to(self, version: int | None = None) -> SyncMetrics:
        """Bring every engine to an already published version (collective; default: the newest).

        Safe to repeat: a pull whose work is done returns at once, and one interrupted midway
        (a killed process, a torn local checkpoint) is redone from a verified state by the core.
        """
        version = self.version if version is None else version
        if not 0 < version <= self.version:
            raise ValueError(f"version {version} is not published yet (newest: v{self.version})")
        prior = next((h for h in reversed(self.history) if h.version == version), None)
        m = SyncMetrics(version=version, kind=prior.kind if prior else "", reason="engine update retried")
        return self._update_engines(version, m, time.perf_counter())

    def _update_engines(self, version: int, m: SyncMetrics, t_start: float) -> SyncMetrics:
        error = None
        if self.rank == 0 and self.engine_sync is not None:
            vdir = self._version_dirs.get(version) or version_dir(self.source_dir, version)
            try:
                self.engine_sync.update(version, vdir, m)
            except Exception as e:  # noqa: BLE001
                log.error("engine update to v%d failed: %s", version, e)
                error = f"engines: {e}"
        m = self._share(m, error, t_start)
        if self.rank == 0:
            log.info("weight sync %s", m.summary())
        return m

    def _share(self, m: SyncMetrics, error: str | None, t_start: float) -> SyncMetrics:
        """Rank 0's metrics on every rank (and any rank's error raised on all)."""
        m.total_s = time.perf_counter() - t_start
        results = self._all_gather(m if self.rank == 0 else None, error)
        return results[0] if results[0] is not None else m

    # --- collectives with error propagation ---------------------------------------------------

    def _all_gather(self, value: Any, error: str | None) -> list:
        world = dist.get_world_size(self.group)
        out: list = [None] * world
        dist.all_gather_object(out, (value, error), group=self.group)
        errors = [(r, e) for r, (_, e) in enumerate(out) if e]
        if errors:
            raise WeightSyncFailed("; ".join(f"rank {r}: {e}" for r, e in errors[:5]))
        return [v for v, _ in out]

    def _raise_if_any(self, error: str | None, what: str) -> None:
        self._all_gather(None, None if error is None else f"{what}: {error}")

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
