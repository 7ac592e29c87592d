"""Publishing from a plain PyTorch model: checks against the checkpoint, reused buffers, the
device-side compare, retries and restarts. The core's ``pull`` reads every version back, as an
engine host would; the real sglang server is exercised in tests/e2e/test_trainer_e2e.py.
"""

from __future__ import annotations

import errno

import pytest
import torch

from miles_updater.torch_publish import StateDictStager, TorchPublishError, TorchWeightSync


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


def _assert_pulls_to(local, hf, source_dir, version, expected: dict) -> str:
    from testbed.tiny_qwen3 import read_state_dict
    from weightsync import pull

    result = pull(str(local), hf, source_dir, version)
    got = read_state_dict(local)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), f"v{version} {name}"
    return result.action


def test_each_publish_holds_exactly_the_models_bytes_in_the_checkpoint_dtype(hf, model, tmp_path):
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    local = tmp_path / "local"
    for k in range(1, 4):
        _step(model, k)
        m = sync.publish(model)
        assert m.version == k and m.kind == "delta" and 0 < m.changed_elements < m.total_elements
        expected = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
        assert _assert_pulls_to(local, hf, sync.source_dir, k, expected) == ("seed+chain" if k == 1 else "chain")
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
    _assert_pulls_to(tmp_path / "local", hf, sync.source_dir, 2, expected)
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
    _assert_pulls_to(tmp_path / "local", hf, sync.source_dir, 1, expected)
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
    assert _assert_pulls_to(tmp_path / "local", hf, fresh.source_dir, 4, expected) == "seed"
