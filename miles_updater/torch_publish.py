"""Weight sync from any PyTorch trainer: publish an HF-named module or state dict, drive the engines.

    sync = TorchWeightSync("/shared/weights", "/models/qwen3", local_checkpoint_dir="/local/ckpt",
                           engines=["http://engine-0:30000"])
    for batch in data:
        train_step(model, batch)
        sync.publish(model)       # v1, v2, ...: engines pull while generating, then apply in a pause

For a trainer whose model already carries the checkpoint's names (a transformers model, an FSDP2
full state dict gathered to rank 0, DeepSpeed ZeRO-3 parameters gathered for saving): call
``publish`` on the one process that holds the full tensors. Megatron trainers use
``updater.DiskDeltaWeightUpdater`` instead (it maps names and gathers shards first).

What it shares: run dirs and version numbering with the Megatron updater (``runs``), the
publish itself with the core (``weightsync.Publisher``), and the engine driving with it
(``engine_sync.EngineSync``: pull, pause, live apply or reload, continue). Nothing is copied.

Staging (``StateDictStager``), checked and bounded:
- every name, dtype and shape is checked against ``--hf-checkpoint`` before anything is
  published (a tied alias of a checkpoint tensor, e.g. ``lm_head.weight``, is skipped);
- values are cast to the checkpoint's dtype into host buffers allocated once and reused (pinned
  when the tensors are on CUDA);
- CUDA tensors are compared on the device, bit for bit, with a device-resident snapshot of the
  last staged bytes; only the changed elements (positions and values) cross to the host, and
  only tensors that changed since the last published version are handed to the core;
- any strides a parameter can have (transposed, sliced) are staged: compared in row-major order.
Invariant: the host buffers always equal the device snapshot; a tensor that changed after the
last successful publish is handed to the core until a publish succeeds; the buffers of a stage
that failed midway (``StagingError``) are never handed out: only a later complete stage's are.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Mapping

import numpy as np
import torch

from weightsync import DEFAULT_ENCODING, Publisher, RawTensor
from weightsync.errors import WeightSyncError
from weightsync.format.layout import version_dir

from .engine_sync import APPLY_AUTO, DEFAULT_HISTORY_SIZE, EngineSync, SyncHistory, SyncMetrics, as_engine_group
from .engines import EngineTimeouts
from .gather import ST_TO_TORCH, HFTensorSpec, read_hf_specs
from .runs import RunStart, plan_run_start, prune_runs, run_dir

log = logging.getLogger(__name__)

# Bitwise comparison on the device: the integer type of each element width.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TorchPublishError(ValueError):
    """The tensors do not match the checkpoint (names, dtypes, shapes); names every problem."""

    def __init__(self, problems: list[str], hf_checkpoint: str):
        self.problems = problems
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        super().__init__(f"the tensors do not match --hf-checkpoint {hf_checkpoint}: {shown}. The model must "
                         "carry the checkpoint's names, shapes and a castable dtype (gather sharded tensors first)")


class StagingError(RuntimeError):
    """Staging one tensor failed at run time (after every check passed): the cause, the tensor's
    layout, and that nothing of this stage is handed out until a later ``stage`` succeeds."""

    def __init__(self, name: str, tensor: torch.Tensor, cause: BaseException):
        self.name, self.cause = name, cause
        self.shape, self.stride = tuple(tensor.shape), tuple(tensor.stride())
        self.dtype, self.device = str(tensor.dtype), str(tensor.device)
        super().__init__(
            f"staging {name} (shape {list(self.shape)}, strides {list(self.stride)}, {self.dtype} on {self.device}) "
            f"failed: {type(cause).__name__}: {cause}. Nothing of this stage is handed to a publish; the next "
            f"successful stage re-stages every tensor (stage again once the cause is fixed)")


class StateDictStager:
    """HF-named tensors -> reusable host buffers in the checkpoint's dtypes (see the module doc)."""

    def __init__(self, hf_checkpoint: str, specs: dict[str, HFTensorSpec] | None = None, *,
                 device_compare: bool | None = None):
        self.hf_checkpoint = hf_checkpoint
        # None: compare on the device for CUDA tensors only; True: for every tensor (tests on CPU)
        self.device_compare = device_compare
        self.specs = specs if specs is not None else read_hf_specs(hf_checkpoint)
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}  # CUDA: the last staged values, on the device
        self.dirty: set[str] = set(self.specs)  # changed since the last published version
        self.d2h_nbytes = 0  # bytes the last ``stage`` moved from the device to the host
        self._torn: StagingError | None = None  # set: the last stage failed midway (buffers mix two steps)

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Cast and copy ``tensors`` into the host buffers (device compare: only changed elements cross).

        Every tensor of the checkpoint is staged each time, so a stage that succeeds leaves every
        buffer at this step, whatever an earlier failed stage left behind.

        Raises:
            TorchPublishError: a missing, unexpected or mis-shaped tensor, an uncastable dtype, or a
                layout that holds no plain values (sparse, meta); nothing is staged then.
            StagingError: a copy or compare failed at run time (e.g. out of device memory); the
                buffers are not handed out (``raw_tensors`` raises) until a later stage succeeds.
        """
        named = self._checked(tensors)
        self.d2h_nbytes = 0
        with torch.no_grad():
            for name, t in named.items():
                t = t.detach()
                try:
                    self._stage_one(name, t)
                except Exception as e:  # noqa: BLE001 - typed below; the stager stays consistent
                    # The tensor may be half-copied: forget its device snapshot (the next stage copies
                    # it whole) and keep it dirty; the buffers now mix two steps, so none is handed out.
                    self._device.pop(name, None)
                    self.dirty.add(name)
                    self._torn = StagingError(name, t, e)
                    raise self._torn from e
        self._torn = None

    def _refuse_if_torn(self) -> None:
        if self._torn is not None:
            raise self._torn

    def raw_tensors(self, names=None) -> dict[str, RawTensor]:
        """The staged bytes as RawTensors (views of the host buffers), for ``names`` or all.

        Raises:
            StagingError: the last stage failed midway (its error); stage again first.
        """
        self._refuse_if_torn()
        out = {}
        for name in (self.specs if names is None else names):
            spec, buf = self.specs[name], self._host[name]
            data = buf.view(-1).view(torch.uint8).numpy() if buf.numel() else np.empty(0, np.uint8)
            out[name] = RawTensor(spec.dtype, spec.shape, data)
        return out

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The host buffers as tensors (checkpoint dtypes): the bytes staged last (raises like ``raw_tensors``)."""
        self._refuse_if_torn()
        return dict(self._host)

    def staging_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._host.values())

    # --- helpers ---------------------------------------------------------------------------

    def _checked(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        problems: list[str] = []
        named = {}
        ptrs = {}
        for name, t in tensors.items():
            if name in self.specs:
                named[name] = t
                ptrs[_storage_key(t)] = name
        ptrs.pop(None, None)
        for name, t in tensors.items():
            if name in self.specs:
                continue
            alias = ptrs.get(_storage_key(t))
            if alias is None:
                problems.append(f"{name} is not in the checkpoint")
            # else: a tied alias (lm_head.weight sharing embed_tokens' storage) publishes as its twin
        problems += [f"{name} is missing" for name in sorted(set(self.specs) - set(named))]
        for name, t in named.items():
            spec = self.specs[name]
            dtype = ST_TO_TORCH.get(spec.dtype)
            if dtype is None:
                problems.append(f"{name}: checkpoint dtype {spec.dtype} is not supported")
            elif tuple(t.shape) != spec.shape:
                problems.append(f"{name}: shape {list(t.shape)}, the checkpoint has {list(spec.shape)}")
            elif t.dtype.is_complex or (t.dtype.is_floating_point != dtype.is_floating_point):
                problems.append(f"{name}: dtype {t.dtype} does not cast to the checkpoint's {spec.dtype}")
            elif t.layout != torch.strided or t.is_meta:
                problems.append(f"{name}: a {'meta' if t.is_meta else str(t.layout)} tensor holds no values to "
                                f"publish (materialize it as a dense tensor first)")
        if problems:
            raise TorchPublishError(problems, self.hf_checkpoint)
        return named

    def _stage_one(self, name: str, t: torch.Tensor) -> None:
        """Stage one tensor, of any strides; marks it dirty when its staged bytes change.

        Each step that can fail (casts, the compare, the transfers) runs before the host buffer and
        the device snapshot are written, and the tensor is marked dirty before either is.
        """
        spec = self.specs[name]
        dtype = ST_TO_TORCH[spec.dtype]
        host = self._host.get(name)
        if host is None:
            host = torch.empty(spec.shape, dtype=dtype, pin_memory=t.is_cuda and torch.cuda.is_available())
            self._host[name] = host
        if not (t.is_cuda if self.device_compare is None else self.device_compare):
            self.dirty.add(name)  # the core's diff finds what changed
            host.copy_(t)
            return
        # The snapshot and the flat views need row-major bytes; a transposed or sliced parameter
        # (``.to`` and ``clone`` keep its strides) is made contiguous here, once per stage.
        cur = t.to(dtype).contiguous()
        snap = self._device.get(name)
        if snap is None:  # first stage, or the last one failed on this tensor: copy it whole
            fresh = cur.clone() if cur.data_ptr() == t.data_ptr() else cur  # never alias the parameter
            self.dirty.add(name)
            host.copy_(fresh)
            self._device[name] = fresh
            self.d2h_nbytes += host.numel() * host.element_size()
            return
        bits = _BITS[cur.element_size()]
        flat_cur, flat_snap = cur.view(-1), snap.view(-1)
        changed = torch.nonzero(flat_cur.view(bits) != flat_snap.view(bits)).squeeze(1)
        if changed.numel() == 0:
            return
        values = flat_cur[changed]
        idx_host, values_host = changed.cpu(), values.cpu()
        self.dirty.add(name)
        flat_snap[changed] = values
        host.view(-1)[idx_host] = values_host
        self.d2h_nbytes += idx_host.numel() * idx_host.element_size() + values_host.numel() * values_host.element_size()


def _storage_key(t: torch.Tensor):
    """Where a tensor's values live (None for a sparse or meta tensor: it has no data pointer)."""
    return (t.device, t.data_ptr()) if t.layout == torch.strided and not t.is_meta else None


class TorchWeightSync:
    """Publish versions from a PyTorch model and bring rollout engines to each one.

    Args:
        disk_dir: the shared dir; this run writes ``disk_dir/run-<id>/weight_vNNNNNN/``.
        hf_checkpoint: the local HF checkpoint the engines started from (version 0).
        local_checkpoint_dir: the host-local checkpoint dir on every engine host.
        engines: base URLs, ``SGLangEngineClient``s, Ray engine actor handles or an EngineGroup
            (None: publish only).
        run_id: reopen this run's dir on a restart (default: a fresh run).
        apply_mode, pause_mode: how the pause applies a version (``engine_sync``).
        keep_runs: run dirs kept in ``disk_dir``, this one included (0: all).
        engine_timeout_s, pull_timeout_s, not_ready_retry_s: every engine client's timeouts
            (``engines.EngineTimeouts``; clients and actors passed in are set to them too).
        history_size: the syncs whose own metrics ``history`` keeps (totals cover every sync).
        publish_attempts, retry_backoff_s: retries of one failed publish (the core's publish
            retries a failed write or index write with the same bytes).
        post_write_hook: ``hook(args, version_dir, engines)`` before the pulls.
        publisher_options: passed to ``weightsync.Publisher`` (``full_every``, ``keep_versions``...).
    """

    def __init__(self, disk_dir: str, hf_checkpoint: str, *, local_checkpoint_dir: str | None = None,
                 engines: Any = None, run_id: str | None = None, apply_mode: str = APPLY_AUTO,
                 pause_mode: str = "retract", keep_runs: int = 2, publish_attempts: int = 3,
                 retry_backoff_s: float = 1.0, encoding: str = DEFAULT_ENCODING, post_write_hook=None,
                 engine_timeout_s: float = 120.0, pull_timeout_s: float = 1800.0, not_ready_retry_s: float = 60.0,
                 history_size: int = DEFAULT_HISTORY_SIZE, **publisher_options):
        if engines is not None and not local_checkpoint_dir:
            raise ValueError("engines need local_checkpoint_dir: the host-local checkpoint dir on every engine host")
        self.disk_dir = disk_dir
        self.hf_checkpoint = hf_checkpoint
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.source_dir = run_dir(disk_dir, self.run_id)
        self.keep_runs = keep_runs
        self.publish_attempts = max(1, publish_attempts)
        self.retry_backoff_s = retry_backoff_s
        self.stager = StateDictStager(hf_checkpoint)
        self.publisher = Publisher(self.source_dir, encoding=encoding, template_dir=hf_checkpoint,
                                   **publisher_options)
        self.engine_sync: EngineSync | None = None
        if engines is not None:
            timeouts = EngineTimeouts(engine_timeout_s, pull_timeout_s, not_ready_retry_s)
            group, owned = as_engine_group(engines, timeouts=timeouts)
            self.engine_sync = EngineSync(group, source_dir=self.source_dir, local_checkpoint_dir=local_checkpoint_dir,
                                          pause_mode=pause_mode, apply_mode=apply_mode, post_write_hook=post_write_hook,
                                          rollout_engines=engines, owns_engines=owned)
        self.version = 0
        self.run_start: RunStart | None = None
        self.history = SyncHistory(history_size)  # the newest syncs' metrics, totals of all
        self._full_reason: str | None = None
        self._published_in_run = False
        self._started = False

    def start(self) -> None:
        """Plan the numbering (``runs``), seed the snapshot from the checkpoint, send the baseline."""
        self.run_start = plan_run_start(self.disk_dir, self.source_dir)
        self.version = self.run_start.newest_version
        self._full_reason = self.run_start.reason if self.run_start.first_is_full else None
        self.publisher.seed_snapshot_from_checkpoint(self.hf_checkpoint, version=self.version)
        if self.engine_sync is not None and not self.run_start.first_is_full:
            self.engine_sync.start_baseline()
        self._started = True
        log.info("torch weight sync ready: run %s, next version v%d (%s)", self.run_id, self.version + 1,
                 self.run_start.reason)

    def publish(self, model: "torch.nn.Module | Mapping[str, torch.Tensor]", *,
                update_engines: bool = True) -> SyncMetrics:
        """Publish the model's current weights as the next version, then bring the engines to it.

        After a failed publish of vN, this call first finishes vN with the bytes staged for it
        (or counts vN as published when its index had landed and only a later step, such as
        pruning, failed), then publishes the weights it is given as vN+1, a delta from vN; the
        engines are driven to vN+1 (their pull chains through vN). A publish that failed before
        any shard was written left nothing behind: that number is published with these weights.

        Raises:
            TorchPublishError: the tensors do not match the checkpoint (nothing published).
            WeightSyncError, OSError: every publish attempt failed; the version stays pending and
                the next call finishes it first, as above.
            EngineSyncError: an engine could not pull or apply the version (it is published;
                the error's ``served`` says which version each engine serves now; the next sync,
                or ``update_engines_to``, brings the laggards up first).
        """
        if not self._started:
            self.start()
        self._finish_failed_publish()
        version = self.version + 1
        m = SyncMetrics(version=version)
        t_start = time.perf_counter()
        t = time.perf_counter()
        self.stager.stage(model.state_dict() if isinstance(model, torch.nn.Module) else model)
        m.gather_s = time.perf_counter() - t
        m.staging_nbytes = self.stager.staging_nbytes()
        # Tensors not handed over are carried by the core from its snapshot: only those that
        # changed since the last published version need to be (all of them on the CPU).
        tensors = self.stager.raw_tensors(sorted(self.stager.dirty))
        full = True if self._full_reason is not None else None
        self._publish_with_retries(version, m, lambda: self.publisher.publish(version, tensors, full=full))
        m.d2h_nbytes = self.stager.d2h_nbytes
        if update_engines and self.engine_sync is not None:
            self.update_engines_to(version, m)
        m.total_s = time.perf_counter() - t_start
        log.info("weight sync %s", m.summary())
        return m

    def update_engines_to(self, version: int | None = None, metrics: SyncMetrics | None = None) -> SyncMetrics:
        """Bring every engine to a published version of this run (default: the newest)."""
        if self.engine_sync is None:
            raise ValueError("no engines: pass engines= (and local_checkpoint_dir=) to drive them")
        version = self.version if version is None else version
        m = metrics or SyncMetrics(version=version, reason="engine update retried")
        return self.engine_sync.update(version, version_dir(self.source_dir, version), m)

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The bytes of the last published version (checkpoint dtypes), as host tensors."""
        return self.stager.published_state_dict()

    def close(self) -> None:
        if self.engine_sync is not None:
            self.engine_sync.close()
        self.publisher.close()

    # --- helpers ---------------------------------------------------------------------------

    def _finish_failed_publish(self) -> None:
        """The rule after a failed publish of vN: vN is finished with its staged bytes (the core
        holds them), or counted when its index had landed, before newer weights are published."""
        pub = self.publisher
        if pub.pending_version is not None:
            version, call = pub.pending_version, pub.finish_pending
        elif pub.version > self.version:  # the index landed, a later step (pruning) failed
            version = pub.version
            call = lambda: pub.publish(version, {})  # noqa: E731 - already published: reruns what followed the commit
        else:
            return
        log.info("finishing v%d, left pending by a failed publish, before publishing newer weights", version)
        m = SyncMetrics(version=version)
        # Counting it published clears the stager's dirty set: its buffers hold what was staged for it.
        self._publish_with_retries(version, m, call)

    def _publish_with_retries(self, version: int, m: SyncMetrics, call) -> None:
        """Run ``call`` (one publish of ``version``) until it succeeds, then count the version published."""
        delay = self.retry_backoff_s
        t = time.perf_counter()
        for attempt in range(1, self.publish_attempts + 1):
            m.publish_attempts = attempt
            try:
                result = call()
                break
            except (WeightSyncError, OSError) as e:
                if attempt == self.publish_attempts:
                    raise
                log.warning("publishing v%d failed (attempt %d of %d), retrying in %.1fs: %s",
                            version, attempt, self.publish_attempts, delay, e)
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
        m.publish_s = time.perf_counter() - t
        if result.kind == "full" and self._full_reason is not None and "requested" in result.reason:
            result.reason = self._full_reason
        m.kind, m.reason, m.encode_s, m.encoding = result.kind, result.reason, result.encode_s, result.encoding
        m.wire_nbytes, m.full_nbytes = result.wire_nbytes, result.full_nbytes
        m.changed_bytes, m.changed_elements, m.total_elements = (
            result.changed_bytes, result.changed_elements, result.total_elements)
        m.snapshot_nbytes = self.publisher.snapshot_nbytes()
        self.version = version
        self.stager.dirty.clear()
        self._full_reason = None
        if not self._published_in_run:
            self._published_in_run = True
            self._prune_old_runs()
        self.history.append(m)

    def _prune_old_runs(self) -> None:
        try:
            prune_runs(self.disk_dir, self.keep_runs, self.source_dir)
        except OSError as e:
            log.warning("could not remove old run dirs under %s: %s", self.disk_dir, e)


__all__ = ["TorchWeightSync", "StateDictStager", "StagingError", "TorchPublishError"]
