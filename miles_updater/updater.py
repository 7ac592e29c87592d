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
from typing import Any, Sequence

import torch.distributed as dist

from weightsync import Publisher
from weightsync.layout import version_dir

from .args import DiskDeltaConfig
from .engine_sync import EngineSync, SyncMetrics, as_engine_group
from .gather import HFWeightGatherer

log = logging.getLogger(__name__)


class WeightSyncFailed(RuntimeError):
    """A sync step failed on some rank; raised on every rank with that rank's message."""


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
        if self.engine_sync is not None:  # reconnecting: release the previous group's threads
            self.engine_sync.close()
        group, owned = as_engine_group(rollout_engines, names)
        self.engine_sync = EngineSync(
            group, source_dir=self.source_dir, local_checkpoint_dir=self.config.local_checkpoint_dir,
            pause_mode=self.config.pause_mode, apply_mode=self.config.apply_mode,
            post_write_hook=self.config.post_write_path, hook_args=self.args, rollout_engines=rollout_engines,
            owns_engines=owned,
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
        if self.engine_sync is not None:
            self.engine_sync.close()
            self.engine_sync = None
        if self.publisher is not None:
            self.publisher.close()
