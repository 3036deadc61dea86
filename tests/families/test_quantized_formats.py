"""Per-channel FP8 (compressed-tensors) and AWQ int4 checkpoints on the engine: greedy tokens ==
`transformers`' monolithic model on the same checkpoint dequantized in float64
(`tests.support.quantized_reference`), float64 on both sides; the checkpoints as their tools
write them; bad ones refused with the tensor or field named."""

import json
import shutil

import pytest
import torch

from tests.support.cases import CASE_TOKENS, family_cases
from tests.support.pipeline import served_generate
from tests.support.quantized_reference import edit_tensors
from tests.support.reference import reference_generate

FORMATS = ("fp8-channel", "awq")


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("family,case", [("qwen2_vl", "text_only"), ("qwen2_vl", "one_image"),
                                         ("qwen2_5_vl", "one_image"),  # its tower's *_proj stay dense
                                         ("qwen3_vl", "one_image")])
def test_greedy_tokens_equal_dequantized_monolithic(quantized_checkpoint, quantization, family, case):
    model_dir, reference_dir = quantized_checkpoint(family, quantization)
    messages, max_tokens = family_cases(family)[case], CASE_TOKENS[family]
    expected = reference_generate(reference_dir, messages, max_tokens)
    assert len(expected) == max_tokens
    assert served_generate(model_dir, messages, max_tokens) == expected


def _lm(model_dir):
    from llm_service.model.language_model import LanguageModel

    return LanguageModel(model_dir, dtype="bfloat16")


def test_channel_fp8_lm_holds_e4m3_weights_and_row_scales(quantized_checkpoint):
    lm = _lm(quantized_checkpoint("qwen2_vl", "fp8-channel")[0])
    qkv = lm.modules.decoder.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (128, 1)  # q | k | v rows
    assert lm.modules.lm_head.weight.dtype == torch.bfloat16


def test_awq_lm_holds_packed_int4_and_group_scales(quantized_checkpoint):
    from llm_service.model import layers

    lm = _lm(quantized_checkpoint("qwen2_vl", "awq")[0])
    linears = [m for m in lm.modules.modules() if isinstance(m, layers.Linear)]
    assert linears and all(m.weight is None and m.qweight.dtype == torch.int32 for m in linears)
    gate_up = lm.modules.decoder.layers[0].mlp.gate_up_proj  # hidden 64 -> gate | up, 128 each
    assert (gate_up.qweight.shape, gate_up.qzeros.shape, gate_up.scales.shape) == ((64, 32), (2, 32), (2, 256))
    assert gate_up.scales.dtype == torch.float16 and lm.modules.lm_head.weight.dtype == torch.bfloat16


def test_cli_writes_llm_compressors_format(tmp_path):
    from deployments.cli.main import main
    from mmserve.checkpoint import stored_tensors

    assert main(["build-tiny-model", "--family", "qwen2_vl", "--quantization", "fp8-channel",
                 "--out", str(tmp_path / "m")]) == 0
    q = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "float-quantized",
                                                                          "compressed")
    group = q["config_groups"]["group_0"]
    assert group["weights"] | {"observer": None} == group["input_activations"] | {
        "strategy": "channel", "dynamic": False}  # weights per channel, static; activations per token, dynamic
    assert q["ignore"] == ["lm_head", "re:visual\\..*"]
    tensors = {t.key: t for t in stored_tensors(tmp_path / "m" / "model.safetensors")}
    assert tensors[f"{Q_PROJ}.weight"].dtype == torch.float8_e4m3fn
    assert (tensors[f"{Q_PROJ}.weight_scale"].dtype, tensors[f"{Q_PROJ}.weight_scale"].shape) == (torch.float32,
                                                                                                  (64, 1))


def test_cli_writes_autoawqs_format(tmp_path):
    from deployments.cli.main import main
    from mmserve.checkpoint import stored_tensors

    assert main(["build-tiny-model", "--family", "qwen2_vl", "--quantization", "awq",
                 "--out", str(tmp_path / "m")]) == 0
    q = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert q == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["visual"]}
    tensors = {t.key: (t.dtype, t.shape) for t in stored_tensors(tmp_path / "m" / "model.safetensors")}
    assert f"{Q_PROJ}.weight" not in tensors and tensors[f"{Q_PROJ}.bias"] == (torch.float32, (64,))
    assert tensors[f"{Q_PROJ}.qweight"] == (torch.int32, (64, 8))
    assert tensors[f"{Q_PROJ}.qzeros"] == (torch.int32, (2, 8))
    assert tensors[f"{Q_PROJ}.scales"] == (torch.float16, (2, 64))
    assert tensors["lm_head.weight"][0] == torch.float32


@pytest.mark.parametrize("quantization,name", [
    ("fp8-channel", "compressed-tensors fp8 (e4m3, per-channel weights, dynamic per-token activations)"),
    ("awq", "awq (int4, groups of 32, zero points)")])
def test_the_models_route_says_the_quantization(quantized_checkpoint, quantization, name):
    from tests.support.core_fakes import make_core

    assert make_core(quantized_checkpoint("qwen2_vl", quantization)[0]).model_cards()[0]["quantization"] == name


# Refusals: a copy of the tiny checkpoint, edited.

Q_PROJ = "model.layers.0.self_attn.q_proj"


def _copy(quantized_checkpoint, quantization, tmp_path):
    return shutil.copytree(quantized_checkpoint("qwen2_vl", quantization)[0], tmp_path / "model")


def _edit_config(model_dir, edit):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def _load_error(model_dir) -> str:
    from llm_service.model.language_model import LanguageModel

    with pytest.raises(ValueError) as e:
        LanguageModel(model_dir, dtype="float32")
    return str(e.value)


@pytest.mark.parametrize("quantization,tensor", [("fp8-channel", "weight_scale"), ("awq", "qzeros"),
                                                 ("awq", "scales")])
def test_missing_companion_tensor_is_refused(quantized_checkpoint, tmp_path, quantization, tensor):
    model_dir = _copy(quantized_checkpoint, quantization, tmp_path)
    edit_tensors(model_dir, lambda t: t.pop(f"{Q_PROJ}.{tensor}"))
    assert f"but the checkpoint has no {Q_PROJ}.{tensor}" in _load_error(model_dir)


@pytest.mark.parametrize("quantization,tensor,bad,needs", [
    ("fp8-channel", "weight_scale", torch.ones(64), "needs (64, 1)"),
    ("awq", "scales", torch.ones(2, 32, dtype=torch.float16), "needs torch.float16 (2, 64)"),
    ("awq", "scales", torch.ones(2, 64, dtype=torch.bfloat16), "needs torch.float16 (2, 64)"),
    ("awq", "qzeros", torch.zeros(1, 8, dtype=torch.int32), "needs torch.int32 (2, 8)")])
def test_companion_of_the_wrong_shape_is_refused(quantized_checkpoint, tmp_path, quantization, tensor, bad, needs):
    model_dir = _copy(quantized_checkpoint, quantization, tmp_path)
    edit_tensors(model_dir, lambda t: t.update({f"{Q_PROJ}.{tensor}": bad}))
    error = _load_error(model_dir)
    assert f"checkpoint tensor {Q_PROJ}.{tensor} " in error and needs in error


def test_awq_group_size_off_the_stored_groups_is_refused(quantized_checkpoint, tmp_path):
    model_dir = _copy(quantized_checkpoint, "awq", tmp_path)
    _edit_config(model_dir, lambda q: q.update(group_size=16))
    error = _load_error(model_dir)  # on the first projection read: q_proj (64 rows in) or down_proj (128)
    assert ".qzeros is torch.int32 (" in error and "in groups of 16 (group_size) needs torch.int32 (" in error


@pytest.mark.parametrize("field,value", [("bits", 8), ("version", "gemv"), ("zero_point", False),
                                         ("group_size", -1)])
def test_awq_settings_mmserve_does_not_run_are_refused(quantized_checkpoint, tmp_path, field, value):
    model_dir = _copy(quantized_checkpoint, "awq", tmp_path)
    _edit_config(model_dir, lambda q: q.update({field: value}))
    assert f"quantization_config.{field} {value!r} is not" in _load_error(model_dir)


@pytest.mark.parametrize("where,field,value", [
    ("", "format", "pack-quantized"), ("", "quantization_status", "frozen"),
    (".config_groups.group_0.weights", "strategy", "tensor"), (".config_groups.group_0.weights", "num_bits", 4),
    (".config_groups.group_0.weights", "type", "int"), (".config_groups.group_0.weights", "symmetric", False),
    (".config_groups.group_0.input_activations", "dynamic", False)])
def test_compressed_tensors_schemes_mmserve_does_not_run_are_refused(quantized_checkpoint, tmp_path, where, field,
                                                                     value):
    model_dir = _copy(quantized_checkpoint, "fp8-channel", tmp_path)

    def edit(q):
        for part in where.split(".")[1:]:
            q = q[part]
        q[field] = value

    _edit_config(model_dir, edit)
    assert f"quantization_config{where}.{field} {value!r} is not supported" in _load_error(model_dir)


def test_compressed_tensors_ignore_entries_matching_nothing_are_fine(quantized_checkpoint, tmp_path):
    model_dir = _copy(quantized_checkpoint, "fp8-channel", tmp_path)
    _edit_config(model_dir, lambda q: q["ignore"].extend(["model.no_such_module", "re:.*nothing$"]))
    assert _lm(model_dir).quantization.label == "FP8"


def test_awq_qweight_outside_the_owned_layers_is_refused(quantized_checkpoint, tmp_path):
    from mmserve.tiny.quantized import quantize_awq

    model_dir = _copy(quantized_checkpoint, "awq", tmp_path)

    def quantize_lm_head(tensors):
        tensors.update({f"lm_head.{k}": v for k, v in quantize_awq(tensors.pop("lm_head.weight"), 32).items()})

    edit_tensors(model_dir, quantize_lm_head)
    assert "checkpoint tensor lm_head.qweight is AWQ int4, but mmserve runs lm_head in full precision" in \
        _load_error(model_dir)


def test_awq_packed_projection_with_a_dense_part_is_refused(quantized_checkpoint, tmp_path):
    from tests.support.quantized_reference import dequantize_awq

    model_dir = _copy(quantized_checkpoint, "awq", tmp_path)

    def densify_k(tensors):
        base = "model.layers.0.self_attn.k_proj"
        parts = [tensors.pop(f"{base}.{p}") for p in ("qweight", "qzeros", "scales")]
        tensors[f"{base}.weight"] = dequantize_awq(*parts).float()

    edit_tensors(model_dir, densify_k)
    assert "decoder.layers.0.self_attn.qkv_proj packs 3 projections but only" in _load_error(model_dir)


def test_tensor_parallel_is_refused(quantized_checkpoint):
    from llm_service.model.language_model import LanguageModel

    class TP:
        rank, size = 0, 2

    with pytest.raises(ValueError, match="tensor-parallel serving of awq .* is not supported"):
        LanguageModel(quantized_checkpoint("qwen2_vl", "awq")[0], dtype="float32", tp=TP())


def test_lm_weight_bytes_count_awq_as_stored(quantized_checkpoint):
    from pathlib import Path

    from llm_service.model.language_model import weight_split
    from mmserve.checkpoint import safetensors_files, stored_tensors

    model_dir = Path(quantized_checkpoint("qwen2_vl", "awq")[0])
    lm, _ = weight_split(model_dir, "bfloat16")
    stored = [t for f in safetensors_files(model_dir) for t in stored_tensors(f) if not t.key.startswith("visual.")]
    int4 = sum(t.nbytes for t in stored if t.key.endswith((".qweight", ".qzeros", ".scales")))
    rest = sum(t.nbytes // 2 for t in stored if t.dtype == torch.float32)
    assert lm == int4 + rest  # float32 tensors served in bfloat16: half their stored bytes


def test_bf16_channel_scales_load_widened_exactly(quantized_checkpoint, tmp_path):
    model_dir = _copy(quantized_checkpoint, "fp8-channel", tmp_path)
    scale = {}

    def to_bf16(tensors):
        scale["bf16"] = tensors[f"{Q_PROJ}.weight_scale"] = tensors[f"{Q_PROJ}.weight_scale"].bfloat16()

    edit_tensors(model_dir, to_bf16)
    qkv = _lm(model_dir).modules.decoder.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale.dtype == torch.float32 and torch.equal(qkv.weight_scale[:64], scale["bf16"].float())
