"""The testbed's two commands the README's quickstart uses explain themselves (``--help``) and do
what it says: ``python -m testbed.tiny_qwen3 OUT --from MODEL`` writes MODEL's layout with a few
elements changed, as a training step would. (The quickstart itself runs in
``tests/e2e/test_readme_quickstart.py``, with a real server.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module,words", [
    ("testbed.sglang_cpu", ["MODEL", "--port", "(default: 30000", "--pull-weights-allowed-roots", "examples:"]),
    ("testbed.tiny_qwen3", ["OUT", "--from", "--change", "(default: 0.05)", "examples:"]),
])
def test_the_quickstarts_testbed_commands_explain_themselves_with_help(module, words):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for word in words:
        assert word in done.stdout, (module, word)


def test_a_trained_copy_keeps_the_models_layout_and_changes_about_the_asked_fraction(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(200, 100, generator=gen).bfloat16(), "b": torch.randn(300, generator=gen).bfloat16()}
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "step1"
    done = subprocess.run([sys.executable, "-m", "testbed.tiny_qwen3", str(out), "--from", str(model), "--step", "1",
                           "--change", "0.1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in model.iterdir())
    trained = load_file(str(out / "model.safetensors"))
    changed = total = 0
    for name, before in tensors.items():
        after = trained[name]
        assert after.dtype == before.dtype and after.shape == before.shape, name
        changed += int((after.view(torch.int16) != before.view(torch.int16)).sum())
        total += before.numel()
    assert 0.05 < changed / total < 0.15  # about the 10% asked for (noise that rounds to no change is rare)
