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
ALLOWED = ["qwen3", "qwen3_tied", "qwen2", "qwen2_tied", "llama", "qwen3_moe", "glm4_moe", "mla", "mla_v3", "glm4_moe_lite"]
MLA = ["mla", "mla_v3", "glm4_moe_lite"]


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
    assert out["check"]["mismatches"] == 0 and out["check"]["verified"] > 0, out["check"]
    print(f"\n[measured] {out['class']} ({family}): map built in {out['build_s']:.4f}s on a storage-free copy, "
          f"{out['nbytes']} B")


def test_qwen2s_qkv_biases_map_into_the_stacked_qkv_proj_bias(cases):
    out = _ok(cases, "qwen2")
    for p in "qkv":
        assert out["placements"][f"model.layers.0.self_attn.{p}_proj.bias"] == 1
    assert "model.layers.0.self_attn.qkv_proj.bias" in out["proven_params"]


def test_tied_embeddings_ignore_the_checkpoints_lm_head_as_a_reload_does(cases):
    tied, untied = _ok(cases, "qwen3_tied"), _ok(cases, "qwen3")
    assert tied["unused_tensors"] == ["lm_head.weight"]  # the loader never reads it: a reload ignores it too
    assert "lm_head.weight" in untied["placements"] and untied["unused_tensors"] == []


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "mla", "mla_v3", "glm4_moe_lite"])
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


@pytest.mark.parametrize("family", MLA)
def test_an_mla_models_w_kc_w_vc_are_re_derived_live_bit_identical_to_a_reload_after_an_apply_and_a_rollback(cases, family):
    out = _ok(cases, family)  # sglang's post_load_weights derives w_kc/w_vc from kv_b_proj after its copies
    kv_b = {f"model.layers.{k}.self_attn.kv_b_proj.weight" for k in (0, 1)}
    assert set(out["derived_params"]) == kv_b and set(out["derivations"]) == kv_b, out["derived_params"]
    assert not any("kv_b_proj" in n for n in out["why_reload_only"]), out["why_reload_only"]
    assert out["rederived"] == 2
    assert out["derived_tensors"] == sorted(f"model.layers.{k}.self_attn.{w}" for k in (0, 1) for w in ("w_kc", "w_vc"))
    # the apply did change them (five random elements per kv_b_proj: not always in both halves)
    assert out["derived_changed_by_apply"] and set(out["derived_changed_by_apply"]) <= set(out["derived_tensors"])
    # a rollback: the undo log (parameters only) restores kv_b_proj, the rule re-derives the rest exactly
    assert out["rollback_restored"] and out["differ_after_rollback"] == []
    assert not any(".w_kc" in n or ".w_vc" in n for n in out["undo_log_params"])
    assert out["differ_from_reload"] == []  # every parameter and every w_kc/w_vc, bit for bit
    assert out["pointers_unchanged"] and out["derived_pointers_unchanged"]  # copy_ into the existing storage
    assert out["check"]["mismatches"] == 0
    # the per-update check compares the re-derived tensors too: a stale element is a mismatch
    assert out["check_of_a_stale_w_kc"]["mismatches"] == 1
    assert "w_kc/w_vc" in out["check_of_a_stale_w_kc"]["detail"]


def test_an_mla_layer_whose_w_kc_is_not_the_plain_split_of_kv_b_proj_reloads_with_the_reason(cases):
    out = _ok(cases, "mla_w_kc_perturbed")  # layer 1's w_kc nudged after the load, before the proof
    param = "model.layers.1.self_attn.kv_b_proj.weight"
    assert "differ from the split of its kv_b_proj on 1 of" in out["reload_only_params"][param]
    assert out["derivations"] == ["model.layers.0.self_attn.kv_b_proj.weight"]  # layer 0 stays live
    assert "is reload-only" in out["why_reload_only"][param] and out["staging_refused"] == out["why_reload_only"][param]


def test_an_mla_layer_with_a_quantized_kv_b_proj_reloads_with_the_reason(cases):
    out = _ok(cases, "mla_quantized_kv_b")  # layer 1's kv_b_proj carries a weight_scale (sglang requantizes)
    param = "model.layers.1.self_attn.kv_b_proj.weight"
    assert "kv_b_proj has a weight_scale" in out["reload_only_params"][param]
    assert param not in out["derived_params"] and out["staging_refused"] == out["why_reload_only"][param]


@pytest.mark.parametrize("family", ["mla_v3", "glm4_moe_lite"])
def test_an_mla_q_a_and_kv_a_projection_fused_by_torch_cat_maps_one_placement_per_part(cases, family):
    # DeepSeek-V3 and GLM-4.7-Flash ship a q_lora_rank: sglang's loader torch.cat's q_a_proj and
    # kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa, then copies that in
    out = _ok(cases, family)
    for k in (0, 1):
        assert out["placements"][f"model.layers.{k}.self_attn.q_a_proj.weight"] == 1
        assert out["placements"][f"model.layers.{k}.self_attn.kv_a_proj_with_mqa.weight"] == 1
        assert f"model.layers.{k}.self_attn.fused_qkv_a_proj_with_mqa.weight" in out["proven_params"]


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
