"""The README's Python examples run as shown: "The core in five lines" publishes and pulls a bf16
checkpoint (placeholder paths swapped for temp dirs, nothing else touched), and its one-line
recipe for a torch bf16 tensor makes a ``RawTensor`` the core publishes and pulls byte for byte.
The quickstart's shell block runs in ``tests/e2e/test_readme_quickstart.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from weightsync import Publisher, RawTensor, pull  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_starts_with_make_demo_and_make_test_then_reads_in_a_users_order():
    text = README.read_text()
    assert text.split("\n```bash\n", 1)[1].startswith("make demo\nmake test\n```")  # the developers' guide asks it
    headings = re.findall(r"^## (.+)$", text, re.M)
    users_order = ["Install", "Quickstart", "From any PyTorch trainer", "The trainer side", "Guarantees"]
    positions = [next(i for i, h in enumerate(headings) if h.startswith(title)) for title in users_order]
    assert positions == sorted(positions), headings
    assert positions[0] == 0  # what it is: the lines before the first heading


def write_bf16_checkpoint(directory: Path, tensors: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "toy"}))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def local_tensors(directory) -> dict:
    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.fixture
def bf16_model(fast_tmp_path):
    gen = torch.Generator().manual_seed(3)
    t0 = {"model.embed.weight": torch.randn(64, 32, generator=gen).bfloat16(),
          "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=gen).bfloat16(),
          "model.norm.weight": torch.randn(32, generator=gen).bfloat16()}
    t1 = {n: t.clone() for n, t in t0.items()}
    t1["model.layers.0.mlp.up_proj.weight"][3, :7] += 1.0  # a training step changed a few elements
    write_bf16_checkpoint(fast_tmp_path / "models" / "qwen3", t0)
    write_bf16_checkpoint(fast_tmp_path / "ckpts" / "step1", t1)
    return fast_tmp_path, t0, t1


def test_the_core_in_five_lines_runs_as_shown_on_a_bf16_checkpoint(bf16_model):
    root, _, t1 = bf16_model
    [code] = re.findall(r"```python\n(.*?)```", readme_section("The core in five lines"), re.S)
    statements = [line for line in code.splitlines() if line.strip() and not line.startswith(("from ", "import "))]
    assert len(statements) <= 5, statements  # the title's promise
    for placeholder in ("/shared/run1", "/models/qwen3", "/ckpts/step1", "/local/ckpt"):
        assert placeholder in code
        code = code.replace(f'"{placeholder}"', repr(str(root) + placeholder))
    exec(compile(code, str(README), "exec"), {})
    got = local_tensors(root / "local" / "ckpt")
    assert set(got) == set(t1)
    for name, tensor in t1.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


def test_the_readmes_torch_bf16_recipe_makes_a_raw_tensor_the_core_publishes_byte_for_byte(bf16_model):
    root, t0, t1 = bf16_model
    [recipe] = re.findall(r"`(RawTensor\(\"BF16\".*?\))`", readme_section("The core in five lines"))
    pub = Publisher(str(root / "run"), template_dir=str(root / "models" / "qwen3"))
    pub.seed_snapshot_from_checkpoint(str(root / "models" / "qwen3"))
    step = {}
    for name, tensor in t1.items():
        t = tensor.t().t()  # any torch bf16 tensor
        step[name] = eval(recipe, {"RawTensor": RawTensor, "torch": torch, "t": t})
    assert pub.publish(1, step).kind == "delta"
    pub.close()
    pull(str(root / "local"), seed_dir=str(root / "models" / "qwen3"), source_dir=str(root / "run"), target_version=1)
    got = local_tensors(root / "local")
    for name, tensor in t1.items():
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    assert not torch.equal(t0["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"])


def test_torch_weight_syncs_source_dir_is_the_run_dir_the_command_line_reads(tmp_path, capsys):
    """The README's "From any PyTorch trainer": ``sync.source_dir`` is what to hand to
    ``weightsync inspect`` / ``verify --source-dir``."""
    from miles_updater.torch_publish import TorchWeightSync
    from testbed.tiny_qwen3 import make_tiny_qwen3, perturb_state_dict, read_state_dict
    from weightsync.cli import main

    assert "sync.source_dir" in readme_section("From any PyTorch trainer")
    hf = make_tiny_qwen3(tmp_path / "qwen3")
    sync = TorchWeightSync(str(tmp_path / "shared"), hf)
    sync.publish(perturb_state_dict(read_state_dict(hf), 1))
    sync.close()
    assert os.path.dirname(sync.source_dir) == str(tmp_path / "shared")
    assert main(["inspect", sync.source_dir, "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)] == [1]
    local = str(tmp_path / "local")
    pull(local, seed_dir=hf, source_dir=sync.source_dir, target_version=1)
    assert main(["verify", local, "--source-dir", sync.source_dir, "--version", "1", "--seed-dir", hf]) == 0
