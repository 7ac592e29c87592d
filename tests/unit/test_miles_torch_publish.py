"""Publishing from a plain PyTorch model: checks against the checkpoint, reused buffers, the
device-side compare, retries and restarts. The core's ``pull`` reads every version back, as an
engine host would; the real sglang server is exercised in tests/e2e/test_trainer_e2e.py.
"""

from __future__ import annotations

import errno

import pytest
import torch

from miles_updater.torch_publish import StateDictStager, TorchPublishError, TorchWeightSync
from weightsync.errors import HostResourceError

from trainer_support import assert_pulls_to


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from testbed.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("hf") / "ckpt", seed=2)


@pytest.fixture
def model(hf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)  # trained in fp32, published as bf16


def _step(model, k: int) -> None:
    """A real optimizer step on a fixed batch (AdamW)."""
    opt = getattr(model, "_test_opt", None) or torch.optim.AdamW(model.parameters(), lr=1e-4)
    model._test_opt = opt
    ids = torch.arange(32).reshape(2, 16) * (k + 3) % 1000
    loss = model(ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_each_publish_holds_exactly_the_models_bytes_in_the_checkpoint_dtype(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    local = tmp_path / "local"
    for k in range(1, 4):
        _step(model, k)
        m = sync.publish(model)
        assert m.version == k and m.kind == "delta" and 0 < m.changed_elements < m.total_elements
        expected = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
        assert assert_pulls_to(local, hf, sync.source_dir, k, expected) == ("seed+chain" if k == 1 else "chain")
    sync.close()


def test_staging_buffers_are_allocated_once_and_reused(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    sync.publish(model)
    ptrs = {n: t.data_ptr() for n, t in sync.published_state_dict().items()}
    _step(model, 1)
    sync.publish(model)
    assert {n: t.data_ptr() for n, t in sync.published_state_dict().items()} == ptrs
    sync.close()


def test_names_shapes_and_dtypes_are_checked_against_the_checkpoint_before_publishing(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    state = dict(model.state_dict())
    state["model.extra.weight"] = torch.zeros(3)
    del state["model.norm.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"].to(torch.int64)
    with pytest.raises(TorchPublishError) as info:
        sync.publish(state)
    problems = info.value.problems
    assert "model.extra.weight is not in the checkpoint" in problems
    assert "model.norm.weight is missing" in problems
    assert any(p.startswith("model.layers.0.mlp.up_proj.weight: shape") for p in problems)
    assert any(p.startswith("model.layers.1.mlp.up_proj.weight: dtype torch.int64") for p in problems)
    assert sync.version == 0 and not any(p.name.startswith("weight_v") for p in (tmp_path / "shared").glob("*/*"))
    sync.close()


def test_a_tied_alias_of_a_checkpoint_tensor_is_not_published_twice(hf, model):
    stager = StateDictStager(hf)
    state = dict(model.state_dict())
    state["model.embed_tokens_alias.weight"] = state["model.embed_tokens.weight"]  # same storage
    stager.stage(state)
    assert "model.embed_tokens_alias.weight" not in stager.raw_tensors()


def test_device_compare_moves_only_changed_elements_and_stages_the_same_bytes(hf, model):
    """The device path (CUDA in production) run on CPU tensors: same code, same bytes."""
    on_device, plain = StateDictStager(hf, device_compare=True), StateDictStager(hf)
    for stager in (on_device, plain):
        stager.stage(model.state_dict())
    full = on_device.d2h_nbytes
    assert full == on_device.staging_nbytes()
    with torch.no_grad():
        w = model.model.layers[0].mlp.up_proj.weight
        w.view(-1)[:5] += 1.0
    on_device.dirty.clear()
    for stager in (on_device, plain):
        stager.stage(model.state_dict())
    assert on_device.dirty == {"model.layers.0.mlp.up_proj.weight"}  # only it crosses to the core
    assert 0 < on_device.d2h_nbytes <= 5 * (8 + 2)  # positions (int64) and bf16 values
    for name, t in plain.published_state_dict().items():
        assert torch.equal(on_device.published_state_dict()[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_is_compared_on_the_device(hf, model, tmp_path):
    model = model.cuda()
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    sync.publish(model)
    _step_cuda = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = (torch.arange(32).reshape(2, 16) % 1000).cuda()
    model(ids, labels=ids).loss.backward()
    _step_cuda.step()
    m = sync.publish(model)
    assert 0 < m.d2h_nbytes < m.full_nbytes
    expected = {n: t.detach().to(torch.bfloat16).cpu() for n, t in model.state_dict().items()}
    assert_pulls_to(tmp_path / "local", hf, sync.source_dir, 2, expected)
    sync.close()


def test_a_failed_shard_write_is_retried_with_the_same_version(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf, retry_backoff_s=0.0)
    write, calls = sync.publisher.write, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(*args, **kwargs)

    sync.publisher.write = failing_once
    _step(model, 1)
    m = sync.publish(model)
    assert m.version == 1 and m.publish_attempts == 2
    expected = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert_pulls_to(tmp_path / "local", hf, sync.source_dir, 1, expected)
    sync.close()


def test_a_restarted_trainer_continues_the_numbering_with_a_full_version(hf, model, tmp_path):
    disk = str(tmp_path / "shared")
    first = TorchWeightSync(disk, hf, run_id="job7")
    for k in (1, 2):
        _step(model, k)
        first.publish(model)
    first.close()
    again = TorchWeightSync(disk, hf, run_id="job7")
    _step(model, 3)
    m = again.publish(model)
    assert (m.version, m.kind) == (3, "full") and "stable run id" in m.reason
    fresh = TorchWeightSync(disk, hf)
    m = fresh.publish(model)
    assert (m.version, m.kind) == (4, "full") and "an earlier run" in m.reason
    expected = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert assert_pulls_to(tmp_path / "local", hf, fresh.source_dir, 4, expected) == "seed"


def _transposed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same values as ``t`` held with transposed strides (as a parameter tied to a .t() would be)."""
    out = torch.empty(tuple(reversed(t.shape)), dtype=dtype).t()
    out.copy_(t)
    assert not out.is_contiguous()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["cast", "checkpoint-dtype"])
def test_a_transposed_parameter_is_staged_by_the_device_compare_like_any_other(hf, model, dtype):
    on_device, plain = StateDictStager(hf, device_compare=True), StateDictStager(hf)
    name = "model.layers.0.mlp.up_proj.weight"
    weight = model.model.layers[0].mlp.up_proj.weight

    def state():
        return {**model.state_dict(), name: _transposed(weight.detach(), dtype)}

    for k in range(3):  # the first stage copies whole; the later ones compare (where it used to raise)
        with torch.no_grad():
            weight[k, :3] += 1.0
        on_device.dirty.clear()
        for stager in (on_device, plain):
            stager.stage(state())
        assert on_device.dirty == ({name} if k else set(on_device.specs))
        staged = on_device.published_state_dict()
        for n, t in plain.published_state_dict().items():
            assert torch.equal(staged[n].view(torch.uint8), t.view(torch.uint8)), (k, n)
    assert on_device.d2h_nbytes <= 3 * (8 + 2)  # the compare moved only the three changed elements


class _FailingCopy(torch.Tensor):
    """A parameter whose ``fail_at``-th ``fail_op`` call fails (a device error: no other way on the CPU).

    Results of ops on it are of this class too, so a failure can be placed on any write of the staging.
    """

    fail_op, fail_at, calls = "", 0, 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.fail_op and getattr(func, "__name__", "") == cls.fail_op:
            cls.calls += 1
            if cls.calls == cls.fail_at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("device_compare,fail_op,fail_at", [
    (True, "to", 1),  # the cast, before anything is written
    (True, "__setitem__", 2),  # the host write, after the device snapshot took the new values
    (None, "copy_", 1),  # the plain path's copy into the host buffer
], ids=["compare-cast", "compare-host-write", "plain-copy"])
def test_a_stage_failing_midway_is_typed_and_hands_out_nothing_until_a_stage_succeeds(
        hf, model, device_compare, fail_op, fail_at):
    from miles_updater.torch_publish import StagingError

    stager, reference = StateDictStager(hf, device_compare=device_compare), StateDictStager(hf)
    early, failing = "model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"
    order = list(model.state_dict())
    assert order.index(early) < order.index(failing)  # `early` is staged before the failure
    stager.stage(model.state_dict())
    stager.dirty.clear()  # v1 published
    with torch.no_grad():
        model.model.embed_tokens.weight[0, :4] += 1.0
        model.model.layers[1].mlp.down_proj.weight[0, :4] += 1.0
    state = dict(model.state_dict())
    state[failing] = state[failing].as_subclass(_FailingCopy)
    _FailingCopy.fail_op, _FailingCopy.fail_at, _FailingCopy.calls = fail_op, fail_at, 0
    try:
        with pytest.raises(StagingError) as e:
            stager.stage(state)
    finally:
        _FailingCopy.fail_op = ""
    assert e.value.name == failing and "illegal memory access" in str(e.value)
    assert "strides" in str(e.value) and "stage again" in str(e.value)
    with pytest.raises(StagingError):  # the buffers mix two steps: none is handed to a publish
        stager.raw_tensors()
    with pytest.raises(StagingError):
        stager.published_state_dict()
    stager.stage(model.state_dict())  # the cause is gone: a complete stage
    reference.stage(model.state_dict())
    assert {early, failing} <= stager.dirty  # both reach the core, though neither changed again
    staged = stager.raw_tensors()
    for n, t in reference.raw_tensors().items():
        assert bytes(staged[n].data) == bytes(t.data), n


def test_a_meta_or_sparse_tensor_is_refused_before_anything_is_staged(hf, model):
    stager = StateDictStager(hf, device_compare=True)
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.empty(state["model.norm.weight"].shape, device="meta")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to_sparse()
    with pytest.raises(TorchPublishError, match="model.norm.weight: a meta tensor") as e:
        stager.stage(state)
    assert "model.layers.0.mlp.up_proj.weight: a torch.sparse_coo tensor" in str(e.value)
    assert stager.published_state_dict() == {}  # nothing was staged


# --- one contract for a version whose publish failed (issue 21 point 1) ----------------------------


def _bf16(model) -> dict:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}


def _fail_index_writes(monkeypatch, version: int) -> dict:
    """ENOSPC on ``version``'s index write until ``state["on"]`` is cleared (the disk recovers)."""
    import os

    import weightsync.publisher.publish as publish_mod

    real, state = publish_mod.write_bytes, {"on": True, "hits": 0}

    def failing(path, data, **kw):
        if state["on"] and path.endswith(os.path.join(f"weight_v{version:06d}", "model.safetensors.index.json")):
            state["hits"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, data, **kw)

    monkeypatch.setattr(publish_mod, "write_bytes", failing)
    return state


def test_after_every_index_write_of_a_version_failed_the_next_publish_finishes_it_then_publishes_a_delta(
        hf, model, tmp_path, monkeypatch):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf, retry_backoff_s=0.0, publish_attempts=2)
    _step(model, 1)
    sync.publish(model)
    at = {1: _bf16(model)}
    _step(model, 2)
    disk = _fail_index_writes(monkeypatch, 2)
    with pytest.raises(OSError, match="No space left"):
        sync.publish(model)
    assert disk["hits"] == 2 and sync.version == 1 and sync.publisher.pending_version == 2
    at[2] = _bf16(model)  # what v2 was staged with
    _step(model, 3)
    with pytest.raises(OSError):  # the disk has not recovered: still pending, still v2 next
        sync.publish(model)
    assert sync.publisher.pending_version == 2
    disk["on"] = False  # recovered
    _step(model, 4)
    m = sync.publish(model)
    at[3] = _bf16(model)
    assert (m.version, m.kind) == (3, "delta")
    finished = [h for h in sync.history if h.version == 2]
    assert len(finished) == 1 and "finishing v2" in finished[0].reason
    assert [h.version for h in sync.history] == [1, 2, 3]
    local = tmp_path / "local"
    assert assert_pulls_to(local, hf, sync.source_dir, 1, at[1]) == "seed+chain"
    assert assert_pulls_to(local, hf, sync.source_dir, 2, at[2]) == "chain"  # the staged bytes, not step 3's or 4's
    assert assert_pulls_to(local, hf, sync.source_dir, 3, at[3]) == "chain"
    sync.close()


def test_a_prune_failing_after_the_index_landed_counts_the_version_as_published(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf, retry_backoff_s=0.0, publish_attempts=2)
    sync.start()
    prune, failures = sync.publisher.retention.prune, {"left": 1}

    def flaky_prune():
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error while pruning")
        return prune()

    sync.publisher.retention.prune = flaky_prune
    _step(model, 1)
    m = sync.publish(model)  # the retry within the call recognises v1 as published
    assert (m.version, m.publish_attempts) == (1, 2)
    at = {1: _bf16(model)}
    failures["left"] = 2  # every attempt at v2 fails after its index landed
    _step(model, 2)
    with pytest.raises(OSError, match="while pruning"):
        sync.publish(model)
    at[2] = _bf16(model)
    assert sync.version == 1 and sync.publisher.version == 2  # on disk, not yet counted by the trainer
    _step(model, 3)
    m = sync.publish(model)  # v2 is counted (pruning redone), then the new weights are v3
    at[3] = _bf16(model)
    assert (m.version, m.kind) == (3, "delta")
    assert [h.version for h in sync.history] == [1, 2, 3]
    local = tmp_path / "local"
    for v in (1, 2, 3):
        assert_pulls_to(local, hf, sync.source_dir, v, at[v])
    sync.close()


def test_a_publish_failing_before_any_shard_was_written_publishes_that_number_with_the_next_weights(
        hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf, retry_backoff_s=0.0, publish_attempts=2)
    sync.start()
    real = sync.publisher.encoder.prepare

    def encoder_out_of_memory(*a, **kw):
        raise MemoryError("encoder ran out of memory")

    sync.publisher.encoder.prepare = encoder_out_of_memory
    _step(model, 1)
    with pytest.raises(HostResourceError, match="ran out of memory"):  # the core types it (a retryable OSError)
        sync.publish(model)
    assert sync.publisher.pending_version is None  # nothing was written: nothing to finish
    sync.publisher.encoder.prepare = real
    _step(model, 2)
    m = sync.publish(model)
    assert (m.version, m.kind) == (1, "delta")
    assert_pulls_to(tmp_path / "local", hf, sync.source_dir, 1, _bf16(model))
    sync.close()


def test_the_timeout_flags_reach_the_clients_torch_weight_sync_builds(hf, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf, local_checkpoint_dir=str(tmp_path / "local"),
                           engines=["http://127.0.0.1:9", "http://127.0.0.1:10"], engine_timeout_s=7.0,
                           pull_timeout_s=70.0, not_ready_retry_s=0.7)
    assert [(c.timeout_s, c.pull_timeout_s, c.not_ready_retry_s) for c in sync.engine_sync.engines.clients] == [
        (7.0, 70.0, 0.7)] * 2
    sync.close()


def test_the_metrics_kept_over_many_publishes_are_the_last_n_and_totals_of_all(hf, model, tmp_path):
    import gc
    import weakref

    sync = TorchWeightSync(str(tmp_path / "shared"), hf, history_size=3)
    m = sync.publish(model)
    first, wire = weakref.ref(m), m.wire_nbytes
    for k in range(1, 40):
        _step(model, k)
        wire += sync.publish(model).wire_nbytes
    del m
    gc.collect()
    assert first() is None  # the first sync's metrics are gone, not kept forever
    assert [m.version for m in sync.history] == [38, 39, 40]
    t = sync.history.totals
    assert (t.syncs, t.first_version, t.last_version, t.wire_nbytes) == (40, 1, 40, wire)  # the dropped ones too
    sync.close()
