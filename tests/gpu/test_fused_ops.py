"""The decoder's fused RMSNorm (with the residual add before it) and SiLU x up
(llm_service/model/fused_ops.py) against the modules they replace: the kernels (Triton's
interpreter on CPU), a fused model's greedy tokens, a module whose math differs left alone, and
the compile for a Hopper GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from llm_service.model.fused_ops import add_rms_norm, fuse_decoder, rms_norm, rotary_kv_write, silu_mul

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _qwen2_norm(hidden: int, dtype: torch.dtype):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    norm = Qwen2VLRMSNorm(hidden, eps=1e-6)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(hidden))
    return norm.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 64), (1, 40)])
def test_rms_norm_is_the_transformers_norm(shape, dtype):
    norm = _qwen2_norm(shape[-1], dtype)
    x = (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(1))).to(DEVICE, dtype)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, norm(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, width", [(4, 48), (1, 1500), (3, 7)])
def test_silu_mul_is_silu_of_the_gate_times_up(rows, width, dtype):
    gate_up = (2 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width))).to(DEVICE, dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_is_the_residual_sum_then_the_transformers_norm(dtype):
    norm = _qwen2_norm(96, dtype)
    g = torch.Generator().manual_seed(2)
    x, residual = ((3 * torch.randn(2, 3, 96, generator=g)).to(DEVICE, dtype) for _ in range(2))
    got, total = add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(total, residual + x)  # rounded to the input dtype, as torch's sum
    torch.testing.assert_close(got, norm(residual + x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_kv_write_is_the_rotary_then_the_pool_write(dtype):
    """Q and K rotated as `transformers` rotates them (equal: each product and the sum rounded to
    the dtype), the rotated K and V at their slots of the pool, the other slots untouched."""
    from llm_service.model.layers import apply_rotary

    g = torch.Generator().manual_seed(4)
    t, heads, kv_heads, d = 5, 4, 2, 24

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    qkv = rand(t, (heads + 2 * kv_heads) * d)  # views of one packed projection, as the layer has them
    q, k, v = (x.view(t, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    angles = torch.randn(t, d // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    k_cache, v_cache = rand(6, 4, kv_heads, d), rand(6, 4, kv_heads, d)
    k_want, v_want = k_cache.clone().view(-1, kv_heads, d), v_cache.clone().view(-1, kv_heads, d)
    slots = torch.tensor([9, 3, 22, 0, 17], device=DEVICE)
    k_want[slots], v_want[slots] = apply_rotary(k, cos, sin), v
    got = rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got, apply_rotary(q, cos, sin))
    assert torch.equal(k_cache.view(-1, kv_heads, d), k_want) and torch.equal(v_cache.view(-1, kv_heads, d), v_want)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_a_fused_model_keeps_its_greedy_tokens_and_its_weights(tiny_checkpoint, family):
    """float32 (on CPU the kernels run in the interpreter): the unfused model's tokens; the
    engine's own decoder (Qwen2-VL, Qwen3-VL: q/k norms too) switches to its kernels, a
    `transformers` one (LLaVA's Llama) is patched."""
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel
    from tests.support.engine_support import Collector, mixed_cases, plan_request, run_until_done

    model_dir = tiny_checkpoint(family)
    tokens = []
    for fused in (False, True):
        model = LanguageModel(model_dir, dtype="float32", device=DEVICE)
        params, decoder = model.num_parameters, model.modules.decoder
        if fused and family != "llava":
            layers, per_layer = len(decoder.layers), 4 if family == "qwen3_vl" else 2
            assert decoder.use_kernels() == {"Attention": layers, "MLP": layers, "RMSNorm": per_layer * layers + 1}
        elif fused:
            layers = len(decoder.layers)
            assert fuse_decoder(decoder) == {"LlamaMLP": layers, "LlamaRMSNorm": 2 * layers + 1}
            assert model.num_parameters == params  # the stacked gate/up weight replaced the two
            assert fuse_decoder(decoder) == {}  # once
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=48, max_num_seqs=4, max_num_batched_tokens=64))
        collector = Collector()
        for i in (6, 7, 12):
            collector.add(engine, plan_request(model_dir, mixed_cases()[i][1], f"r{i}", 6))
        run_until_done(engine, collector)
        tokens.append({name: collector.tokens(name) for name in collector.events})
    assert tokens[0] == tokens[1] and all(tokens[0].values())


def test_a_norm_with_other_math_is_left_alone(caplog):
    class Qwen2RMSNorm(torch.nn.Module):  # the name of a known norm, Gemma's (1 + weight) math
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    decoder = torch.nn.Sequential(Qwen2RMSNorm(), Qwen2RMSNorm()).to(DEVICE)
    with caplog.at_level(logging.WARNING):
        assert fuse_decoder(decoder) == {}
    assert "not fusing Qwen2RMSNorm: differs from its own forward" in caplog.text
    assert all("forward" not in vars(m) for m in decoder)  # the class's own forward still runs
    assert fuse_decoder(decoder.double()) == {}  # float64 (CPU tests' models): never fused


def compile_for_sm90() -> list[str]:
    """The fused kernels compiled to Hopper cubins (ptxas ships with Triton; no GPU needed)."""
    from llm_service.model.fused_ops import _add_rms_norm_kernel, _rms_norm_kernel, _rotary_kv_kernel, _silu_mul_kernel
    from tests.support.sm90 import compile_sm90

    norm = compile_sm90(_rms_norm_kernel, {"BLOCK": 2048}, {"X": "*bf16", "W": "*bf16", "Y": "*bf16"}, {"eps": "fp32"})
    add_norm = compile_sm90(_add_rms_norm_kernel, {"BLOCK": 2048},
                            {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "S": "*bf16"}, {"eps": "fp32"})
    silu = compile_sm90(_silu_mul_kernel, {"BLOCK": 1024}, {"GU": "*bf16", "Y": "*bf16"})
    rotary = compile_sm90(_rotary_kv_kernel, {"HQ": 16, "HALF": 64, "BLOCK": 64},
                          {**{p: "*bf16" for p in ("Q", "K", "V", "COS", "SIN", "QO", "KC", "VC")}, "SLOTS": "*i64"},
                          num_warps=1)
    return [f"rms_norm: {norm} bytes", f"add_rms_norm: {add_norm} bytes", f"silu_mul: {silu} bytes",
            f"rotary_kv_write: {rotary} bytes"]


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled and run for real on CUDA")
def test_fused_kernels_compile_for_hopper_without_a_gpu():
    from tests.support.sm90 import run_without_interpreter

    assert run_without_interpreter("tests.gpu.test_fused_ops", "compile_for_sm90").count("bytes") == 4
