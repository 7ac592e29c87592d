"""The trainer-side disk-delta weight updater: publish a version, then drive every engine to it.

Role: runs in every trainer rank (a miles/slime Megatron actor). Each sync:

1. gather: every rank joins the TP/EP gathers; one source rank per PP stage stages its HF tensors;
2. publish version v, in three collective steps that every rank runs in the same order:
   *prepare* (each source rank diffs against its snapshot, the previous version's bytes, and all
   ranks agree on delta vs full from the summed sizes), *write* (each source rank writes its
   shards; the all-gather of their manifests is the barrier), *commit* (rank 0 writes the index).
   With ``--update-weight-delta-encoding auto`` a *sample* step comes first: each source rank
   encodes a sample of its tensors both ways, and the all-gather of the samples gives every
   source rank the same sum, hence the same encoding (``weightsync.publisher.encoding_choice``);
3. on rank 0 only, the engines (``engine_sync.EngineSync``): post-write hook -> ``pull_weights(v)``
   everywhere while they generate -> pause -> live apply or reload -> continue. The other ranks
   wait for rank 0's word through the process group's store (``engine_wait.RankZeroWait``), not in
   a collective: rank 0 beats while it drives the engines, and they wait as long as it beats
   (``--update-weight-engine-heartbeat-timeout-s``; ``--update-weight-engine-wait-timeout-s`` caps
   it). No timeout of the training group (or NCCL watchdog) applies, and a wait that gave up
   leaves nothing that fails the next sync.

A failed publish step is retried, from that step, with the same bytes, up to
``--update-weight-publish-attempts`` times: a source rank that wrote keeps its manifest, one that
failed writes again, rank 0 commits again. Every step ends in an all-gather that raises the same
error on every rank, so the ranks always agree on where the version stands. When every attempt
fails, ``update_weights`` raises ``WeightSyncFailed`` on every rank, and the next call finishes
that version first, with the bytes staged for it (intact until the next gather), then publishes
the new weights as the next version, a delta. A version whose index had landed (only pruning or
the hook failed) is counted as published, never written again; one that no rank got past
encoding for left nothing behind, and its number is published with the new weights. The same
rule as ``TorchWeightSync`` and the core's ``Publisher.finish_pending``.

Runs and restarts (``runs``): each run publishes under ``run-<id>/``; version numbers continue
after the newest version of any run in the disk dir, a stable ``run_id`` reopens its dir, the
first version after a restart is full, and old run dirs are removed by ``--update-weight-keep-runs``.

Invariant: a failure on any rank is raised on every rank (no rank is left in a collective).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Sequence

import msgspec
import torch.distributed as dist

from weightsync import Publisher
from weightsync.publisher.encoding_choice import AUTO, merge_samples
from weightsync.format.layout import version_dir

from .args import DiskDeltaConfig, check_engine_wait
from .engine_sync import EngineSync, SyncHistory, SyncMetrics, as_engine_group
from .engine_wait import EngineWaitTimeout, RankZeroWait, connect_store
from .gather import HFWeightGatherer
from .runs import RunStart, plan_run_start, prune_runs, run_dir

log = logging.getLogger(__name__)


def _engine_wait(group, rank: int, token: str, config: DiskDeltaConfig) -> RankZeroWait:
    """The other ranks' wait for rank 0's engine phase, through the default store (no collective:
    a gloo group's timeout would break it for good, and the training group's is too short)."""
    store = connect_store(dist.distributed_c10d._get_default_store())  # noqa: SLF001 - the store every rank reaches
    return RankZeroWait(store, f"weightsync/engine-wait/{token}", rank, dist.get_world_size(group),
                        heartbeat_timeout_s=config.engine_heartbeat_timeout_s, cap_s=config.wait_timeout_s)


class WeightSyncFailed(RuntimeError):
    """A sync step failed on some rank; raised on every rank with that rank's message."""


class PendingVersion(msgspec.Struct):
    """One rank's progress through publishing one version (kept until it is committed)."""

    version: int
    prepared: Any = None  # this source rank's PreparedVersion, until its shards are written
    stats: tuple | None = None  # this rank's sizes, for the agreed choice
    kind: str = ""  # agreed by every rank once the prepare step succeeded everywhere
    sampled: bool = False  # encoding "auto": every rank has the summed samples (so it samples once)
    encoding: str = ""  # encoding "auto": what the source ranks chose from the summed samples
    reason: str = ""
    manifest: Any = None  # this source rank's ShardManifest, once its shards are durable
    attempts: int = 0


class DiskDeltaWeightUpdater:
    """Publishes Megatron weights as versions and brings rollout engines to them (every rank).

    Args:
        config: the validated flags (``validate_update_weight_args``).
        model_chunks: this rank's Megatron model chunks.
        args: the trainer's args namespace (passed to the post-write hook).
        group: a process group spanning every trainer rank (default: the world).
        run_id: names this run's source dir ``run-<id>``; pass the same id on a restart to reopen
            it (default: a fresh id agreed by all ranks).
        converter: a Megatron -> HF converter (``converters.MegatronToHF``) instead of the one
            ``config.converter`` names.
    """

    def __init__(self, config: DiskDeltaConfig, model_chunks, *, args: Any = None, group=None,
                 run_id: str | None = None, converter: Any = None):
        self.config = config
        self.args = args
        self.group = group
        check_engine_wait(config)  # a config built without validate_update_weight_args is checked here too
        self.rank = dist.get_rank(group)
        self.gatherer = HFWeightGatherer(model_chunks, config.hf_checkpoint, group=group, args=args,
                                         converter=converter or config.converter,
                                         static_tensors=config.static_tensors)
        self.plan = self.gatherer.plan
        # The run id, and a token naming this updater's engine-wait keys in the store (unique even
        # when a run id is reopened in the same process group).
        box = [run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.run_id = box[0]
        self._engine_wait = _engine_wait(group, self.rank, box[1], config)
        self.source_dir = run_dir(config.source_dir, self.run_id)
        self.publisher: Publisher | None = None
        if self.plan.is_source:
            self.publisher = Publisher(
                self.source_dir, encoding=config.encoding, checksum=config.checksum,
                rank=self.plan.source_rank, world_size=self.plan.num_sources,
                template_dir=config.hf_checkpoint, full_every=config.full_every,
                link_bytes_per_s=config.link_bytes_per_s,
                fallback_fraction=config.fallback_fraction,
                full_above_changed_fraction=config.full_above_changed_fraction, keep_versions=config.keep_versions,
            )
        self.engine_sync: EngineSync | None = None
        self.version = 0
        self.run_start: RunStart | None = None
        self.history = SyncHistory(config.history_size)  # the newest syncs' metrics, totals of all
        self._pending: PendingVersion | None = None
        self._full_reason: str | None = None  # set: the next version must be full (after a restart)
        self._published_in_run = False
        self._started = False

    # --- set-up ---------------------------------------------------------------------------

    def connect_rollout_engines(self, rollout_engines: Any, names: Sequence[str] | None = None) -> None:
        """Rank 0 drives the engines (Ray actor handles, clients or an EngineGroup)."""
        if self.rank != 0:
            return
        if self.engine_sync is not None:  # reconnecting: release the previous group's threads
            self.engine_sync.close()
        group, owned = as_engine_group(rollout_engines, names, timeouts=self.config.engine_timeouts())
        self.engine_sync = EngineSync(
            group, source_dir=self.source_dir, local_checkpoint_dir=self.config.local_checkpoint_dir,
            pause_mode=self.config.pause_mode, apply_mode=self.config.apply_mode,
            post_write_hook=self.config.post_write_path, hook_args=self.args, rollout_engines=rollout_engines,
            owns_engines=owned,
        )

    def start(self) -> None:
        """Plan the run's numbering, seed the snapshot, start the baseline pulls (collective).

        A first run starts after version 0 and sends ``pull_weights(0)`` to every engine without
        waiting. A restart (this run dir or an earlier one already published up to v K) continues
        at K+1, a full version, which every engine seeds from by itself: no baseline.
        """
        error, plan = None, None
        try:
            if self.rank == 0:
                plan = plan_run_start(self.config.source_dir, self.source_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            log.exception("planning the run start failed")
            error = f"start: {type(e).__name__}: {e}"
        self.run_start = self._all_gather(plan, error)[0]
        self.version = self.run_start.newest_version
        self._full_reason = self.run_start.reason if self.run_start.first_is_full else None
        error = None
        try:
            if self.publisher is not None:
                self.publisher.seed_snapshot_from_checkpoint(
                    self.config.hf_checkpoint, names=set(self.plan.owned), version=self.version)
            if self.rank == 0 and self.engine_sync is not None and not self.run_start.first_is_full:
                self.engine_sync.start_baseline()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            log.exception("start failed")
            error = f"{type(e).__name__}: {e}"
        self._raise_if_any(error, "start")
        self._started = True
        log.info("disk-delta updater ready: run %s, source dir %s, next version v%d (%s), %d source rank(s), "
                 "snapshot %d B on this rank", self.run_id, self.source_dir, self.version + 1,
                 self.run_start.reason, self.plan.num_sources, self.snapshot_nbytes())

    def snapshot_nbytes(self) -> int:
        return self.publisher.snapshot_nbytes() if self.publisher is not None else 0

    # --- a sync ---------------------------------------------------------------------------

    def update_weights(self, *, update_engines: bool = True) -> SyncMetrics:
        """Publish the next version and bring every engine to it (collective; returns metrics).

        With ``update_engines=False`` only the publish happens; ``update_engines_to`` then brings
        the engines to it (also the way to retry the engine part of a sync that failed).

        Raises:
            WeightSyncFailed: on every rank, when a step failed on some rank (after the publish
                attempts); the version stays pending and the next call publishes it first.
        """
        if not self._started:
            self.start()
        if self._pending is not None:
            self._finish_pending()
        version = self.version + 1
        m = SyncMetrics(version=version)
        t_start = time.perf_counter()
        t = time.perf_counter()
        tensors = self.gatherer.gather()  # raises on every rank together
        m.gather_s = time.perf_counter() - t
        m.staging_nbytes = self.gatherer.staging_nbytes()
        t = time.perf_counter()
        self._pending = PendingVersion(version)
        self._publish_pending(tensors, m)
        m.publish_s = time.perf_counter() - t
        m.snapshot_nbytes = self.snapshot_nbytes()
        if update_engines:
            m = self._update_engines(version, m, t_start)
        else:
            m = self._share(m, None, t_start)
        self.history.append(m)
        return m

    def _finish_pending(self) -> None:
        """Publish the version a failed call left pending, with its own staged bytes (before a gather)."""
        p = self._pending
        assert p is not None
        if not p.kind:  # no rank got past prepare: nothing was written, publish it afresh
            self._pending = None
            return
        log.info("finishing v%d, left pending by a failed publish (%d attempt(s) so far)", p.version, p.attempts)
        m = SyncMetrics(version=p.version)
        self._publish_pending(None, m)
        self.history.append(m)

    def _publish_pending(self, tensors: dict | None, m: SyncMetrics) -> None:
        """Run the pending version's remaining steps, retrying; on success the version is published."""
        p = self._pending
        assert p is not None
        attempts = max(1, self.config.publish_attempts)
        delay = self.config.publish_retry_backoff_s
        for attempt in range(1, attempts + 1):
            p.attempts += 1
            try:
                self._publish_steps(p, tensors, m)
                break
            except WeightSyncFailed as e:
                if attempt == attempts:
                    raise WeightSyncFailed(
                        f"publishing v{p.version} failed {attempt} time(s); it stays pending and the next "
                        f"sync publishes it first. Last error: {e}") from None
                log.warning("publishing v%d failed (attempt %d of %d), retrying in %.1fs: %s",
                            p.version, attempt, attempts, delay, e)
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
        m.kind, m.reason, m.publish_attempts = p.kind, p.reason, p.attempts
        m.encoding = (p.encoding or self.config.encoding) if p.kind == "delta" else ""
        self.version = p.version
        self._pending = None
        self._full_reason = None
        if not self._published_in_run:
            self._published_in_run = True
            self._prune_old_runs()

    def _publish_steps(self, p: PendingVersion, tensors: dict | None, m: SyncMetrics) -> None:
        """(sample ->) prepare -> agree on the kind -> write -> barrier -> commit, skipping steps already done."""
        if not p.kind:
            self._choose_encoding(p, tensors)
            error = None
            try:
                if self.publisher is not None and p.prepared is None:
                    # A full version after a restart needs no encoding (it stores the bytes).
                    p.prepared = self.publisher.prepare(
                        p.version, tensors, kind="full" if self._full_reason is not None else None,
                        encoding=p.encoding or None)
                    pr = p.prepared
                    p.stats = (pr.delta_nbytes, pr.full_nbytes, pr.changed_bytes, pr.changed_elements,
                               pr.total_elements, pr.encode_s)
            except Exception as e:  # noqa: BLE001
                log.exception("prepare v%d failed", p.version)
                p.prepared = None
                error = f"prepare: {type(e).__name__}: {e}"
            stats = self._all_gather(p.stats, error)
            totals = [sum(s[i] for s in stats if s) for i in range(5)]
            m.encode_s = max((s[5] for s in stats if s), default=0.0)
            m.full_nbytes, m.changed_bytes, m.changed_elements, m.total_elements = totals[1:5]
            # Same totals everywhere -> the same choice on every rank.
            if self.publisher is not None:
                requested = "full" if self._full_reason is not None else None
                p.kind, p.reason = self.publisher.choose_kind(p.version, totals[0], totals[1], totals[3], totals[4],
                                                              requested=requested)
                p.reason = self._full_reason or p.reason
            else:
                p.kind, p.reason = "pending", ""  # a rank without shards learns the kind at commit
        error = None
        try:
            if self.publisher is not None and p.manifest is None:
                p.manifest = self.publisher.write(p.prepared, p.kind)
                p.prepared = None  # release the compressed payloads before the engines pull
        except Exception as e:  # noqa: BLE001
            log.exception("write v%d failed", p.version)
            error = f"write: {type(e).__name__}: {e}"
        manifests = self._all_gather(p.manifest, error, step="barrier")  # every shard is durable
        m.wire_nbytes = sum(x.nbytes for x in manifests if x)
        error = None
        try:
            if self.rank == 0:
                assert self.publisher is not None  # rank 0 is TP 0, DP 0, PP 0: a source rank
                self.publisher.commit(p.version, p.kind, [x for x in manifests if x])
        except Exception as e:  # noqa: BLE001
            log.exception("commit v%d failed", p.version)
            error = f"commit: {type(e).__name__}: {e}"
        kinds = self._all_gather((p.kind, p.reason) if self.publisher is not None else None, error, step="commit")
        p.kind, p.reason = next(k for k in kinds if k)
        if self.publisher is not None and self.rank != 0:
            self.publisher.confirm(p.version)  # rank 0's commit succeeded: v counts as committed here too

    def _choose_encoding(self, p: PendingVersion, tensors: dict | None) -> None:
        """Encoding "auto" (collective): every source rank samples the tensors it owns, every rank
        gathers the samples, and each source rank takes the choice of their sum (the same sum
        gives the same choice, so the version has one encoding). Once per version: a retry reuses
        it. A full version (after a restart, or on the ``full_every`` schedule) needs none."""
        every = self.config.full_every
        if self.config.encoding != AUTO or p.sampled or self._full_reason is not None or (every and p.version % every == 0):
            return
        sample, error = None, None
        try:
            if self.publisher is not None:
                sample = self.publisher.sample_encodings(p.version, tensors or {})
        except Exception as e:  # noqa: BLE001
            log.exception("sampling v%d's encodings failed", p.version)
            error = f"encoding sample: {type(e).__name__}: {e}"
        samples = self._all_gather(sample, error, step="encoding sample")
        if self.publisher is not None:
            choice = self.publisher.choose_encoding(p.version, merge_samples(s for s in samples if s is not None))
            p.encoding = choice.encoding
        p.sampled = True

    def _first_version_in_dir(self) -> int:
        start = self.run_start
        continues_another_run = start is not None and start.first_is_full and not start.reopened
        return start.newest_version + 1 if continues_another_run else 1

    def _prune_old_runs(self) -> None:
        """After this run's first published version, old run dirs go (rank 0; never fails a sync)."""
        if self.rank != 0:
            return
        # The other ranks may already wait for the engine phase that follows: removing a large run
        # dir can take longer than their heartbeat timeout, so rank 0 beats from here (until the
        # round's finish, whatever comes between).
        self._engine_wait.begin()
        try:
            prune_runs(self.config.source_dir, self.config.keep_runs, self.source_dir)
        except OSError as e:
            log.warning("could not remove old run dirs under %s: %s", self.config.source_dir, e)

    def update_engines_to(self, version: int | None = None) -> SyncMetrics:
        """Bring every engine to an already published version (collective; default: the newest).

        Safe to repeat: a pull whose work is done returns at once, and one interrupted midway
        (a killed process, a torn local checkpoint) is redone from a verified state by the core.
        The other ranks wait for rank 0's word as in a sync: rank 0 must reach this call within
        ``--update-weight-engine-heartbeat-timeout-s`` of them (it beats once it is here).
        """
        version = self.version if version is None else version
        first = self._first_version_in_dir()
        if not first <= version <= self.version:
            raise ValueError(f"v{version} is not a version of this run's source dir {self.source_dir} "
                             f"(it holds v{first}..v{self.version})")
        prior = next((h for h in reversed(self.history) if h.version == version), None)
        m = SyncMetrics(version=version, kind=prior.kind if prior else "", reason="engine update retried")
        return self._update_engines(version, m, time.perf_counter())

    def _update_engines(self, version: int, m: SyncMetrics, t_start: float) -> SyncMetrics:
        error = None
        if self.rank == 0 and self.engine_sync is not None:
            self._engine_wait.begin()  # the others wait as long as rank 0 beats
            try:
                self.engine_sync.update(version, version_dir(self.source_dir, version), m)
            except Exception as e:  # noqa: BLE001
                log.error("engine update to v%d failed: %s", version, e)
                error = f"engines: {e}"
            except BaseException:  # interrupted: stop beating, so the others give up instead of waiting on
                self._engine_wait.abandon()
                raise
        m = self._share(m, error, t_start)
        if self.rank == 0:
            log.info("weight sync %s", m.summary())
        return m

    def _share(self, m: SyncMetrics, error: str | None, t_start: float) -> SyncMetrics:
        """Rank 0's metrics on every rank, and its error raised on all (only rank 0 has a part
        that can fail here: the engines). The others wait as long as rank 0 says it is alive."""
        m.total_s = time.perf_counter() - t_start
        try:
            shared, error = self._engine_wait.finish((m, error) if self.rank == 0 else None)
        except EngineWaitTimeout as e:
            raise WeightSyncFailed(f"waiting for rank 0's engine phase of v{m.version}: {e}") from None
        except RuntimeError as e:  # the store itself failed: rank 0's process (which serves it) is gone
            raise WeightSyncFailed(f"waiting for rank 0's engine phase of v{m.version}: the store failed: {e}") from e
        if error:
            raise WeightSyncFailed(f"rank 0: {error}")
        return shared

    # --- collectives with error propagation ---------------------------------------------------

    def _all_gather(self, value: Any, error: str | None, step: str = "") -> list:
        """Every rank's value; raises ``WeightSyncFailed`` on every rank if any rank had an error.

        A collective that itself fails (a gloo/NCCL timeout, seen by every waiting rank) is a
        ``WeightSyncFailed`` too, so the publish retry treats it like any failed step.
        """
        world = dist.get_world_size(self.group)
        out: list = [None] * world
        try:
            self._gather_objects(out, (value, error), step)
        except RuntimeError as e:
            raise WeightSyncFailed(f"the {step or 'all-gather'} collective failed: {e}") from e
        errors = [(r, e) for r, (_, e) in enumerate(out) if e]
        if errors:
            raise WeightSyncFailed("; ".join(f"rank {r}: {e}" for r, e in errors[:5]))
        return [v for v, _ in out]

    def _gather_objects(self, out: list, obj: Any, step: str) -> None:
        """The one collective of ``_all_gather`` (a seam for fault injection in tests)."""
        dist.all_gather_object(out, obj, group=self.group)

    def _raise_if_any(self, error: str | None, what: str) -> None:
        self._all_gather(None, None if error is None else f"{what}: {error}")

    def close(self) -> None:
        self._engine_wait.close()
        if self.engine_sync is not None:
            self.engine_sync.close()
            self.engine_sync = None
        if self.publisher is not None:
            self.publisher.close()
