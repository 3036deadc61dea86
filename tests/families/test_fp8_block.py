"""Block-FP8 checkpoints (Qwen's `-FP8` releases) on the engine: greedy tokens == `transformers`'
monolithic model on the same checkpoint dequantized in float64 (`tests.support.quantized_reference`),
float64 on both sides; the encoder reads its (unquantized) tower from the same directory."""

from pathlib import Path

import pytest
import torch

from tests.support.cases import CASE_TOKENS, family_cases
from tests.support.quantized_reference import edit_tensors
from tests.support.pipeline import served_generate
from tests.support.reference import reference_generate


@pytest.fixture(scope="session")
def fp8_checkpoint(quantized_checkpoint):
    """family -> (its tiny block-FP8 checkpoint, that checkpoint dequantized), built on first use."""
    return lambda family: quantized_checkpoint(family, "fp8-block")


@pytest.mark.parametrize("family,case", [("qwen2_vl", "text_only"), ("qwen2_vl", "one_image"),
                                         ("qwen2_5_vl", "one_image"),  # its tower's *_proj stay dense
                                         ("qwen3_vl", "text_only"), ("qwen3_vl", "one_image")])
def test_greedy_tokens_equal_dequantized_monolithic(fp8_checkpoint, family, case):
    model_dir, reference_dir = fp8_checkpoint(family)
    messages, max_tokens = family_cases(family)[case], CASE_TOKENS[family]
    expected = reference_generate(reference_dir, messages, max_tokens)
    assert len(expected) == max_tokens
    assert served_generate(model_dir, messages, max_tokens) == expected


def test_language_model_holds_fp8_weights_and_block_scales(fp8_checkpoint):
    from llm_service.model import layers
    from llm_service.model.language_model import LanguageModel

    lm = LanguageModel(fp8_checkpoint("qwen2_vl")[0], dtype="bfloat16")
    linears = [m for m in lm.modules.modules() if isinstance(m, layers.Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    qkv = lm.modules.decoder.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale_inv.shape == (128 // 16, 64 // 16)  # q | k | v grids stacked: 64 + 32 + 32 rows
    assert qkv.bias.dtype == torch.bfloat16
    assert lm.modules.lm_head.weight.dtype == torch.bfloat16  # modules_to_not_convert
    float32 = {name for name, p in lm.modules.named_parameters() if p.dtype == torch.float32}
    assert float32 == {name for name, _ in lm.modules.named_parameters() if name.endswith(".weight_scale_inv")}


def _copy(model_dir, tmp_path):
    import shutil

    return shutil.copytree(model_dir, tmp_path / "model")


def _edit_config(model_dir, edit):
    import json

    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _load_error(model_dir) -> str:
    from llm_service.model.language_model import LanguageModel

    with pytest.raises(ValueError) as e:
        LanguageModel(model_dir, dtype="float32")
    return str(e.value)


Q_PROJ = "model.layers.0.self_attn.q_proj"


def test_unknown_quant_method_is_refused(fp8_checkpoint, tmp_path):
    model_dir = _copy(fp8_checkpoint("qwen2_vl")[0], tmp_path)
    _edit_config(model_dir, lambda c: c["quantization_config"].update(quant_method="gptq"))
    assert "quantization_config.quant_method 'gptq'" in _load_error(model_dir)


def test_missing_scale_is_refused(fp8_checkpoint, tmp_path):
    model_dir = _copy(fp8_checkpoint("qwen2_vl")[0], tmp_path)
    edit_tensors(model_dir, lambda t: t.pop(f"{Q_PROJ}.weight_scale_inv"))
    assert f"{Q_PROJ}.weight is F8_E4M3 but the checkpoint has no {Q_PROJ}.weight_scale_inv" in _load_error(model_dir)


def test_scale_off_the_block_grid_is_refused(fp8_checkpoint, tmp_path):
    model_dir = _copy(fp8_checkpoint("qwen2_vl")[0], tmp_path)
    edit_tensors(model_dir, lambda t: t.update({f"{Q_PROJ}.weight_scale_inv": torch.ones(4, 3)}))
    error = _load_error(model_dir)
    assert f"{Q_PROJ}.weight_scale_inv has shape (4, 3)" in error and "needs (4, 4)" in error


def test_block_size_off_the_stored_grids_is_refused(fp8_checkpoint, tmp_path):
    model_dir = _copy(fp8_checkpoint("qwen2_vl")[0], tmp_path)
    _edit_config(model_dir, lambda c: c["quantization_config"].update(weight_block_size=[32, 16]))
    assert "weight_scale_inv has shape" in _load_error(model_dir)


def test_packed_slices_off_the_block_rows_are_refused(tiny_checkpoint, tmp_path):
    """Blocks of 48 rows: gate and up (128 rows each) end in a partial block, so gate | up cannot
    share one scale grid (nor q | k | v)."""
    from mmserve.tiny.quantized import quantize_checkpoint

    model_dir = _copy(tiny_checkpoint("qwen2_vl"), tmp_path)
    quantize_checkpoint(model_dir, block=[48, 16])
    error = _load_error(model_dir)
    assert "decoder.layers.0.mlp.gate_up_proj: its packed slices (128, 128)" in error
    assert "model.layers.0.mlp.gate_proj.weight" in error


def test_fp8_tensor_outside_the_owned_layers_is_refused(fp8_checkpoint, tmp_path):
    from mmserve.tiny.quantized import quantize_block_fp8

    model_dir = _copy(fp8_checkpoint("qwen2_vl")[0], tmp_path)

    def quantize_lm_head(tensors):
        tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"] = quantize_block_fp8(tensors["lm_head.weight"],
                                                                                            [16, 16])

    edit_tensors(model_dir, quantize_lm_head)
    error = _load_error(model_dir)
    assert "checkpoint tensor lm_head.weight is FP8, but mmserve runs lm_head in full precision" in error


def test_lm_weight_bytes_count_fp8_as_stored(fp8_checkpoint):
    from llm_service.model.language_model import weight_split
    from mmserve.checkpoint import safetensors_files, stored_tensors

    model_dir = Path(fp8_checkpoint("qwen2_vl")[0])
    lm, _ = weight_split(model_dir, "bfloat16")
    stored = [t for f in safetensors_files(model_dir) for t in stored_tensors(f) if not t.key.startswith("visual.")]
    fp8 = sum(t.nbytes for t in stored if t.dtype == torch.float8_e4m3fn or t.key.endswith("_scale_inv"))
    rest = sum(t.nbytes // 2 for t in stored if t.dtype == torch.float32 and not t.key.endswith("_scale_inv"))
    assert lm == fp8 + rest  # float32 tensors served in bfloat16: half their stored bytes


def test_cli_writes_the_published_format(tmp_path):
    import json

    from deployments.cli.main import main
    from mmserve.checkpoint import stored_tensors

    assert main(["build-tiny-model", "--family", "qwen2_vl", "--quantization", "fp8-block",
                 "--out", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [16, 16],
                                             "modules_to_not_convert": ["lm_head", "visual"]}
    dtypes = {t.key: t.dtype for t in stored_tensors(tmp_path / "m" / "model.safetensors")}
    assert dtypes[f"{Q_PROJ}.weight"] == torch.float8_e4m3fn and dtypes[f"{Q_PROJ}.weight_scale_inv"] == torch.float32
    assert dtypes[f"{Q_PROJ}.bias"] == torch.float32 and dtypes["lm_head.weight"] == torch.float32
    assert all(dtype == torch.float32 for key, dtype in dtypes.items() if key.startswith("visual."))


def test_the_models_route_says_the_quantization(fp8_checkpoint, tiny_checkpoint):
    """`GET /v1/models` (the Router core's card) says how the LM's weights are stored; None when dense."""
    from tests.support.core_fakes import make_core

    assert make_core(fp8_checkpoint("qwen2_vl")[0]).model_cards()[0]["quantization"] == "fp8 (e4m3, 16x16 blocks)"
    assert make_core(tiny_checkpoint("qwen2_vl")).model_cards()[0]["quantization"] is None
