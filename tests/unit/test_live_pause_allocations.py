"""Nothing is allocated inside the pause (issue 19, point 9): staging makes every tensor the
scatter and a restore use, so an out-of-memory error cannot stop either.

What sees the allocations: a ``TorchDispatchMode`` that records every op whose output tensor
has a storage none of its inputs has (factory ops such as ``empty``/``zeros``/``full``, ``.to``
and ``_to_copy``, ``clone``, a gather's result...), while views and in-place or ``out=`` ops
pass. It sees torch's operators only: a kernel's own workspace on a device is counted by the
GPU kit instead (``benchmarks/gpu_check.py``: ``torch.cuda.memory_stats`` across the pause).

The device path (the index and the values copied to the parameter's device at staging, the
restore's device scratch) runs here on CPU parameters with ``device_copies=True``: the same
code, with the device being the CPU. Torch only, no sglang.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_patch.live.mapping.coordinate_map import TensorSpec, build_coordinate_map, prove_map
from sglang_patch.live.scatter.patch import SPARSE_WRITE_DENSITY, StagedUpdate, scatter_with_undo, stage_update

from live_support import FlatModel, NewTensors, TensorReader, changed_positions, storage_of as _storage


def test_the_recorder_sees_factories_copies_and_gathers_but_not_views_or_in_place_writes():
    x = torch.arange(10.0)
    idx = torch.tensor([1, 3])
    out = torch.empty(2)
    with NewTensors() as quiet:
        x.view(torch.int32)[2:5].view(torch.float32)
        x.index_copy_(0, idx, out)
        torch.index_select(x, 0, idx, out=out)
        out.copy_(x[:2])
    assert quiet.created == []
    for make in (lambda: torch.empty(3), lambda: x.to(torch.float64), lambda: x.clone(), lambda: x[idx],
                 lambda: x.index_select(0, idx), lambda: torch.zeros(0)):
        with NewTensors() as seen:
            make()
        assert len(seen.created) == 1, seen.created


def _engine(dtype=torch.bfloat16):
    """Three parameters (bf16, loaded from an f32 checkpoint: staging casts) and a v1 that
    changes few elements of one (a sparse patch), many of another (dense) and one element of
    the third."""
    g = torch.Generator().manual_seed(5)
    v0 = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(4000, generator=g), "c": torch.randn(7, 3, generator=g)}
    model = FlatModel(v0).to(dtype)
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in v0.items()])
    model.load_weights(v0.items())
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: v0[n])
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["a"].view(-1)[::300] += 1  # 7 of 2048: below SPARSE_WRITE_DENSITY
    v1["b"][::3] -= 1  # a third: index_copy_
    v1["c"][6, 2] += 1
    return model, cmap, v0, v1


def _staged(model, cmap, v0, v1, device_copies):
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1),
                          max_elements=10**6, staged=StagedUpdate(0, 1, None, "/x", 0), device_copies=device_copies)
    densities = sorted(p.index.numel() / p.flat.numel() for p in staged.patches)
    assert densities[0] < SPARSE_WRITE_DENSITY < densities[-1]  # both CPU write paths
    return staged


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


@pytest.mark.parametrize("device_copies", [None, True], ids=["host-writes", "device-path"])
def test_the_pause_of_a_staged_update_creates_no_tensor(device_copies):
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies)
    with NewTensors() as pause:
        undo, written = scatter_with_undo(staged)
    assert pause.created == []
    assert written == staged.elements > 0
    reloaded = FlatModel(v1).to(torch.bfloat16)
    reloaded.load_weights(v1.items())
    assert _same(_weights(model), _weights(reloaded))


@pytest.mark.parametrize("device_copies", [None, True], ids=["host-writes", "device-path"])
def test_a_restore_after_a_fault_mid_scatter_creates_no_tensor_and_restores_every_patch(device_copies):
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies)
    before = _weights(model)

    def fail_at_the_last_patch(k, param):
        if k == len(staged.patches) - 1:
            raise RuntimeError("CUDA out of memory (injected mid-scatter)")

    with NewTensors() as pause, pytest.raises(RuntimeError, match="injected mid-scatter"):
        scatter_with_undo(staged, before_write=fail_at_the_last_patch)
    assert pause.created == []
    assert _same(_weights(model), before)


@pytest.mark.parametrize("device_copies", [None, True], ids=["host-writes", "device-path"])
def test_a_restore_after_another_rank_failed_creates_no_tensor_and_checks_every_patch(device_copies):
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies)
    before = _weights(model)
    undo, _ = scatter_with_undo(staged)
    with NewTensors() as rollback:
        result = undo.restore()
    assert rollback.created == []
    assert result.restored, result.describe()
    assert _same(_weights(model), before)


def test_staged_device_copies_are_what_the_scatter_reads_and_the_host_is_not_read_in_the_pause():
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies=True)
    host = set()
    for p in staged.patches:
        assert p.device_index is not None and p.device_values is not None
        assert p.device_index.device == p.flat.device and p.device_values.dtype == p.flat.dtype
        assert _storage(p.device_index) != _storage(p.index) and _storage(p.device_values) != _storage(p.values)
        assert torch.equal(p.device_index, p.index) and torch.equal(p.device_values, p.values)
        host |= {_storage(p.index), _storage(p.values), _storage(p.old)}
    assert staged.device_nbytes >= sum(p.index.numel() * (8 + 2) for p in staged.patches)
    with NewTensors() as pause:
        scatter_with_undo(staged)
    # on a GPU: no host-to-device copy, so no transfer and no staging buffer inside the pause
    assert not (pause.touched & host)


def test_staging_for_a_device_pins_no_host_memory():
    """Pinned memory torch's caching host allocator hands out stays cached at its high-water
    mark; staging pins none, so there is none to keep (the GPU kit measures it on CUDA)."""
    model, cmap, v0, v1 = _engine()
    with NewTensors() as staging:
        _staged(model, cmap, v0, v1, device_copies=True)
    assert staging.pinned == []
    assert staging.created  # the recorder did watch staging: it makes the copies


def test_a_restore_whose_buffers_are_too_small_fails_that_patch_instead_of_allocating():
    from sglang_patch.live.scatter.patch import RestoreBuffers, UndoLog

    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies=True)
    undo, _ = scatter_with_undo(staged)
    largest = max(staged.patches, key=lambda p: p.index.numel())
    small = RestoreBuffers([p for p in staged.patches if p is not largest])
    with NewTensors() as rollback:
        result = UndoLog(staged.patches, small).restore()
    assert rollback.created == []
    assert not result.restored and any(f.startswith(f"{largest.param}: write-back failed") for f in result.failures)
    np.testing.assert_array_equal(largest.flat[largest.index].view(torch.int16).numpy(),
                                  largest.values.view(torch.int16).numpy())  # left as written, and said so


def test_a_restore_on_the_device_path_reads_every_patch_back_and_reports_a_write_that_did_not_hold():
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies=True)
    undo, _ = scatter_with_undo(staged)
    last = len(staged.patches) - 1
    victim = staged.patches[last]

    def scribble_after_the_first_write_back(k, param):  # reverse order: the last patch went first
        if k == last - 1:
            victim.flat[victim.index[0]] += 1

    result = undo.restore(before_write=scribble_after_the_first_write_back)
    assert result.failures == (f"{victim.param}: reads back other values than the undo log",)


# --- the check inside the pause: no tensor made, and no reduction on the device path ------------
#
# A reduction makes no new tensor the recorder sees when given ``out=``, but on CUDA it takes a
# workspace from the caching allocator for a large input (``torch.sum(out=)``), and
# ``torch.equal`` makes a whole bool tensor inside its kernel: the device path may run only the
# element-wise and indexing ops below (``mapping.differ``), whatever their sizes.

DEVICE_PATH_OPS = {
    "aten.index_select", "aten.ne", "aten.index_fill_", "aten.zero_", "aten.copy_", "aten.index_copy_",
    "aten.index_put_", "aten.view", "aten.slice", "aten.select", "aten.alias", "aten.detach", "aten.reshape",
    "aten._reshape_alias", "aten.as_strided", "aten.unsqueeze", "aten._local_scalar_dense", "aten.is_nonzero",
}


class OpsSeen(TorchDispatchMode):
    """Entered with ``with``: the name of every op run (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_op_recorder_sees_the_reductions_the_device_path_must_not_run():
    x, y, out = torch.arange(6), torch.arange(6), torch.zeros((), dtype=torch.int64)
    with OpsSeen() as seen:
        torch.equal(x, y)
        torch.sum(x, 0, out=out)
        torch.count_nonzero(x)
    assert {"aten.equal", "aten.sum", "aten.count_nonzero"} <= seen.ops
    assert not {"aten.equal", "aten.sum", "aten.count_nonzero"} & DEVICE_PATH_OPS


def _prepared_sample(model, cmap, v1, device_path):
    from sglang_patch.live.check import prepare_sample_steps, sample_seed, values_through
    from sglang_patch.live.loop_slices import drain

    return drain(prepare_sample_steps(cmap, dict(model.named_parameters()), values_through(lambda n: v1[n]),
                                      sample_seed(1, 1), per_tensor=500, device_path=device_path))


@pytest.mark.parametrize("device_path", [None, True], ids=["host-compare", "device-path"])
def test_the_checks_compare_in_the_pause_creates_no_tensor_and_runs_no_reduction(device_path):
    """A live apply's check as the engine runs it: the sample read and settled at staging, the
    scatter and the sample's compare in the pause."""
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies=device_path)
    sample = _prepared_sample(model, cmap, v1, device_path)
    settled = sample.settle_before_pause(dict(model.named_parameters()))
    assert settled.compared > 0 and sample.elements > 0  # some sampled elements change: the pause compares them
    with NewTensors() as pause, OpsSeen() as seen:
        undo, _ = scatter_with_undo(staged)
        tally = sample.compare(dict(model.named_parameters()))
    assert pause.created == []
    assert tally.mismatches == 0 and tally.compared == sample.elements
    if device_path:
        assert seen.ops <= DEVICE_PATH_OPS, seen.ops - DEVICE_PATH_OPS
    # and the compare still finds a wrong element (its detail may allocate: every rank reloads then)
    member = sample.groups[0].members[0]
    with torch.no_grad():
        member.flat[int(member.index[0])] += 1
    found = sample.compare(dict(model.named_parameters()))
    assert found.mismatches == 1 and member.param in found.first


def test_the_scatters_read_back_on_the_device_path_runs_no_reduction():
    model, cmap, v0, v1 = _engine()
    staged = _staged(model, cmap, v0, v1, device_copies=True)
    with OpsSeen() as seen:
        undo, written = scatter_with_undo(staged)
    assert seen.ops <= DEVICE_PATH_OPS, seen.ops - DEVICE_PATH_OPS
    assert undo.read_back.elements == written == staged.elements


def test_differ_flags_find_one_differing_element_in_any_chunk_of_a_strided_view_without_making_a_tensor(monkeypatch):
    from sglang_patch.live.mapping import differ

    monkeypatch.setattr(differ, "CHUNK", 8)
    base = torch.arange(10 * 12, dtype=torch.int32).view(10, 12)
    want = base.t()  # a strided view, as a derived tensor's source is
    flags = differ.DifferFlags("cpu", slots=3, largest=want.numel(), row=want[0].numel())
    assert flags.scratch.numel() == 10  # one row: chunks are whole rows
    got = want.contiguous()
    wrong = got.clone()
    wrong[11, 9] += 1  # the last row, the last chunk
    with NewTensors() as made, OpsSeen() as seen:
        flags.mark(0, got, want)
        flags.mark(2, wrong, want)
        differing = flags.differing()
    assert made.created == [] and seen.ops <= DEVICE_PATH_OPS, (made.created, seen.ops)
    assert differing.tolist() == [False, False, True]
    flags.reset()
    assert flags.differing().tolist() == [False, False, False]


def test_the_derived_states_compare_runs_no_reduction_while_it_holds_and_counts_once_it_does_not():
    from sglang_patch.live.mapping.derived import CompareScratch

    want = torch.randn(6, 4, dtype=torch.float32).t()
    got = want.contiguous()
    scratch = CompareScratch([got])
    with NewTensors() as made, OpsSeen() as seen:
        assert scratch.differing(got, want) == 0
    assert made.created == [] and seen.ops <= DEVICE_PATH_OPS, (made.created, seen.ops)
    got[1, 2] += 1
    got[3, 5] += 1
    assert scratch.differing(got, want) == 2
