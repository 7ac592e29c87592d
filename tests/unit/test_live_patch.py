"""Staging, scatter and undo of a live update (``sglang_patch.live.scatter.patch``), and how the ranks'
outcomes become one reply (``sglang_patch.live.results``). Torch only, no sglang."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_patch.live import results as lr
from sglang_patch.live.mapping.coordinate_map import Placement, TensorSpec, build_coordinate_map, prove_map
from sglang_patch.live.scatter.patch import StagedUpdate, StagingRefused, positions_through, scatter_with_undo, stage_update

from live_support import TensorReader, assert_names_the_position, changed_positions, stage_one_position_twice


class TwoShards(torch.nn.Module):
    """Rank 1 of a column split (rows 4..7 of ``w``) fused with all of ``b`` behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(4 + 2, 3))

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.fused.data[:4].copy_(t.narrow(0, 4, 4))
            else:
                self.fused.data[4:].copy_(t.t())  # b is stored (3, 2): a transposed box


def _setup():
    g = torch.Generator().manual_seed(0)
    v0 = {"w": torch.randn(8, 3, generator=g), "b": torch.randn(3, 2, generator=g)}
    model = TwoShards()
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in v0.items()])
    model.load_weights(iter(v0.items()))
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: v0[n])
    return model, cmap, v0


def test_positions_through_a_box_keep_only_what_lands_on_this_rank():
    p = Placement("w", "fused", (4, 3), 12, (3, 1), 0, (3, 1))  # rows 4..7 of an (8, 3) tensor
    hf, dst = positions_through(p, np.array([0, 11, 12, 14, 23, 24], dtype=np.int64))
    assert hf.tolist() == [12, 14, 23] and dst.tolist() == [0, 2, 11]


def _through_each_element(p, positions):
    """``positions_through`` the slow way: every element of the box, one at a time."""
    import itertools

    where = {}
    for i in itertools.product(*[range(n) for n in p.sizes]):
        where[p.src_offset + sum(a * s for a, s in zip(i, p.src_strides))] = p.dst_offset + sum(
            a * s for a, s in zip(i, p.dst_strides))
    hf = [int(x) for x in positions if int(x) in where]
    return hf, [where[x] for x in hf]


@pytest.mark.parametrize("box", [
    Placement("w", "p", (6, 4), 4, (8, 1), 0, (4, 1)),  # rank 1's columns of a (6, 8) row-parallel tensor
    Placement("w", "p", (6, 4), 0, (8, 1), 30, (4, 1)),  # rank 0's, behind other rows of the parameter
    Placement("w", "p", (2, 3, 4), 5, (40, 8, 1), 3, (12, 4, 1)),  # rows of a 3-d slice (an expert's block)
    Placement("w", "p", (5, 1, 3), 2, (4, 8, 1), 1, (3, 3, 1)),  # a size-1 dim with the largest stride
    Placement("w", "p", (3, 4), 0, (1, 3), 0, (4, 1)),  # transposed: no contiguous rows
    Placement("w", "p", (4, 1), 8, (1, 1), 2, (1, 1)),  # one contiguous run
])
def test_positions_through_row_runs_and_any_box_match_each_element(box):
    rng = np.random.default_rng(7)
    for density in (0.02, 0.3, 1.0):
        positions = np.flatnonzero(rng.random(400) < density).astype(np.int64)
        hf, dst = positions_through(box, positions)
        assert (hf.tolist(), dst.tolist()) == _through_each_element(box, positions)


def test_a_staged_scatter_equals_a_reload_and_keeps_the_storage():
    model, cmap, v0 = _setup()
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["w"][1, 0] += 1  # rank 0's rows: not this rank's business
    v1["w"][5, 2] += 1
    v1["b"][2, 1] += 1
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1), max_elements=100,
                          staged=StagedUpdate(0, 1, None, "/x", 0))
    assert staged.elements == 2 and staged.nbytes == 2 * (8 + 4 + 4)  # index, new values, old values (undo)
    ptr = model.fused.data_ptr()
    _, written = scatter_with_undo(staged)
    assert written == 2 and model.fused.data_ptr() == ptr
    reloaded = TwoShards()
    reloaded.load_weights(iter(v1.items()))
    assert torch.equal(model.fused, reloaded.fused)


def test_a_failure_mid_scatter_restores_every_written_position():
    model, cmap, v0 = _setup()
    v1 = {n: t + 1 for n, t in v0.items()}  # every element of both tensors
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1), max_elements=100,
                          staged=StagedUpdate(0, 1, None, "/x", 0))
    before = model.fused.detach().clone()

    def fail_second(k, param):
        if k == 0:
            return
        raise RuntimeError("boom")

    # one parameter: make two patches by splitting it, so the fault lands after a write
    half = staged.patches[0].index.numel() // 2
    p = staged.patches[0]
    staged.patches = [p._replace(index=p.index[:half], values=p.values[:half], old=p.old[:half]),
                      p._replace(index=p.index[half:], values=p.values[half:], old=p.old[half:])]
    with pytest.raises(RuntimeError, match="boom"):
        scatter_with_undo(staged, before_write=fail_second)
    assert torch.equal(model.fused.detach(), before)
    undo, _ = scatter_with_undo(staged)  # the retry, then another rank failed
    assert not torch.equal(model.fused.detach(), before)
    undo.restore()
    assert torch.equal(model.fused.detach(), before)


def test_staging_stops_at_the_threshold_and_at_a_reload_only_parameter():
    model, cmap, v0 = _setup()
    v1 = {n: t + 1 for n, t in v0.items()}
    with pytest.raises(StagingRefused, match="more than 5 changed elements"):
        stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1), max_elements=5,
                     staged=StagedUpdate(0, 1, None, "/x", 0))
    cmap.reload_only_params["fused"] = "repacked after loading"
    with pytest.raises(StagingRefused, match="parameter fused .* is reload-only: repacked after loading"):
        stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1), max_elements=100,
                     staged=StagedUpdate(0, 1, None, "/x", 0))


def test_one_rank_that_cannot_patch_live_makes_every_rank_reload_with_its_reason():
    votes = [lr.LiveDecision(rank="dp0/tp0", live=True), lr.LiveDecision(rank="dp0/tp1", live=False, reason="nothing staged")]
    assert lr.choose_mode(votes) == (lr.RELOAD, "dp0/tp1: nothing staged")
    assert lr.choose_mode(votes[:1]) == (lr.LIVE, None)


def test_a_rolled_back_reply_is_a_failure_that_says_every_rank_was_restored():
    reports = [
        lr.LiveRankReport(host="h/node0", rank=f"dp0/tp{i}", success=False, mode=lr.LIVE, rolled_back=True,
                          weight_version=3, message="live apply failed, rolled back: rank 1: boom")
        for i in range(2)
    ]
    fields = lr.summarize(4, lr.merge_hosts(reports))
    assert fields["success"] is False and fields["rolled_back"] is True and fields["http_status"] == 500
    assert fields["weight_version"] == 3 and "every rank was restored" in fields["message"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("density", [0.001, 0.5])  # below and above SPARSE_WRITE_DENSITY: both write paths
def test_a_patch_writes_exactly_its_positions_in_place_and_restores_them(dtype, density):
    from sglang_patch.live.scatter.patch import SPARSE_WRITE_DENSITY, ParamPatch

    g = torch.Generator().manual_seed(1)
    param = torch.randn(20_000, generator=g).to(dtype)
    before, ptr = param.clone(), param.data_ptr()
    index = torch.from_numpy(np.sort(np.random.default_rng(1).choice(param.numel(), int(density * param.numel()), replace=False)))
    assert (index.numel() < SPARSE_WRITE_DENSITY * param.numel()) == (density < SPARSE_WRITE_DENSITY)
    values = torch.randn(index.numel(), generator=g).to(dtype)
    patch = ParamPatch("p", param.view(-1), index, values, param.index_select(0, index))
    patch.write(patch.values)
    expected = before.clone()
    expected[index] = values
    assert torch.equal(param.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert param.data_ptr() == ptr
    patch.write(patch.old)
    assert torch.equal(param, before)


def test_staging_in_steps_bounds_each_step_and_ends_where_staging_at_once_does():
    from sglang_patch.live.scatter import patch as live_patch
    from sglang_patch.live.mapping.stage import Patch

    flat = torch.arange(10_000, dtype=torch.float32)
    index = np.arange(0, 10_000, 3, dtype=np.int64)
    values = (np.arange(index.size, dtype=np.float32) + 0.5).view(np.uint32)
    patches = [Patch("p", "F32", index, values)]
    at_once = live_patch.finish_staging(patches, {"p": flat}, StagedUpdate(0, 1, None, "/x", 0))
    stepped = StagedUpdate(0, 1, None, "/x", 0)
    steps = 0
    old_step, live_patch.STEP_ELEMENTS = live_patch.STEP_ELEMENTS, 1000
    try:
        for _ in live_patch.finish_staging_steps(patches, {"p": flat}, stepped):
            steps += 1
    finally:
        live_patch.STEP_ELEMENTS = old_step
    assert steps == -(-index.size // 1000)  # one step per 1000 elements, no more
    (a,), (b,) = at_once.patches, stepped.patches
    assert torch.equal(a.index, b.index) and torch.equal(a.values, b.values) and torch.equal(a.old, b.old)
    assert torch.equal(b.old, flat[torch.from_numpy(index)])  # the undo log is what the weights held


def test_a_ranks_source_window_spans_exactly_the_elements_its_boxes_read():
    from sglang_patch.live.mapping.stage import source_windows

    rows_4_to_7 = Placement("w", "fused", (4, 3), 12, (3, 1), 0, (3, 1))  # of an (8, 3) tensor
    transposed = Placement("b", "fused", (2, 3), 0, (1, 2), 12, (3, 1))  # all of a (3, 2) tensor
    windows = source_windows({"w": [rows_4_to_7], "b": [transposed]})
    assert windows == {"w": (12, 23), "b": (0, 5)}
    for p in (rows_4_to_7, transposed):
        everything = np.arange(24 if p.tensor == "w" else 6, dtype=np.int64)
        hf, _ = positions_through(p, everything)
        lo, hi = windows[p.tensor]
        assert hf.min() == lo and hf.max() == hi


def _three_patches_written():
    """Three parameters a scatter wrote; returns the patches and each parameter's old values."""
    from sglang_patch.live.scatter.patch import ParamPatch

    g = torch.Generator().manual_seed(3)
    patches, olds = [], []
    for k in range(3):
        old_param = torch.randn(4000, generator=g)
        index = torch.arange(5, 4000, 97 if k != 1 else 7, dtype=torch.int64)  # both write paths
        new_values = torch.randn(index.numel(), generator=g)
        written = old_param.clone()
        written[index] = new_values
        patches.append(ParamPatch(f"p{k}", written, index, new_values, old_param[index].clone()))
        olds.append(old_param)
    return patches, olds


def _out_of_memory_on(name):
    """The write-back of ``name`` fails as an out-of-memory device write would (no device here)."""
    def before_write(k, param):
        if param == name:
            raise RuntimeError(f"CUDA out of memory (injected while writing {param} back)")
    return before_write


def test_a_restore_whose_one_write_fails_still_restores_the_others_and_reports_not_restored():
    from sglang_patch.live.scatter.patch import UndoLog

    patches, olds = _three_patches_written()
    result = UndoLog(patches).restore(before_write=_out_of_memory_on("p1"))  # never raises
    assert result.restored is False
    assert len(result.failures) == 1 and result.failures[0].startswith("p1: write-back failed: RuntimeError: CUDA out of memory")
    assert result.describe().startswith("not restored: p1")
    assert torch.equal(patches[0].flat, olds[0]) and torch.equal(patches[2].flat, olds[2])  # p0 tried after p1 failed
    assert not torch.equal(patches[1].flat, olds[1])


def test_a_restore_checks_every_patch_against_the_undo_log_and_reports_a_write_that_did_not_hold():
    from sglang_patch.live.scatter.patch import UndoLog

    patches, olds = _three_patches_written()

    def scribble_on_p2_after_its_write_back(k, param):  # reverse order: p2 was written back first
        if k == 0:
            patches[2].flat[patches[2].index[0]] += 1

    result = UndoLog(patches).restore(before_write=scribble_on_p2_after_its_write_back)
    assert result.restored is False
    assert result.failures == ("p2: reads back other values than the undo log",)
    assert torch.equal(patches[0].flat, olds[0]) and torch.equal(patches[1].flat, olds[1])


def test_a_restore_that_holds_reports_restored_and_a_scatter_whose_restore_fails_says_so():
    from sglang_patch.live.scatter.patch import RestoreBuffers, RestoreFailed, UndoLog

    patches, olds = _three_patches_written()
    assert UndoLog(patches).restore() == (True, ())
    assert all(torch.equal(p.flat, o) for p, o in zip(patches, olds))

    patches, olds = _three_patches_written()
    staged = StagedUpdate(0, 1, None, "/x", 0, patches=[p._replace(values=p.values) for p in patches])
    staged.restore_buffers = RestoreBuffers(staged.patches)  # what finish_staging makes
    for p, o in zip(patches, olds):  # back at the old version: the scatter writes the new one
        p.flat.copy_(o)
    calls = []

    def fail_the_scatter_then_the_restore_of_p0(k, param):
        calls.append((k, param))
        if len(calls) == 2 or param == "p0" and len(calls) > 2:
            raise RuntimeError("boom")

    undo_faults = fail_the_scatter_then_the_restore_of_p0
    with pytest.raises(RestoreFailed, match="boom; the restore failed: not restored: p0"):
        scatter_with_undo(staged, before_write=undo_faults, before_restore=undo_faults)


# --- the scatter reads back what it wrote ---------------------------------------------------------


def _three_patches(device_copies):
    """A bf16 engine (from an f32 checkpoint) and v1 staged as three patches: sparse (numpy's
    write), dense (``index_copy_``) and one element; ``device_copies``: the device path, on the CPU."""
    from live_support import FlatModel

    g = torch.Generator().manual_seed(5)
    v0 = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(4000, generator=g), "c": torch.randn(7, 3, generator=g)}
    model = FlatModel(v0).to(torch.bfloat16)
    cmap = build_coordinate_map(model, [TensorSpec(n, tuple(t.shape), "F32") for n, t in v0.items()])
    model.load_weights(v0.items())
    assert prove_map(cmap, dict(model.named_parameters()), lambda n: v0[n])
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["a"].view(-1)[::300] += 1
    v1["b"][::3] -= 1
    v1["c"][6, 2] += 1
    staged = stage_update(cmap, dict(model.named_parameters()), changed_positions(v0, v1), TensorReader(v1),
                          max_elements=10**6, staged=StagedUpdate(0, 1, None, "/x", 0), device_copies=device_copies)
    return model, staged


def _bits(model):
    return {n: p.detach().view(torch.int16).clone() for n, p in model.named_parameters()}


@pytest.fixture(params=["compiled", "numpy"])
def host_path(request, monkeypatch):
    """The pause's host writes: the compiled loop (``live.scatter.host_scatter``), or numpy and torch
    where the extension was not built."""
    from sglang_patch.live.scatter import host_scatter

    if request.param == "numpy":
        monkeypatch.setattr(host_scatter, "_compiled", None)
    elif host_scatter.compiled() is None:
        pytest.fail("sglang_patch.live.scatter._host_scatter is not built (scripts/setup_env.sh builds it)")
    return request.param


@pytest.mark.parametrize("device_copies", [None, True], ids=["host-writes", "device-path"])
def test_a_correct_scatter_reads_back_and_verifies_every_element_it_wrote(device_copies, host_path):
    model, staged = _three_patches(device_copies)
    undo, written = scatter_with_undo(staged)
    assert undo.read_back is not None and undo.read_back.elements == written == staged.elements > 0
    v1 = _bits(model)
    for p in staged.patches:
        assert torch.equal(v1[p.param].view(-1)[p.index], p.values.view(torch.int16))


@pytest.mark.parametrize("victim", ["p0", "p1"], ids=["sparse-write", "dense-write"])  # a, b
def test_a_host_write_that_did_not_land_fails_the_scatter_names_the_element_and_the_rank_restores(victim, host_path):
    from sglang_patch.live.scatter.patch import WriteNotLanded

    model, staged = _three_patches(None)
    before = _bits(model)
    position, values = stage_one_position_twice(staged, victim)
    with pytest.raises(WriteNotLanded) as err:
        scatter_with_undo(staged)
    assert str(err.value).startswith(f"{victim}: 1 of "), str(err.value)
    assert_names_the_position(str(err.value), position, values)
    after = _bits(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # restored from the undo log


@pytest.mark.parametrize("victim", ["p0", "p1"], ids=["sparse-write", "dense-write"])  # a, b
def test_a_device_write_that_did_not_land_fails_the_scatter_names_the_element_and_the_rank_restores(monkeypatch,
                                                                                                    victim):
    from sglang_patch.live.scatter.patch import ParamPatch, WriteNotLanded

    model, staged = _three_patches(True)
    before = _bits(model)
    patch = next(p for p in staged.patches if p.param == victim)
    skipped = int(patch.index[1])
    old, new = (float(t[1:2].float()) for t in (patch.old, patch.values))
    assert old != new
    real_write = ParamPatch.write_new

    def write_all_but_one(self, start=0, stop=None):  # a device write that misses one position
        real_write(self, start, stop)
        if self.param == victim:
            self.flat[skipped] = self.old[1]

    monkeypatch.setattr(ParamPatch, "write_new", write_all_but_one)
    with pytest.raises(WriteNotLanded) as err:
        scatter_with_undo(staged)
    message = str(err.value)
    assert message.startswith(f"{victim}: 1 of {patch.index.numel()} written element(s)")
    assert f"flat position {skipped}: expected {new!r}, found {old!r}" in message
    after = _bits(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # restored from the undo log


@pytest.mark.parametrize("victim", ["p0", "p1"], ids=["sparse-write", "dense-write"])
def test_host_patches_are_written_and_read_back_block_by_block_and_a_missed_element_is_named(monkeypatch, victim,
                                                                                              host_path):
    from sglang_patch.live.scatter import host_scatter, patch as patch_module
    from sglang_patch.live.scatter.patch import WriteNotLanded

    monkeypatch.setattr(patch_module, "READ_BACK_CHUNK", 3)
    monkeypatch.setattr(patch_module, "DENSE_READ_BACK_CHUNK", 3)
    monkeypatch.setattr(host_scatter, "CHUNK", 3)
    model, staged = _three_patches(None)
    undo, written = scatter_with_undo(staged)
    assert undo.read_back.elements == written == staged.elements
    assert undo.restore().restored
    before = _bits(model)
    position, values = stage_one_position_twice(staged, victim, first=4)  # entries 4 and 5: the second block
    with pytest.raises(WriteNotLanded) as err:
        scatter_with_undo(staged)
    n = int(next(p for p in staged.patches if p.param == victim).index.numel())
    stretch = "3-4" if host_path == "compiled" else "3-5"  # the compiled loop stops at the element
    assert f"{victim}: 1 of positions {stretch} of {n} written element(s)" in str(err.value), str(err.value)
    assert_names_the_position(str(err.value), position, values)
    after = _bits(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_the_compiled_scatter_writes_exactly_its_positions_at_every_width_and_refuses_one_out_of_range():
    from sglang_patch.live.scatter import host_scatter

    if host_scatter.compiled() is None:
        pytest.fail("sglang_patch.live.scatter._host_scatter is not built (scripts/setup_env.sh builds it)")
    rng = np.random.default_rng(11)
    for dtype in (torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64):
        flat = torch.from_numpy(rng.integers(0, 255, 5000 * 8, dtype=np.uint8)).view(dtype)
        index = torch.from_numpy(np.sort(rng.choice(flat.numel(), 700, replace=False)).astype(np.int64))
        values = torch.from_numpy(rng.integers(0, 255, 700 * flat.element_size(), dtype=np.uint8)).view(dtype)
        expected = flat.clone()
        expected.view(torch.uint8).view(-1, flat.element_size())[index] = values.view(torch.uint8).view(-1, flat.element_size())
        got = flat.clone()
        host_scatter.scatter(got, index, values, 0, 350)
        result = host_scatter.scatter_and_read_back(got, index, values, 350)
        assert result.first_differing == -1 and result.timings.read_back_s > 0
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), dtype
    out_of_range = index.clone()
    out_of_range[5] = flat.numel()
    untouched = flat.clone()
    with pytest.raises(IndexError, match=f"position {flat.numel()} \\(entry 5\\) is outside the destination's "
                                         f"{flat.numel()} elements"):
        host_scatter.scatter_and_read_back(untouched, out_of_range, values)
    with pytest.raises(ValueError, match="8-byte values into a parameter of 2-byte elements"):
        host_scatter.scatter(torch.zeros(10, dtype=torch.bfloat16), index[:1], values[:1])
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor"):
        host_scatter.scatter(torch.zeros(10, 2, dtype=torch.int64).t(), index[:1], values[:1])


@pytest.mark.parametrize("first", [0, 100, 300, 698], ids=["probe-chunk-start", "probe-chunk", "fused-chunk",
                                                         "last-partial-chunk"])
def test_the_compiled_read_back_finds_a_position_staged_twice_wherever_it_falls(monkeypatch, first):
    """Chunks of 256 over 700 positions, the first a probe (written, then read back in a pass of
    its own), the others written and read back in one loop: a write that overwrites the one just
    before it is found at the entry whose value was lost, in either kind of chunk."""
    from sglang_patch.live.scatter import host_scatter

    if host_scatter.compiled() is None:
        pytest.fail("sglang_patch.live.scatter._host_scatter is not built (scripts/setup_env.sh builds it)")
    monkeypatch.setattr(host_scatter, "CHUNK", 256)
    rng = np.random.default_rng(first)
    flat = torch.from_numpy(rng.integers(-999, 999, 5000, dtype=np.int16))
    index = torch.from_numpy(np.sort(rng.choice(5000, 700, replace=False)).astype(np.int64))
    values = torch.from_numpy(rng.integers(1000, 2000, 700, dtype=np.int16))
    index[first + 1] = index[first]
    values[first + 1] = -values[first]
    result = host_scatter.scatter_and_read_back(flat, index, values)
    assert result.first_differing == first
    clean = torch.from_numpy(np.sort(rng.choice(5000, 700, replace=False)).astype(np.int64))
    result = host_scatter.scatter_and_read_back(flat, clean, values)
    assert result.first_differing == -1 and result.timings.read_back_s > 0
    assert torch.equal(flat[clean], values)


def test_under_random_patches_and_faults_the_compiled_scatter_ends_where_the_numpy_path_ends(monkeypatch):
    """The compiled loop (the fast path) against the numpy path as the oracle, on random patches
    (element widths, densities, chunk sizes, several parameters) with a position staged twice
    at a random place or none: both fail or both succeed, and the parameters end bit for bit
    equal (the update's bytes, or the previous version's after the restore).

    The fault stands for a write that did not land, so it is drawn inside one chunk of each
    path: both read a chunk back before writing the next, and a patch never names a position
    twice (the proven map is one-to-one), so an overwrite across chunks is no fault either
    path is there to find (the sample would)."""
    from sglang_patch.live.scatter import host_scatter
    from sglang_patch.live.scatter.patch import ParamPatch, RestoreBuffers, WriteNotLanded

    if host_scatter.compiled() is None:
        pytest.fail("sglang_patch.live.scatter._host_scatter is not built (scripts/setup_env.sh builds it)")
    compiled = host_scatter.compiled()
    rng = np.random.default_rng(19)
    outcomes = set()
    for _ in range(40):
        monkeypatch.setattr(host_scatter, "CHUNK", int(rng.choice([3, 64, 4096])))
        start = [torch.from_numpy(rng.integers(0, 255, int(rng.integers(8, 4000)) * 8, dtype=np.uint8))
                 .view([torch.uint8, torch.bfloat16, torch.float32, torch.float64][int(rng.integers(4))])
                 for _ in range(int(rng.integers(1, 4)))]
        plans = []
        for flat in start:
            n = int(rng.integers(1, max(2, int(flat.numel() * rng.choice([0.01, 0.2, 0.9])))))
            index = torch.from_numpy(np.sort(rng.choice(flat.numel(), n, replace=False)).astype(np.int64))
            values = torch.from_numpy(rng.integers(0, 255, n * flat.element_size(), dtype=np.uint8)).view(flat.dtype)
            plans.append((index, values))
        fault = rng.integers(len(start)) if rng.random() < 0.5 else None
        if fault is not None and plans[fault][0].numel() >= 2:
            index, values = plans[fault]
            numpy_chunk = ParamPatch("", start[fault], index, values, values).read_back_chunk()
            inside = [k for k in range(index.numel() - 1)
                      if (k + 1) % host_scatter.CHUNK and (k + 1) % numpy_chunk]
            k = int(rng.choice(inside)) if inside else None
        if fault is not None and plans[fault][0].numel() >= 2 and k is not None:
            index[k + 1] = index[k]
            values.view(torch.uint8).view(-1, values.element_size())[k + 1] ^= 1  # another value, same position
        ends = []
        for path in (compiled, None):
            monkeypatch.setattr(host_scatter, "_compiled", path)
            flats = [t.clone() for t in start]
            patches = [ParamPatch(f"p{i}", f, index, values, f[index].clone())
                       for i, (f, (index, values)) in enumerate(zip(flats, plans))]
            staged = StagedUpdate(0, 1, None, "", 0, patches=patches, restore_buffers=RestoreBuffers(patches))
            try:
                scatter_with_undo(staged)
                failed = False
            except WriteNotLanded:
                failed = True
            ends.append((failed, [f.view(torch.uint8).clone() for f in flats]))
        (fast_failed, fast), (slow_failed, slow) = ends
        assert fast_failed == slow_failed
        assert all(torch.equal(a, b) for a, b in zip(fast, slow))
        if fast_failed:
            assert all(torch.equal(a, s.view(torch.uint8)) for a, s in zip(fast, start))  # restored
        outcomes.add(fast_failed)
    assert outcomes == {True, False}  # the draw reached both ends
