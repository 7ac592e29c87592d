"""Shared checks of the trainer-side unit tests (``TorchWeightSync`` to a dir or a bucket URL:
``test_miles_torch_publish``, ``test_bucket_trainers``)."""

from __future__ import annotations

import torch


def assert_pulls_to(local, hf, source_dir, version, expected: dict) -> str:
    """Pull ``version`` into ``local``: it must hold exactly ``expected``'s names and bytes. -> the pull's action."""
    from testbed.tiny_qwen3 import read_state_dict
    from weightsync import pull

    result = pull(str(local), hf, source_dir, version)
    got = read_state_dict(local)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), f"v{version} {name}"
    return result.action
