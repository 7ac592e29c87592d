"""Live apply's allow-list, proven in process with sglang's own model classes.

sglang cannot serve these models' MoE layers on this CPU (its fused-MoE path needs
sgl_kernel's CPU build or a GPU), so each class is built on the CPU in a one-rank gloo group
(``live_models_child.py``, one child for the module): the map is learnt on a storage-free copy
(the serving model's parameters, pointers and module attributes stay untouched), proven after a
real load, five elements of every mapped tensor are patched live, and every parameter must then
equal, bit for bit, what a real load of the new version gives. The cases live apply must refuse
are built the same way: each is reload-only with its reason.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ALLOWED = ["qwen3", "qwen3_tied", "llama", "qwen3_moe", "glm4_moe"]


@pytest.fixture(scope="module")
def cases():
    from testbed.sglang_cpu import cpu_server_env, find_free_port, server_python

    done = subprocess.run(  # the version matrix points server_python at sglang 0.5.16's venv
        [server_python(), str(HERE / "live_models_child.py"), str(find_free_port())],
        capture_output=True, text=True, timeout=900, env=cpu_server_env(), cwd=str(HERE.parents[1]),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ok(cases, name):
    out = cases[name]
    assert "error" not in out, out.get("traceback", out)
    return out


@pytest.mark.parametrize("family", ALLOWED)
def test_each_allow_listed_class_is_mapped_on_a_copy_proven_and_patched_bit_identical_to_a_reload(cases, family):
    out = _ok(cases, family)
    assert out["scope"] is None, out["scope"]  # on the allow-list, no engine-wide reason
    assert out["untouched_while_mapping"], "learning the map wrote a serving parameter"
    assert out["tree_unchanged_while_mapping"], "learning the map changed the serving model's tree or attributes"
    assert out["proven"] and not out["reload_only_params"] and not out["reload_only_tensors"], out
    assert set(out["proven_params"]) == set(out["params"])
    assert out["written"] == out["changed"] > 0
    assert out["pointers_unchanged"]
    assert out["differ_from_reload"] == []
    print(f"\n[measured] {out['class']} ({family}): map built in {out['build_s']:.4f}s on a storage-free copy, "
          f"{out['nbytes']} B")


def test_tied_embeddings_ignore_the_checkpoints_lm_head_as_a_reload_does(cases):
    tied, untied = _ok(cases, "qwen3_tied"), _ok(cases, "qwen3")
    assert tied["unused_tensors"] == ["lm_head.weight"]  # the loader never reads it: a reload ignores it too
    assert "lm_head.weight" in untied["placements"] and untied["unused_tensors"] == []


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_moe_experts_map_as_one_placement_per_expert_tensor(cases, family):
    out = _ok(cases, family)
    experts = {n: k for n, k in out["placements"].items() if ".experts." in n}
    assert experts and all(k == 1 for k in experts.values())
    assert len(experts) == sum(1 for n in out["tensors"] if ".experts." in n)


def test_a_one_element_parameter_loaded_through_item_is_reload_only_not_unused(cases):
    out = _ok(cases, "scalar_parameter")  # sglang's default_weight_loader: fill_(loaded_weight.item())
    assert "gate.weight" not in out["unused_tensors"]
    assert ".item()" in out["reload_only_tensors"]["gate.weight"]
    assert out["why_gate"].startswith("checkpoint tensor gate.weight is reload-only")
    assert out["why_proj"] is None and out["proven_params"] == ["proj"]


def test_an_mla_model_whose_loader_derives_w_kc_w_vc_after_its_copies_reloads_with_the_reason(cases):
    out = _ok(cases, "mla")  # sglang's DeepseekV2ForCausalLM: post_load_weights derives them from kv_b_proj
    assert "DeepseekV2ForCausalLM" in out["scope"] and "not on live apply's allow-list" in out["scope"]
    reason = out["kv_b_proj_reload_only"]["model.layers.0.self_attn.kv_b_proj.weight"]
    assert "state derived from it" in reason
    assert "is reload-only" in out["why_kv_b_tensor"]
    # post_load_weights ran on the copy: the serving attention module gained nothing from the mapping
    assert out["serving_w_kc_w_vc_untouched"]
    assert out["w_kc_w_vc_after_a_real_load"] == {"w_kc": "Tensor", "w_vc": "Tensor"}


def test_sglangs_own_refusal_of_online_updates_makes_live_apply_reload_with_sglangs_reason(cases):
    out = _ok(cases, "sglang_refusal")
    assert out["clean"] is None
    if out["sglang_has_the_check"]:  # 0.5.23; 0.5.16 has no such check
        assert out["sglang_reason"]
        assert out["refused"] == f"sglang refuses online weight updates of this model: {out['sglang_reason']}"
    else:
        assert out["refused"] is None


def test_a_model_class_off_the_allow_list_reloads_with_the_reason(cases):
    why = _ok(cases, "off_the_list")["why"]  # Phi3ForCausalLM subclasses LlamaForCausalLM: not enough
    assert why.startswith("model class Phi3ForCausalLM") and "is not on live apply's allow-list" in why
