"""Binding ``--update-weight-converter``: builtin, the host trainer's ``convert_to_hf``, an import path.

miles and slime are not installable here (miles' package needs ray and sglang at import, slime is not on
PyPI), so the trainer binding is checked with a stand-in ``convert_to_hf`` of their signature; the
contract it binds is exercised on real Megatron ranks in ``test_miles_converter_hook.py`` and
``tests/e2e/megatron/test_family_*.py``.
"""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from miles_updater.converters import BuiltinConverter, ConverterError, TrainerConverter, resolve_converter
from miles_updater.hf_mapping import AttentionLayout

ATT = AttentionLayout(4, 2, 8)


@pytest.fixture
def hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 32, "moe_intermediate_size": 8, "n_routed_experts": 2,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return str(tmp_path)


def test_builtin_is_the_default_and_knows_the_checkpoints_family(hf_dir):
    conv = resolve_converter(None, hf_checkpoint=hf_dir, att=ATT, tied_embeddings=False)
    assert isinstance(conv, BuiltinConverter) and conv.model_type == "glm4_moe"
    out = conv("decoder.layers.0.mlp.router.expert_bias", torch.zeros(2))
    assert [n for n, _ in out] == ["model.layers.0.mlp.gate.e_score_correction_bias"]


@pytest.mark.parametrize("framework", ["miles", "slime"])
def test_the_trainer_converter_is_bound_as_miles_and_slime_bind_their_own(hf_dir, framework):
    calls = []
    module = types.SimpleNamespace(_cached_tensors={"q_a_proj": 1})

    def convert_to_hf(args, model_name, name, param, quantization_config=None, **kw):
        calls.append((args, model_name, name, quantization_config, kw))
        return [("x", param)]

    args = SimpleNamespace(model_name=None)
    conv = TrainerConverter(args, hf_dir, framework=framework, convert_to_hf=convert_to_hf, module=module)
    assert [n for n, _ in conv("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(1))] == ["x"]
    (a, model_name, name, qc, kw) = calls[0]
    assert a is args and model_name == "glm4moeconfig" and name == "module.module.decoder.layers.0.mlp.linear_fc2.weight"
    assert qc["quant_method"] == "fp8"
    assert kw == ({"transform_ue8m0": False} if framework == "slime" else {})
    conv.reset()
    assert module._cached_tensors == {}
    args.model_name = "glm4moe"
    assert TrainerConverter(args, hf_dir, framework=framework, convert_to_hf=convert_to_hf, module=module).model_name == "glm4moe"


def test_the_trainer_converter_without_miles_or_slime_says_which_imports_failed(hf_dir, monkeypatch):
    for name in ("miles", "slime"):
        monkeypatch.setitem(sys.modules, name, None)  # import of either fails
    with pytest.raises(ConverterError, match="needs miles or slime importable"):
        resolve_converter("trainer", args=SimpleNamespace(), hf_checkpoint=hf_dir, att=ATT, tied_embeddings=False)


def test_an_import_path_converter_is_called_with_the_trainers_args(hf_dir, monkeypatch):
    mod = types.ModuleType("my_conv_mod")
    mod.make = lambda args: (lambda n, t: [(args.prefix + n, t)])
    monkeypatch.setitem(sys.modules, "my_conv_mod", mod)
    conv = resolve_converter("my_conv_mod.make", args=SimpleNamespace(prefix="hf."), hf_checkpoint=hf_dir, att=ATT,
                             tied_embeddings=False)
    assert conv("a", 1) == [("hf.a", 1)]


@pytest.mark.parametrize("spec,match", [("nomodule", "not an import path"), ("no_such_mod_xyz.fn", "cannot be imported")])
def test_a_converter_spec_that_cannot_be_bound_is_refused_naming_it(hf_dir, spec, match):
    with pytest.raises(ConverterError, match=match):
        resolve_converter(spec, hf_checkpoint=hf_dir, att=ATT, tied_embeddings=False)


def test_the_flag_reaches_the_config_and_a_bad_value_is_refused(tmp_path):
    import argparse

    from miles_updater.args import UpdateWeightArgsError, add_update_weight_arguments, validate_update_weight_args

    hf = tmp_path / "hf"
    hf.mkdir()
    base = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(tmp_path / "d"),
            "--update-weight-local-checkpoint-dir", str(tmp_path / "l"), "--hf-checkpoint", str(hf)]
    parser = add_update_weight_arguments(argparse.ArgumentParser())
    cfg = validate_update_weight_args(parser.parse_args(
        base + ["--update-weight-converter", "trainer", "--update-weight-static-tensors", "model.visual.*"]))
    assert cfg.converter == "trainer" and cfg.static_tensors == ("model.visual.*",)
    assert validate_update_weight_args(parser.parse_args(base)).converter == "builtin"
    with pytest.raises(UpdateWeightArgsError, match="--update-weight-converter"):
        validate_update_weight_args(parser.parse_args(base + ["--update-weight-converter", "nonsense"]))
