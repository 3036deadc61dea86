"""Quantized MoE checkpoints (Qwen3-VL-30B-A3B-Instruct-FP8's layout: one projection per expert,
each quantized, the routers dense) on the engine, in each format: greedy tokens == `transformers`'
monolithic model on the same checkpoint dequantized in float64 (`tests.support.quantized_reference`,
the experts stacked back), float64 on both sides; the experts held as stored; bad ones refused
with the tensor named."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.cases import CASE_TOKENS, family_cases
from tests.support.pipeline import served_generate
from tests.support.quantized_reference import dequantize_awq, edit_tensors
from tests.support.reference import reference_generate

FAMILY = "qwen3_vl_moe"
FORMATS = ("fp8-block", "fp8-channel", "awq")
EXPERTS = "model.language_model.layers.1.mlp.experts"
SCALE = {"fp8-block": "weight_scale_inv", "fp8-channel": "weight_scale", "awq": "scales"}


@pytest.mark.parametrize("quantization,case", [("fp8-block", "text_only"), ("fp8-block", "one_image"),
                                               ("fp8-channel", "one_image"), ("awq", "text_only"),
                                               ("awq", "one_image")])
def test_greedy_tokens_equal_dequantized_monolithic(quantized_checkpoint, quantization, case):
    model_dir, reference_dir = quantized_checkpoint(FAMILY, quantization)
    messages, max_tokens = family_cases(FAMILY)[case], CASE_TOKENS[FAMILY]
    expected = reference_generate(reference_dir, messages, max_tokens)
    assert len(expected) == max_tokens
    assert served_generate(model_dir, messages, max_tokens) == expected


def test_checkpoint_stores_one_quantized_projection_per_expert(quantized_checkpoint):
    from mmserve.checkpoint import stored_tensors
    from mmserve.tiny.qwen3_vl_moe import NUM_EXPERTS

    model_dir, _ = quantized_checkpoint(FAMILY, "fp8-block")
    tensors = {t.key: (t.dtype, t.shape) for t in stored_tensors(os.path.join(model_dir, "model.safetensors"))}
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors)
    for j in range(NUM_EXPERTS):
        assert tensors[f"{EXPERTS}.{j}.gate_proj.weight"] == (torch.float8_e4m3fn, (48, 64))
        assert tensors[f"{EXPERTS}.{j}.down_proj.weight_scale_inv"] == (torch.float32, (4, 3))  # 16 x 16 blocks
    router = "model.language_model.layers.1.mlp.gate"
    assert tensors[router + ".weight"][0] == torch.float32
    q = json.loads(Path(model_dir, "config.json").read_text())["quantization_config"]
    assert router in q["modules_to_not_convert"]


@pytest.mark.parametrize("quantization", FORMATS)
def test_experts_are_held_as_stored(quantized_checkpoint, quantization):
    from llm_service.model import experts, layers
    from llm_service.model.language_model import LanguageModel, weight_split
    from llm_service.model.quantized import ExpertsWeights

    lm = LanguageModel(quantized_checkpoint(FAMILY, quantization)[0], dtype="bfloat16")
    layer = lm.modules.decoder.layers[1]
    assert experts.is_experts(layer.mlp.experts)
    gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
    assert isinstance(gate_up, ExpertsWeights) and gate_up.shape == (16, 96, 64) and down.shape == (16, 64, 48)
    stored = {n: p.dtype for n, p in layer.mlp.experts.named_parameters()}
    assert all(dtype in (torch.float8_e4m3fn, torch.float32, torch.int32, torch.float16) for dtype in stored.values())
    assert isinstance(layer.self_attn.q_proj, layers.Linear) and layer.self_attn.q_proj.quantization is lm.quantization
    assert layer.mlp.gate.weight.dtype == torch.bfloat16  # the router as stored (dense), in the compute dtype
    assert sum(p.nbytes for p in lm.modules.parameters()) == weight_split(lm.model_dir, "bfloat16")[0]  # as stored


@pytest.mark.parametrize("quantization", FORMATS)
def test_one_expert_dequantized_equals_the_reference(quantized_checkpoint, quantization):
    from safetensors.torch import load_file

    from llm_service.model.language_model import LanguageModel

    model_dir, reference_dir = quantized_checkpoint(FAMILY, quantization)
    held = LanguageModel(model_dir, dtype="float64").modules.decoder.layers[1].mlp.experts
    reference = load_file(os.path.join(reference_dir, "model.safetensors"))
    for name in ("gate_up_proj", "down_proj"):
        stacked = reference[f"{EXPERTS}.{name}"]
        assert torch.equal(getattr(held, name).dense(torch.float64, 7), stacked[7])
        assert torch.equal(getattr(held, name).dense(torch.float64), stacked)


# Refusals: a copy of the tiny checkpoint, edited.

def _load_error(model_dir) -> str:
    from llm_service.model.language_model import LanguageModel

    with pytest.raises(ValueError) as e:
        LanguageModel(model_dir, dtype="float32")
    return str(e.value)


@pytest.mark.parametrize("quantization", FORMATS)
def test_missing_expert_scale_is_refused(quantized_checkpoint, tmp_path, quantization):
    model_dir = shutil.copytree(quantized_checkpoint(FAMILY, quantization)[0], tmp_path / "model")
    missing = f"{EXPERTS}.5.up_proj.{SCALE[quantization]}"
    edit_tensors(model_dir, lambda t: t.pop(missing))
    assert f"but the checkpoint has no {missing}" in _load_error(model_dir)


def test_expert_scale_of_the_wrong_shape_is_refused(quantized_checkpoint, tmp_path):
    model_dir = shutil.copytree(quantized_checkpoint(FAMILY, "fp8-block")[0], tmp_path / "model")
    edit_tensors(model_dir, lambda t: t.update({f"{EXPERTS}.2.down_proj.weight_scale_inv": torch.ones(4, 4)}))
    error = _load_error(model_dir)
    assert f"checkpoint tensor {EXPERTS}.2.down_proj.weight_scale_inv has shape (4, 4)" in error and "(4, 3)" in error


def test_experts_partly_quantized_are_refused(quantized_checkpoint, tmp_path):
    model_dir = shutil.copytree(quantized_checkpoint(FAMILY, "awq")[0], tmp_path / "model")

    def densify_expert_3_down(tensors):
        base = f"{EXPERTS}.3.down_proj"
        tensors[f"{base}.weight"] = dequantize_awq(*(tensors.pop(f"{base}.{p}") for p in ("qweight", "qzeros",
                                                                                            "scales"))).float()

    edit_tensors(model_dir, densify_expert_3_down)
    error = _load_error(model_dir)
    assert "decoder.layers.1.mlp.experts: expert 3's down_proj is not AWQ int4" in error
    assert "a layer's experts are all quantized or all dense" in error


# The experts path on quantized experts.

def _installed_experts(quantized_checkpoint, quantization):
    from llm_service.model import experts
    from llm_service.model.language_model import LanguageModel

    lm = LanguageModel(quantized_checkpoint(FAMILY, quantization)[0], dtype="float32")
    return experts.install(lm.modules.decoder)[1]


def test_only_the_experts_with_rows_are_dequantized(quantized_checkpoint):
    module = _installed_experts(quantized_checkpoint, "awq")
    asked = []
    for stacked in (module.gate_up_proj, module.down_proj):
        dense = stacked.dense
        stacked.dense = lambda dtype, expert=None, dense=dense: asked.append(expert) or dense(dtype, expert)
    index = torch.tensor([[5, 2, 9, 11], [2, 5, 11, 9]])
    with torch.no_grad():
        module(torch.randn(2, 64), index, torch.rand(2, 4))
    assert sorted(asked) == [2, 2, 5, 5, 9, 9, 11, 11]  # gate_up and down of each routed expert, one by one


@pytest.mark.kernel
def test_the_fused_kernel_path_runs_the_experts_dequantized(quantized_checkpoint):
    """What a CUDA replica runs (the whole layer dequantized, then `fused_experts`); on CPU in
    Triton's interpreter."""
    module = _installed_experts(quantized_checkpoint, "fp8-block")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 64, generator=gen)
    index = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(9)])
    weights = torch.rand(9, 4, generator=gen)
    with torch.no_grad():
        per_expert = module(hidden, index, weights)
        module.use_triton = True  # on CUDA only, outside tests
        torch.testing.assert_close(module(hidden, index, weights), per_expert, rtol=1e-5, atol=1e-5)
