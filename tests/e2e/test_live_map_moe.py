"""The coordinate map on an MoE model: sglang's own Qwen3-MoE class, in process.

sglang cannot serve an MoE on this CPU (its fused-MoE path needs sgl_kernel's CPU build or a
GPU), so the model object is built on the CPU in a single-process gloo group
(``live_moe_child.py``), mapped from its own ``load_weights`` (per-expert copies into the
stacked ``w13_weight`` / ``w2_weight``, fused qkv), proven, and patched; the patched weights
must equal what a real load of the new checkpoint gives, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def test_an_moe_model_is_mapped_proven_and_patched_bit_identical_to_a_reload():
    from testbed.sglang_cpu import cpu_server_env, find_free_port

    done = subprocess.run(
        [sys.executable, str(HERE / "live_moe_child.py"), str(find_free_port())],
        capture_output=True, text=True, timeout=600, env=cpu_server_env(), cwd=str(HERE.parents[1]),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["untouched_while_mapping"], "building the map wrote a parameter"
    assert "model.layers.0.mlp.experts.w13_weight" in out["params"]
    assert out["proven"] and not out["reload_only_params"] and not out["reload_only_tensors"], out
    assert set(out["proven_params"]) == set(out["params"])
    # one placement per expert tensor copy (gate, up -> w13; down -> w2), not per element
    assert out["expert_placements"] == out["expert_tensors"] == 2 * 4 * 3
    assert out["written"] == out["changed"] > 0
    assert out["pointers_unchanged"]
    assert out["bit_identical_to_reload"] == []
    print(f"\n[measured] Qwen3-MoE (2 layers, 4 experts): map built in {out['build_s']:.4f}s, {out['nbytes']} B")
