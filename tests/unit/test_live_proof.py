"""The proof of a rank's map against a local checkpoint (``sglang_patch.live.state.LiveApplyState.prove``).

After a reload that voided the start-up proof, the map is proven against the reloaded local
checkpoint on a thread while the engine serves, and a pull may rewrite that dir meanwhile. The
proof must then count for nothing: recording it would make every parameter whose bytes the pull
changed reload-only for the rest of the engine's life. A real core pull (tiny Qwen3 checkpoint,
published chain), a torch-only model, no sglang.
"""

from __future__ import annotations

import os


import pytest
import torch
from live_support import serve_from_local, tiny_chain_pulled_at_v1


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``state()``: the engine reloaded from ``local`` (at the version it holds then), its map built, not proven."""
    chain = tiny_chain_pulled_at_v1(tmp_path_factory.mktemp("live_proof"))

    def state():
        return serve_from_local(chain.local, chain.model_dir, f"reload from {chain.local} (marker)")[0]

    chain.state = state
    return chain


def test_a_proof_against_the_reloaded_local_checkpoint_proves_every_parameter(served):
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    state = served.state()
    state.proof.prove(CheckpointReader(served.local), state.live, checkpoint_dir=served.local)
    assert state.cmap.proven and not state.cmap.reload_only_params
    assert len(state.cmap.proven_params) == len(list(state.model.parameters()))


def test_a_pull_of_the_checkpoint_a_proof_is_reading_waits_for_the_proof_to_finish(served):
    import threading
    import time

    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    state = served.state()
    reader = CheckpointReader(served.local)
    read = reader.tensor
    events: list = []

    def pull_in_background():
        served.pull(served.local, served.model_dir, served.feed.source_dir, 2)
        events.append(("pulled", time.monotonic()))

    puller = threading.Thread(target=pull_in_background)

    def tensor_while_a_pull_starts(name):
        if not puller.is_alive() and not events:  # the next version's pull starts while the proof reads
            puller.start()
            time.sleep(0.5)  # time enough for an unguarded pull to rewrite the dir
        return read(name)

    reader.tensor = tensor_while_a_pull_starts
    state.proof.prove(reader, state.live, checkpoint_dir=served.local)
    proof_done = time.monotonic()
    puller.join(timeout=120)
    assert events and events[0][1] >= proof_done, "the pull rewrote the dir while the proof read it"
    assert state.cmap.proven and not state.cmap.reload_only_params, state.cmap.proof_reason


def test_a_proof_against_a_checkpoint_rewritten_meanwhile_by_anyone_records_nothing(served):
    # a writer that ignores the host lock (an operator's copy): the proof's end check catches it
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from weightsync.format.layout import state_path

    state = served.state()
    reader = CheckpointReader(served.local)
    read = reader.tensor
    touched = []

    def tensor_while_the_marker_changes(name):
        if not touched:
            touched.append(True)
            os.unlink(state_path(served.local))  # the dir no longer names the proven version
        return read(name)

    reader.tensor = tensor_while_the_marker_changes
    with open(state_path(served.local), "rb") as f:
        marker = f.read()
    try:
        state.proof.prove(reader, state.live, checkpoint_dir=served.local)
    finally:
        with open(state_path(served.local), "wb") as f:  # the module's other tests use the dir
            f.write(marker)
    assert touched, "the proof never read the checkpoint"
    assert not state.cmap.proven and not state.cmap.reload_only_params and not state.cmap.proven_params


def test_a_proof_holds_the_pull_lock_at_most_half_of_a_pulls_wait_for_it(monkeypatch):
    from sglang_patch.live import proof

    monkeypatch.setenv("WEIGHTSYNC_LOCK_TIMEOUT_S", "600")
    assert proof.proof_lock_hold_s() == 300.0 < proof.LOOP_PROOF_TIMEOUT_S
    monkeypatch.setenv("WEIGHTSYNC_LOCK_TIMEOUT_S", "30")
    assert proof.proof_lock_hold_s() == 15.0


def test_the_proofs_hold_of_the_pull_lock_ends_at_the_first_step_past_its_limit_and_the_steps_run_on(tmp_path):
    from sglang_patch.live.proof import BoundedPullLockHold
    from weightsync.puller.lock import acquire_host_lock

    now = [0.0]
    hold = BoundedPullLockHold(str(tmp_path), 10.0, clock=lambda: now[0])

    def pull_gets_the_lock() -> bool:
        held = acquire_host_lock(str(tmp_path), timeout_s=0)  # one try
        held.release()
        return True

    ran = []

    def steps():
        for k in range(4):
            ran.append(k)
            yield
        return "proven"

    bounded = hold.bound(steps())
    next(bounded)
    with pytest.raises(Exception, match="lock"):
        pull_gets_the_lock()  # within the limit: a pull waits
    now[0] = 10.0
    next(bounded)  # the first step boundary past the limit releases it
    assert hold.released_early and pull_gets_the_lock()
    with pytest.raises(StopIteration) as done:
        while True:
            next(bounded)
    assert done.value.value == "proven" and ran == [0, 1, 2, 3]
    hold.release()  # the proof's end: idempotent


def test_a_pull_during_a_proof_past_its_lock_hold_gets_the_lock_and_the_proof_it_overtook_records_nothing(
        tmp_path, monkeypatch):
    """A proof that outlives its hold of the host's pull lock (a large model) lets a pull in
    rather than making it time out; the pull's new bytes then void the proof (its end check)."""
    import threading

    from sglang_patch.live import proof
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from weightsync.puller.positions import held_version

    chain = tiny_chain_pulled_at_v1(tmp_path)
    state = serve_from_local(chain.local, chain.model_dir, f"reload from {chain.local} (marker)")[0]
    monkeypatch.setattr(proof, "proof_lock_hold_s", lambda: 0.0)  # the hold is spent before the first step
    monkeypatch.setenv("WEIGHTSYNC_LOCK_TIMEOUT_S", "60")  # the pull's own wait: far above this test's run
    reader = CheckpointReader(chain.local)
    read = reader.tensor
    pulled, failures = threading.Event(), []

    def pull():
        try:
            chain.pull(chain.local, chain.model_dir, chain.feed.source_dir, 2)
        except Exception as exc:  # a LockTimeoutError, had the proof kept the lock
            failures.append(exc)
        pulled.set()

    def tensor_while_a_pull_runs(name):
        if not pulled.is_set():
            threading.Thread(target=pull).start()
            assert pulled.wait(60), "the pull did not finish while the proof ran"
        return read(name)

    reader.tensor = tensor_while_a_pull_runs
    state.proof.prove(reader, state.live, checkpoint_dir=chain.local)
    assert pulled.is_set() and not failures, failures
    assert held_version(chain.local).version == 2
    assert not state.cmap.proven and not state.cmap.reload_only_params and not state.cmap.proven_params


def test_a_map_built_after_a_reload_from_a_local_checkpoint_is_proven_against_that_dir(served):
    state = served.state()  # the reload landed before the map thread finished building
    state.proof.cmap = None
    state.proof.build_and_prove()
    assert state.proof.map_error is None and state.proof.status() is None, state.cmap.proof_reason
    assert not state.cmap.reload_only_params


def _staging_state(served):
    """A proven rank whose live weights are taken to be v1 while the local dir holds v2."""
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from sglang_patch.live.identity import LiveVersion
    from weightsync.puller.positions import held_version

    served.pull(served.local, served.model_dir, served.feed.source_dir, 2)
    state = served.state()
    state.proof.prove(CheckpointReader(served.local), state.live, checkpoint_dir=served.local)
    assert state.cmap.proven
    held = held_version(served.local)  # v2 of the same run and seed: the weights are taken to be its v1
    state.weights.live = LiveVersion(1, os.path.realpath(served.feed.source_dir), "test: serving v1", held.run, held.seed)
    return state


def _stage_with_a_scheduler_loop(state, served, stager) -> None:
    """Stage v2 while another thread drives the loop, as sglang's scheduler thread does."""
    import threading

    stop = threading.Event()

    def scheduler_loop():
        while not stop.is_set():
            state.loop.run_slice()

    threading.Thread(target=scheduler_loop, name="scheduler-loop", daemon=True).start()
    try:
        while not state.loop.is_driven:
            pass
        state.stage_after_pull(served.local, served.feed.source_dir, 2, stager)
    finally:
        stop.set()


def test_staging_runs_its_engine_half_on_the_thread_that_drives_the_loop(served):
    from sglang_patch.live.mapping.stage import stage_job

    state = _staging_state(served)
    _stage_with_a_scheduler_loop(state, served, stage_job)
    staged = state.weights.staged
    assert staged is not None, state.weights.stage_reason
    assert staged.elements > 0 and staged.engine_where.startswith("on the scheduler thread")
    for p in staged.patches:  # the undo log holds what the live weights hold there
        assert torch.equal(p.old, p.flat[p.index])


def test_the_undo_log_is_taken_from_the_positions_while_the_values_are_still_being_written(served):
    """A helper hands the positions over first (``StagePositions``): the loop saves the undo log
    meanwhile, and reads each patch's values only once the stager returned them written."""
    import numpy as np

    from sglang_patch.live.scatter.patch import _as_torch
    from sglang_patch.live.mapping.stage import stage_job

    state = _staging_state(served)
    seen: dict = {}

    def stager(job, positions_ready):
        reply, done = stage_job(job)
        blank = [p._replace(values=np.zeros_like(p.values)) for p in done]  # values not written yet
        positions_ready(blank)
        for p, d in zip(blank, done):
            p.values[...] = d.values
        seen["done"] = done
        return reply, blank

    _stage_with_a_scheduler_loop(state, served, stager)
    staged = state.weights.staged
    assert staged is not None, state.weights.stage_reason
    assert staged.engine_where.startswith("undo log while the helper gathered the values")
    for p, d in zip(staged.patches, seen["done"]):
        assert torch.equal(p.old, p.flat[p.index])  # the undo log holds what the live weights hold there
        assert torch.equal(p.values, _as_torch(d.values, d.dtype).to(p.values.dtype))  # written, not the blank


def test_a_staging_the_helper_refuses_after_the_positions_drops_the_undo_log_it_started(served):
    from sglang_patch.live.mapping.stage import StageReply, stage_job

    state = _staging_state(served)

    def stager(job, positions_ready):
        _, done = stage_job(job)
        positions_ready(done)
        return StageReply(refused="the helper failed while staging"), []

    _stage_with_a_scheduler_loop(state, served, stager)
    assert state.weights.staged is None and state.weights.stage_reason == "the helper failed while staging"
    assert not state.loop._jobs  # nothing left for the loop to run


def test_staging_on_a_scheduler_loop_that_stopped_running_slices_is_refused_with_its_reason(served, monkeypatch):
    import time

    from sglang_patch.live import staging
    from sglang_patch.live.mapping.stage import stage_job

    state = _staging_state(served)
    monkeypatch.setattr(staging, "LOOP_STAGING_TIMEOUT_S", 0.3)
    state.loop.last_tick = time.monotonic()  # a loop ran a moment ago, and then stalled
    state.stage_after_pull(served.local, served.feed.source_dir, 2, stage_job)
    assert state.weights.staged is None
    assert "staging did not finish" in state.weights.stage_reason and "scheduler loop" in state.weights.stage_reason


@pytest.mark.parametrize("change,words", [
    (dict(seed="0" * 32), "another seed"),
    (dict(run="another-run"), "a new run under the same source dir"),
])
def test_staging_refuses_a_chain_of_another_seed_or_run_than_the_live_weights(served, change, words):
    from sglang_patch.live.mapping.stage import stage_job

    state = _staging_state(served)
    state.weights.live = state.live._replace(**change)
    _stage_with_a_scheduler_loop(state, served, stage_job)
    assert state.weights.staged is None and words in state.weights.stage_reason, state.weights.stage_reason
