"""Staging one rank's live update while the engine serves.

``stage_after_pull`` runs in the rank's pull thread once the core verified the local
checkpoint. The rank's pull helper process does the heavy half (``stage.stage_job``: positions,
mapping, the new values), the scheduler thread the engine half in bounded slices between loop
iterations (``patch.finish_staging_steps``: casts, the undo log; from a side thread every torch
call waited for the GIL held by sglang's busy loop, about 9 ms a call here). The undo log starts
as soon as the helper's positions are readable, while the helper still gathers the values.

What it stages from is checked first: the live version must be known, the map proven, the
local checkpoint must hold the pulled version verified, and its chain must extend exactly the
bytes the weights hold (``identity.why_not_base``). Anything else is a refusal with its reason,
and the update reloads.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterator, Optional

import weightsync.puller.positions as positions

from .identity import LiveVersion, from_held, why_not_base
from .loop_slices import LoopSlices, LoopWorkTimeout
from .mapping import scope as live_scope
from .mapping.stage import Patch, StageJob, StageReply
from .proof import MapProof, RunSteps
from .scatter.device import PauseFence, pause_fence_for
from .scatter.patch import StagedUpdate, StagingRefused, finish_staging_steps, reload_only_reasons, undo_log_steps
from .version import LiveWeights

log = logging.getLogger(__name__)

LOOP_STAGING_TIMEOUT_S = 120.0  # the loop runs a slice every iteration; only a stalled loop takes this long

# ``stager(job, positions_ready)``: runs the heavy half of staging; may call
# ``positions_ready(patches)`` once their positions are readable (their values not yet)
Stager = Callable[[StageJob, Callable[[list[Patch]], None]], "tuple[StageReply, list[Patch]]"]


class Staging:
    """Stages ``live -> target`` for one rank (see the module docstring)."""

    def __init__(self, *, rank: str, weights: LiveWeights, proof: MapProof, loop: LoopSlices,
                 model: Callable[[], Any], params: Callable[[], dict], run_steps: RunSteps,
                 max_changed_fraction: float, scope: Optional[live_scope.EngineScope] = None,
                 make_fence: Optional[Callable[[], PauseFence]] = None,
                 prepare_check: Callable[[StagedUpdate], Iterator[None]] = lambda staged: iter(())) -> None:
        self.rank = rank
        self.weights = weights
        self.proof = proof
        self.loop = loop
        self.model = model
        self.params = params
        self.run_steps = run_steps
        self.max_changed_fraction = max_changed_fraction
        self.scope = scope
        # the pause's fence, made with the staging (``device.pause_fence_for``; the glue knows the
        # forward stream)
        self.make_fence = make_fence or (lambda: pause_fence_for(self.params()))
        # the check's part of staging (live.check): what the check after the commit needs, read
        # while serving so that the pause reads no checkpoint file
        self.prepare_check = prepare_check

    def stage_after_pull(self, local_dir: str, source_dir: str, target_version: int, stager: Stager) -> None:
        """Stage ``live -> target`` from the verified local dir; never raises (the pull succeeded)."""
        generation, live = self.weights.begin_staging()
        try:
            staged = self._stage(local_dir, source_dir, target_version, generation, live, stager)
            reason = None
        except StagingRefused as exc:
            staged, reason = None, exc.reason
        except Exception as exc:
            log.exception("live apply %s: staging v%d failed", self.rank, target_version)
            staged, reason = None, f"staging failed: {type(exc).__name__}: {exc}"
        staged = self.weights.finish_staging(generation, staged, reason)
        if staged is not None:
            log.info(
                "live apply %s: staged v%d -> v%d: %d elements of %d tensors (%d B host memory) in %.3fs "
                "(helper %.3fs, engine %.3fs %s)",
                self.rank, staged.from_version, staged.to_version, staged.elements, staged.tensors, staged.nbytes,
                staged.stage_s, staged.helper_s, staged.engine_s, staged.engine_where,
            )
        else:
            log.info("live apply %s: v%d not staged: %s", self.rank, target_version, self.weights.stage_reason)

    def _stage(self, local_dir: str, source_dir: str, target: int, generation: int, live: Optional[LiveVersion],
               stager: Stager) -> StagedUpdate:
        start = time.perf_counter()
        if live is None:
            raise StagingRefused(f"the live version is unknown: {self.weights.live_reason}")
        status = self.proof.status() or (self.scope.why_refused_now(self.model()) if self.scope is not None else None)
        if status is not None:
            raise StagingRefused(status)
        source_real = os.path.realpath(source_dir)
        held = positions.held_version(local_dir)  # the pull that verified it holds the host lock
        if held is None or held.version != target:
            raise StagingRefused(f"the local checkpoint holds {('v%d' % held.version) if held else 'no verified version'}, "
                                 f"not the pulled v{target}")
        why = why_not_base(live, held)  # the chain must extend exactly the bytes the weights hold
        if why is not None:
            raise StagingRefused(why)
        if target <= live.version:
            raise StagingRefused(f"the live version v{live.version} is not below the target v{target}")
        cmap = self.proof.cmap
        assert cmap is not None
        job = StageJob(
            local_checkpoint_dir=local_dir, source_dir=source_dir, from_version=live.version, to_version=target,
            max_elements=int(self.max_changed_fraction * cmap.mapped_elements),
            placements=cmap.placements, unused=sorted(cmap.unused_tensors),
            reload_only=reload_only_reasons(cmap),
        )
        staged = StagedUpdate(live.version, target, source_real, os.path.realpath(local_dir), generation,
                              from_key=live.key(), target=from_held(held, f"live apply from {local_dir}"))
        early: list = []  # the undo log's loop job, started as soon as the positions are readable

        def positions_ready(patches: list[Patch]) -> None:
            # the undo log needs the positions only: the loop takes it while the helper still
            # gathers the values (the loop would otherwise wait for the helper, and then the
            # helper's caller for the loop)
            if self.loop.is_driven:
                early.append((patches, self.loop.submit(undo_log_steps(patches, self.params(), staged))))

        try:
            reply, patches = stager(job, positions_ready)
            if reply.error is not None:
                raise StagingRefused(f"staging failed: {reply.error}")
            if reply.refused is not None:
                raise StagingRefused(reply.refused)
            staged.elements, staged.tensors, staged.helper_s = reply.elements, reply.tensors, reply.stage_s
            saved, where = None, ""
            if early and early[0][0] is patches:
                finished = self.loop.wait(early.pop()[1], timeout_s=LOOP_STAGING_TIMEOUT_S)
                saved, where = finished.result, f"undo log while the helper gathered the values: {finished}; then "
            _, rest = self.run_steps(finish_staging_steps(patches, self.params(), staged, saved), LOOP_STAGING_TIMEOUT_S)
            staged.engine_where = where + rest
            self.run_steps(self.prepare_check(staged), LOOP_STAGING_TIMEOUT_S)
            staged.fence = self.make_fence()  # the pause makes no event either
        except LoopWorkTimeout as exc:
            raise StagingRefused(f"staging did not finish: {exc}") from exc
        finally:
            for _, job_ in early:  # a refusal or a failure: its undo log is not wanted
                self.loop.cancel(job_)
        staged.stage_s = time.perf_counter() - start
        return staged
