"""What the check after a live apply costs inside the pause (``sglang_patch.live.check``,
issue 19): the sample's expected values are read at staging, while the engine serves, so the
pause reads no checkpoint file; a reader's headers are reused only while the checkpoint's files
are the same; a wrong written or sampled element is still found and makes the engine reload.

A real core pull (tiny Qwen3 checkpoint, published chain v1, v2) staged through
``LiveApplyState`` with a thread driving its loop, as sglang's scheduler thread does; the
phases run through ``LiveApplyState._run_phase``. No sglang.
"""

from __future__ import annotations

import builtins
import os
from types import SimpleNamespace

import pytest
import torch

from sglang_patch.live import results as lr
from sglang_patch.live import transaction as tx

from live_support import (
    pull_local_v1, serve_from_local, stage_v2, staged_state_serving_v1, tiny_chain_pulled_at_v1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return tiny_chain_pulled_at_v1(tmp_path_factory.mktemp("live_check_pause"))


def _request(served, phase):
    return SimpleNamespace(phase=phase, txn="t1", local_checkpoint_dir=served.local, target_version=2,
                           flush_cache=True, reason=None)


def _vote_and_apply(state, served):
    vote = state._run_phase(_request(served, tx.VOTE), tx.VOTE, 0.0)
    assert vote.live, vote
    applied = state._run_phase(_request(served, tx.APPLY), tx.APPLY, 0.0)
    assert applied.success, applied.message


def _commit(state, served):
    return state._run_phase(_request(served, tx.COMMIT), tx.COMMIT, 0.0)


class _FileReads:
    """Counts every file the process opens and every checkpoint header or tensor read."""

    def __init__(self, monkeypatch):
        from sglang_patch.live.mapping import coordinate_map
        from weightsync.format import safetensors_io

        self.opened: list = []
        real_open, real_header, real_tensor = builtins.open, safetensors_io.read_header, coordinate_map.tensor_from_file

        def counting_open(file, *args, **kwargs):
            self.opened.append(str(file))
            return real_open(file, *args, **kwargs)

        def counting_header(path, *args, **kwargs):
            self.opened.append(f"header of {path}")
            return real_header(path, *args, **kwargs)

        def counting_tensor(path, *args, **kwargs):
            self.opened.append(f"tensor in {path}")
            return real_tensor(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(safetensors_io, "read_header", counting_header)
        monkeypatch.setattr(coordinate_map, "tensor_from_file", counting_tensor)


def test_the_sample_is_read_at_staging_and_the_commit_reads_no_checkpoint_file(served, monkeypatch):
    state, _ = staged_state_serving_v1(served)
    _vote_and_apply(state, served)
    with monkeypatch.context() as m:
        reads = _FileReads(m)
        report = _commit(state, served)
    assert report.success, report.message
    check = report.check
    assert reads.opened == []  # nothing at all: no header, no tensor, no version marker
    assert check.mismatches == 0 and check.detail == "", check.detail
    assert check.sampled_elements > 0 and check.scattered_elements == report.elements_scattered > 0
    assert check.verified_elements == check.sampled_elements + check.scattered_elements
    assert check.sample_prepared_s > 0 and not check.sample_read_in_pause
    fields = lr.summarize(2, hosts=lr.merge_hosts([report]))  # the reply still carries the counts
    assert fields["verified_elements"] == check.verified_elements and fields["mismatches"] == 0
    assert not fields["reloaded_after_check"]


def test_a_write_that_did_not_land_fails_the_apply_the_rank_restores_and_the_reply_names_the_element(served):
    from live_support import assert_names_the_position, stage_one_position_twice

    state, model = staged_state_serving_v1(served)
    patch = max(state.weights.staged.patches, key=lambda p: int(p.index.numel()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    position, values = stage_one_position_twice(state.weights.staged, patch.param, first=int(patch.index.numel()) - 2)
    vote = state._run_phase(_request(served, tx.VOTE), tx.VOTE, 0.0)
    assert vote.live, vote
    applied = state._run_phase(_request(served, tx.APPLY), tx.APPLY, 0.0)
    assert not applied.success
    assert applied.message.startswith(f"WriteNotLanded: {patch.param}: 1 of "), applied.message
    assert_names_the_position(applied.message, position, values)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n].view(-1).view(torch.int16 if before[n].element_size() == 2 else torch.int32),
                           after[n].detach().view(-1).view(torch.int16 if before[n].element_size() == 2 else torch.int32))
               for n in before)  # the rank restored itself; the coordinator rolls every other rank back
    assert tx.rank_failures([applied])


def test_the_check_at_commit_gathers_only_the_sample_and_no_written_element(served, monkeypatch):
    state, _ = staged_state_serving_v1(served)
    _vote_and_apply(state, served)
    prepared = state.checker._prepared.sample
    assert prepared is not None, state.checker.prepare_reason
    written = [t for p in state._voted.patches for t in (p.index, p.device_index) if t is not None]
    gathered: list = []
    real_select = torch.index_select

    def counting_select(source, dim, index, **kwargs):
        gathered.append(index)
        return real_select(source, dim, index, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "index_select", counting_select)
        report = _commit(state, served)
    assert report.success and report.check.mismatches == 0, report.check
    assert len(gathered) == len(prepared.params)  # one gather per sampled parameter, none per patch
    assert not any(g is w for g in gathered for w in written)
    assert report.check.scattered_elements == report.elements_scattered > 0  # read back in the apply
    assert report.check.written_read_back_s > 0


def test_a_check_that_raises_verifies_nothing_and_makes_the_engine_reload(served, monkeypatch):
    from sglang_patch.live import check

    def broken(*args, **kwargs):
        raise RuntimeError("the check's own failure")

    state, _ = staged_state_serving_v1(served)
    _vote_and_apply(state, served)
    monkeypatch.setattr(check, "check_update", broken)
    report = _commit(state, served)
    assert report.check.failed and report.check.verified_elements == 0 and report.check.mismatches == 0
    assert "RuntimeError: the check's own failure" in report.check.detail
    assert lr.check_mismatches([report])  # what makes the coordinator send every rank the reload
    fields = lr.summarize(2, hosts=lr.merge_hosts([]), failed_checks=[report.check])
    assert fields["reloaded_after_check"] and [c.rank for c in fields["failed_checks"]] == [report.check.rank]


def _nudge(param: torch.Tensor, position: int) -> None:
    with torch.no_grad():
        flat = param.view(-1)
        flat[position] = torch.nextafter(flat[position], torch.tensor(float("inf"), dtype=flat.dtype))


def test_the_sampled_elements_already_at_the_target_are_verified_at_staging_and_the_pause_compares_the_rest(served):
    state, _ = staged_state_serving_v1(served)
    prepared = state.checker._prepared.sample
    assert prepared is not None, state.checker.prepare_reason
    written = {(p.param, int(i)) for p in state.weights.staged.patches for i in p.index.tolist()}
    for_the_pause = [(s.param, int(i)) for s in prepared.params for i in s.index.tolist()]
    assert for_the_pause and all(e in written for e in for_the_pause)  # only what v1 -> v2 changes
    before = prepared.before_pause
    assert before.compared > 10 * len(for_the_pause) and before.mismatches == 0
    _vote_and_apply(state, served)
    check = _commit(state, served).check
    assert check.mismatches == 0, check.detail
    assert check.sampled_before_pause == before.compared and check.sample_before_pause_s > 0
    assert check.sampled_elements == before.compared + len(for_the_pause)


def test_a_wrong_element_where_the_update_writes_nothing_is_found_after_the_scatter_and_the_engine_reloads(
        served, monkeypatch):
    """Where v1 -> v2 writes nothing, v2's bytes are v1's: a live weight that differs there is
    not verified at staging, and after the scatter it is still wrong."""
    from sglang_patch.live import check as live_check

    monkeypatch.setenv(live_check.SAMPLE_ENV, "100000000,100000")  # every element of every tensor
    state, model = staged_state_serving_v1(served)
    written = {(p.param, int(i)) for p in state.weights.staged.patches for i in p.index.tolist()}
    param = state.weights.staged.patches[0].param
    position = next(i for i in range(dict(model.named_parameters())[param].numel()) if (param, i) not in written)
    _nudge(dict(model.named_parameters())[param], position)
    stage_v2(state, served)  # staged again over the wrong element
    prepared = state.checker._prepared.sample
    assert (param, position) in {(s.param, int(i)) for s in prepared.params for i in s.index.tolist()}
    _vote_and_apply(state, served)
    report = _commit(state, served)
    assert report.check.mismatches == 1 and f"element {position} holds" in report.check.detail, report.check.detail
    assert lr.check_mismatches([report])  # what makes the coordinator send every rank the reload


def test_a_wrong_sampled_element_the_update_wrote_makes_the_engine_reload(served):
    state, model = staged_state_serving_v1(served)
    _vote_and_apply(state, served)
    prepared = state.checker._prepared.sample
    assert prepared is not None and prepared.elements > 0, state.checker.prepare_reason
    target = next((s.param, int(s.index[0])) for s in prepared.params)
    _nudge(dict(model.named_parameters())[target[0]], target[1])  # after the scatter's read-back
    report = _commit(state, served)
    assert report.check.mismatches == 1 and "(from " in report.check.detail and f"element {target[1]}" in report.check.detail
    assert lr.check_mismatches([report])
    fields = lr.summarize(2, hosts=lr.merge_hosts([]), failed_checks=[report.check])
    assert fields["reloaded_after_check"] and fields["mismatches"] == 1


def test_a_sample_prepared_for_another_staging_is_not_used_and_the_pause_reads_its_own(served):
    state, _ = staged_state_serving_v1(served)
    _vote_and_apply(state, served)
    state.checker._prepared.patches = list(state._voted.patches)  # prepared for another staging of the same version
    report = _commit(state, served)
    assert report.check.sample_read_in_pause and report.check.sampled_elements > 0
    assert report.check.mismatches == 0, report.check.detail


def test_reloads_reuse_the_checkpoint_headers_until_a_file_of_the_checkpoint_changes(served):
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    pull_local_v1(served)
    state, _ = serve_from_local(served.local, served.model_dir, "reload (test)")
    state.proof.prove(CheckpointReader(served.local), state.live, checkpoint_dir=served.local)
    for _ in range(3):
        check = state.checker.after_update(state, served.local, 1)
        assert check.mismatches == 0 and check.sampled_elements > 0 and check.sample_read_in_pause
    assert state.checker.readers.opened == 1


def test_a_cached_reader_of_a_checkpoint_whose_file_was_replaced_is_never_used(tmp_path):
    from safetensors.torch import save_file

    from sglang_patch.live.check import ReaderCache

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"a": torch.arange(4, dtype=torch.float32)}, str(ckpt / "model.safetensors"))
    cache = ReaderCache()
    first = cache.reader(str(ckpt))
    assert cache.reader(str(ckpt)) is first and cache.opened == 1
    # the same names, another layout: the old header's offsets would read the wrong bytes
    save_file({"b": torch.zeros(2), "a": torch.arange(10, 14, dtype=torch.float32)}, str(tmp_path / "new.safetensors"))
    os.replace(tmp_path / "new.safetensors", ckpt / "model.safetensors")
    second = cache.reader(str(ckpt))
    assert second is not first and cache.opened == 2
    assert second.tensor("a").tolist() == [10.0, 11.0, 12.0, 13.0]
    # rewritten in place (same inode), one byte longer: a new reader too
    with open(ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0")
    assert cache.reader(str(ckpt)) is not second and cache.opened == 3


def test_writes_into_a_storage_the_engine_no_longer_reads_are_found_by_the_check(served):
    """The check at commit compares each patched parameter's storage now with the view the
    scatter wrote (and read back): had the engine swapped a parameter's storage after the apply,
    the checked writes would sit in a storage it no longer reads."""
    state, model = staged_state_serving_v1(served)
    patch = max(state.weights.staged.patches, key=lambda p: int(p.index.numel()))
    param = dict(model.named_parameters())[patch.param]
    _vote_and_apply(state, served)
    with torch.no_grad():
        fresh = param.data.clone()
        fresh.view(-1)[patch.index] = patch.old  # the storage the engine reads now holds the old values
        param.data = fresh
    report = _commit(state, served)
    assert report.check.mismatches >= int(patch.index.numel()), report.check
    assert f"{patch.param} (scattered)" in report.check.detail
    assert lr.check_mismatches([report])


ROUNDS_ENV = "WEIGHTSYNC_CHECK_MODEL_ROUNDS"  # the randomized test's rounds (default 4; longer profiles: more)


def test_under_random_faults_the_check_split_at_staging_finds_what_a_full_compare_with_a_reload_finds(
        served, monkeypatch):
    """The fast path of the check (the sample compared at staging, only the elements not yet at
    the target compared in the pause) against the slow path as the oracle: every sampled element
    compared in the pause with a reload of the version. Each round draws faults the design covers
    (live weights wrong before staging, where the update writes and where it does not; written
    elements wrong after the scatter) and asserts both count the same mismatches over the same
    elements. Nothing else writes the weights between staging and the pause (a weight update
    voids the staging: the generation), so that is not a fault here."""
    import random

    from sglang_patch.live import check as live_check
    from sglang_patch.live.mapping.coordinate_map import as_int_bits

    monkeypatch.setenv(live_check.SAMPLE_ENV, "100000000,100000")  # every element: faults land in the sample
    sampled: list = []
    real_settle = live_check.PreparedSample.settle_before_pause

    def recording_settle(self, params=None):
        sampled[:] = [(s.param, s.index.clone()) for s in self.params]
        return real_settle(self, params)

    monkeypatch.setattr(live_check.PreparedSample, "settle_before_pause", recording_settle)
    rounds = int(os.environ.get(ROUNDS_ENV, "4"))
    for seed in range(rounds):
        rng = random.Random(1900 + seed)
        state, model = staged_state_serving_v1(served)
        params = dict(model.named_parameters())
        written = {p.param: p.index.tolist() for p in state.weights.staged.patches}
        unwritten = {name: sorted(set(range(params[name].numel())) - set(written.get(name, ())))
                     for name in sorted(params)}
        faults = []
        for _ in range(rng.randint(0, 3)):  # live weights wrong before staging
            name = rng.choice(sorted(written) if rng.random() < 0.5 else sorted(n for n in unwritten if unwritten[n]))
            position = rng.choice(written[name] if name in written and rng.random() < 0.5 else unwritten[name])
            _nudge(params[name], position)
            faults.append(("before staging", name, position))
        stage_v2(state, served)  # staged again over them
        assert state.weights.staged is not None, state.weights.stage_reason
        _vote_and_apply(state, served)
        for _ in range(rng.randint(0, 2)):  # written elements wrong after the scatter
            name = rng.choice(sorted(written))
            position = rng.choice(written[name])
            _nudge(params[name], position)
            faults.append(("after the scatter", name, position))
        check = _commit(state, served).check
        _, oracle = serve_from_local(served.local, served.model_dir, "reload (test oracle)")
        reloaded = dict(oracle.named_parameters())
        found = sum(int(torch.count_nonzero(as_int_bits(params[name].detach().view(-1))[index]
                                            != as_int_bits(reloaded[name].detach().view(-1))[index]))
                    for name, index in sampled)
        elements = sum(int(index.numel()) for _, index in sampled)
        assert (check.mismatches, check.sampled_elements) == (found, elements), (seed, faults, check.detail)
        assert (found > 0) == any(where == "after the scatter" or position not in written.get(name, ())
                                  for where, name, position in faults), (seed, faults)
