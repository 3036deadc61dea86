"""The quantized checkpoints' GEMMs against plain references: AWQ's W4A16 Triton GEMM
(mmserve/kernels/triton_w4a16.py) against the weight dequantized element by element
(`tests.support.quantized_reference`, AutoAWQ's nibble order) times the input; the FP8 ones
(mmserve/kernels/triton_fp8.py) against the same per-token activation quantization
(`mmserve.kernels.fp8`, its definition in torch) and the dequantized weight, in float64; the
dispatch of each format's forward (llm_service/model/quantized_gemm.py).

On CPU the Triton kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest), whose
bfloat16 `tl.dot` is wrong: bfloat16 runs on the GPU only; on CUDA they are compiled (FP8 ones on
compute capability >= 9.0).
"""

from __future__ import annotations

import types

import pytest
import torch

from llm_service.model import layers, quantized_gemm
from llm_service.model.quantized import AWQ, BlockFP8, ChannelFP8
from mmserve.kernels.fp8 import FP8, fake_quantize, quantize_per_token_group
from mmserve.tiny.quantized import quantize_awq, quantize_block_fp8
from tests.support.quantized_reference import dequantize, dequantize_awq

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_HERE = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (9, 0)
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# the 16-bit outputs: one rounding of the float32 sums (bf16: 8 bits) + float32 summation order
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
needs_fp8 = pytest.mark.skipif(not FP8_HERE, reason="FP8 tensor cores need compute capability >= 9.0")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance, relative to the largest |want|."""
    assert got.dtype == dtype and got.shape == want.shape
    scale = float(want.abs().max())
    torch.testing.assert_close(got.cpu().double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)


# -- AWQ W4A16 --------------------------------------------------------------------------------------
AWQ_SHAPES = {  # M, N, K, group
    "decode_m1": (1, 64, 128, 32),
    "ragged_m": (37, 96, 256, 64),
    "n_off_the_tile": (5, 40, 64, 32),
    "groups_of_128_split_k": (3, 128, 1024, 128),
    "m_past_64_no_split": (70, 72, 128, 32),
}


def _awq_case(M, N, K, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = quantize_awq(torch.randn(N, K, generator=g), group)
    x = torch.randn(M, K, generator=g).to(dtype)
    return x, packed["qweight"], packed["qzeros"], packed["scales"]


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
@pytest.mark.parametrize("shape", AWQ_SHAPES)
def test_w4a16_gemm_is_the_dequantized_weight_times_x(shape, dtype):
    from mmserve.kernels.triton_w4a16 import awq_gemm

    M, N, K, group = AWQ_SHAPES[shape]
    x, qweight, qzeros, scales = _awq_case(M, N, K, group, dtype)
    weight = dequantize_awq(qweight, qzeros, scales).to(dtype)  # the kernel casts W to x's dtype for tl.dot
    bias = torch.randn(N).to(dtype)
    want = x.double() @ weight.double().t() + bias.double()
    on = {t: t.to(DEVICE) for t in (x, qweight, qzeros, scales, bias)}
    got = awq_gemm(on[x], on[qweight], on[qzeros], on[scales], group, bias=on[bias])
    _close(got, want, dtype)


def test_w4a16_gemm_keeps_leading_dims_and_takes_no_rows():
    from mmserve.kernels.triton_w4a16 import awq_gemm

    x, qweight, qzeros, scales = (t.to(DEVICE) for t in _awq_case(6, 64, 64, 32, torch.float16))
    got = awq_gemm(x.view(2, 3, 64), qweight, qzeros, scales, 32)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got.view(6, 64), awq_gemm(x, qweight, qzeros, scales, 32))
    assert awq_gemm(x[:0], qweight, qzeros, scales, 32).shape == (0, 64)


# -- FP8 --------------------------------------------------------------------------------------------
def _activations(M, K, seed=0) -> torch.Tensor:
    """Rows of mixed magnitudes: an all-zero row, values 1e4 apart in one row (e4m3 subnormals after
    scaling), values that round up into the next binade."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M)[:, None]
    x[0] = 0
    x[-1, -1] = -0.0
    if M > 2:
        x[1, ::3] *= 1e-4
        x[2, :8] = torch.tensor([127.9, 124.8, -1.969, 0.0, 448.0, 1.0, -0.01, 3.0])
    return x


@needs_fp8
@pytest.mark.parametrize("M,K,group", [(3, 64, 16), (5, 100, 32), (4, 300, 300), (6, 256, 128)])
def test_activation_quantization_kernel_is_the_torch_definition_bit_for_bit(M, K, group):
    from mmserve.kernels.triton_fp8 import quantize_activations

    x = _activations(M, K)
    want_q, want_scale = quantize_per_token_group(x, group)
    got_q, got_scale = quantize_activations(x.to(DEVICE), group)
    assert got_q.dtype == FP8 and got_scale.shape == (M, -(-K // group))
    assert torch.equal(got_scale.cpu(), want_scale)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_per_token_quantization_maps_each_groups_largest_value_to_448():
    x = _activations(4, 64)
    q, scale = quantize_per_token_group(x, 32)
    back = fake_quantize(x, 32)
    groups = q.float().view(4, 2, 32)
    assert torch.all(groups[1:].abs().amax(-1) == 448) and torch.all(q[0].float() == 0)
    torch.testing.assert_close(back, x, rtol=2 ** -4, atol=float(scale.max()) * 2 ** -9)
    assert torch.equal(fake_quantize(back, 32), back)  # a quantized value quantizes to itself


FP8_SHAPES = {  # M, N, K, (bn, bk), bias
    "decode_m1_split_k": (1, 64, 128, (32, 32), True),
    "ragged_m": (37, 96, 256, (32, 64), False),
    "partial_blocks_no_split": (70, 200, 300, (128, 128), True),
    "blocks_of_128": (16, 256, 512, (128, 128), False),
}


def block_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block, bias) -> torch.Tensor:
    """float64: the activations as the GEMM sees them (per token per `block[1]` columns) times the
    weight dequantized block by block."""
    return fake_quantize(x.float(), block[1]).double() @ dequantize(weight, scale, list(block)).t() + (
        0 if bias is None else bias.double())


@needs_fp8
@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_block_fp8_gemm_is_the_quantized_activations_times_the_dequantized_weight(shape, dtype):
    from mmserve.kernels.triton_fp8 import block_fp8_linear

    M, N, K, block, with_bias = FP8_SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    weight, scale = quantize_block_fp8(torch.randn(N, K, generator=g), list(block))
    x = (torch.randn(M, K, generator=g) * 2).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    got = block_fp8_linear(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), block,
                           None if bias is None else bias.to(DEVICE))
    _close(got, block_reference(x, weight, scale, block, bias), dtype)


@needs_fp8
@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 37])
def test_channel_fp8_gemm_is_scaled_mm_of_per_token_and_per_channel_scales(M, dtype):
    from mmserve.kernels.triton_fp8 import channel_fp8_linear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 128, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 448
    weight = (w / scale).to(FP8)
    x = torch.randn(M, 128, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    want = fake_quantize(x.float(), 128).double() @ (weight.double() * scale.double()).t() + bias.double()
    got = channel_fp8_linear(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    _close(got, want, dtype)


# -- the formats' forward ---------------------------------------------------------------------------
def _linear(fmt, out: int, inp: int, seed=3) -> layers.Linear:
    """A `Linear` of `fmt` holding `out x inp` random weights quantized by the format's own rule."""
    from mmserve.tiny.quantized import quantize

    g = torch.Generator().manual_seed(seed)
    linear = layers.Linear(inp, (out,), bias=True, dtype=torch.float16)
    fmt.convert("p", linear, torch.device(DEVICE))
    name = {BlockFP8: "fp8-block", ChannelFP8: "fp8-channel", AWQ: "awq"}[type(fmt)]
    block = list(getattr(fmt, "block", (16, 16)))
    tensors = quantize(name, "p", torch.randn(out, inp, generator=g), block, getattr(fmt, "group_size", 32))
    with torch.no_grad():
        for key, value in tensors.items():
            getattr(linear, key.rpartition(".")[2]).copy_(value)
        linear.bias.copy_(torch.randn(out, generator=g))
    return linear


FORMATS = {"fp8-block": BlockFP8((32, 32)), "fp8-channel": ChannelFP8(), "awq": AWQ(32)}


@pytest.mark.parametrize("name", FORMATS)
def test_forward_runs_the_kernel_when_told_and_matches_the_dequantized_path(name, monkeypatch):
    fmt = FORMATS[name]
    if name.startswith("fp8") and not FP8_HERE:
        pytest.skip("FP8 tensor cores need compute capability >= 9.0")
    linear = _linear(fmt, 64, 128)
    x = torch.randn(5, 128, device=DEVICE, dtype=torch.float16)
    dense = torch.nn.functional.linear(x.double(), fmt.dense(linear, torch.float64), linear.bias.double())
    monkeypatch.setenv(quantized_gemm.ENV, "dequantize")
    fallback = linear(x)
    monkeypatch.setenv(quantized_gemm.ENV, "kernels")
    calls = []
    for module, fn in (("triton_fp8", "block_fp8_linear"), ("triton_fp8", "channel_fp8_linear"),
                       ("triton_w4a16", "awq_gemm")):
        import importlib

        mod = importlib.import_module(f"mmserve.kernels.{module}")
        original = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _o=original, _n=fn, **k: calls.append(_n) or _o(*a, **k))
    got = linear(x)
    assert calls == [{"fp8-block": "block_fp8_linear", "fp8-channel": "channel_fp8_linear", "awq": "awq_gemm"}[name]]
    assert got.dtype == torch.float16
    if name.startswith("fp8"):  # x quantized (e4m3: 3 mantissa bits), which the fallback does not do
        assert not torch.equal(got, fallback)
    tolerance = 0.1 if name.startswith("fp8") else 2e-3
    scale = float(dense.abs().max())
    torch.testing.assert_close(got.double(), dense, rtol=tolerance, atol=tolerance * scale)


def test_cpu_and_wide_dtypes_keep_the_dequantizing_path(monkeypatch):
    """`auto`: never a kernel on the CPU, nor for float32 / float64 anywhere (the exact tests)."""
    monkeypatch.delenv(quantized_gemm.ENV, raising=False)
    cpu = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not quantized_gemm.kernel_runs(cpu, fp8=True) and not quantized_gemm.kernel_runs(cpu, fp8=False)
    fake = types.SimpleNamespace(is_cuda=True, dtype=torch.float32, device=torch.device("cuda", 0))
    assert not quantized_gemm.kernel_runs(fake, fp8=False)


@pytest.mark.parametrize("capability,fp8,w4a16", [((8, 0), False, True), ((8, 9), False, True), ((9, 0), True, True)])
def test_auto_takes_fp8_on_hopper_and_later_and_w4a16_on_any_cuda(capability, fp8, w4a16, monkeypatch):
    monkeypatch.delenv(quantized_gemm.ENV, raising=False)
    monkeypatch.setattr(quantized_gemm, "_capability", lambda index: capability)
    for dtype in (torch.float16, torch.bfloat16):
        x = types.SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0))
        assert quantized_gemm.kernel_runs(x, fp8=True) == fp8
        assert quantized_gemm.kernel_runs(x, fp8=False) == w4a16
    monkeypatch.setenv(quantized_gemm.ENV, "dequantize")
    assert not quantized_gemm.kernel_runs(x, fp8=False)


def test_an_unknown_mode_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(quantized_gemm.ENV, "fast")
    with pytest.raises(ValueError, match="MMSERVE_QUANTIZED_GEMM='fast'"):
        quantized_gemm.mode()


def test_shapes_no_kernel_takes_fall_back():
    from mmserve.kernels import triton_fp8, triton_w4a16

    assert not triton_fp8.block_runs((16, 16)) and triton_fp8.block_runs((128, 128))  # FP8 tl.dot: K >= 32
    assert not triton_fp8.channel_fp8_runs(torch.empty(40, 72, dtype=FP8))  # _scaled_mm: multiples of 16
    assert triton_w4a16.block_k(128) == 128 and triton_w4a16.block_k(48) == 16 and triton_w4a16.block_k(8) is None


# -- compiled for Hopper --------------------------------------------------------------------------
def compile_for_sm90() -> list[str]:
    """Every kernel at the released settings compiled to Hopper cubins (ptxas ships with Triton)."""
    from mmserve.kernels.triton_fp8 import _block_fp8_kernel, _quantize_kernel
    from mmserve.kernels.triton_splitk import _sum_splits_kernel
    from mmserve.kernels.triton_w4a16 import _awq_gemm_kernel
    from tests.support.sm90 import compile_sm90

    out = []
    for dtype in ("bf16", "fp16"):
        for bm, bn in ((16, 64), (64, 128)):
            result = "fp32" if bm == 16 else dtype  # split-K partials; whole K into x's dtype (+ bias)
            size = compile_sm90(_awq_gemm_kernel, dict(GROUP=128, PRECISION="tf32", HAS_BIAS=bm != 16, BLOCK_M=bm,
                                                       BLOCK_N=bn, BLOCK_K=128),
                                {"x_ptr": f"*{dtype}", "qweight_ptr": "*i32", "qzeros_ptr": "*i32",
                                 "scales_ptr": "*fp16", "bias_ptr": f"*{dtype}", "out_ptr": f"*{result}"}, num_stages=2,
                                aligned=("x_ptr", "qweight_ptr", "qzeros_ptr", "scales_ptr", "bias_ptr", "out_ptr", "N",
                                         "K", "stride_xm"))
            out.append(f"w4a16 {dtype} {bm}x{bn}: {size} bytes")
        for bm, bn, result in ((16, 64, "fp32"), (64, 128, dtype)):
            size = compile_sm90(_block_fp8_kernel, dict(HAS_BIAS=result != "fp32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128),
                                {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                                 "bias_ptr": f"*{dtype}", "out_ptr": f"*{result}"}, num_stages=3,
                                aligned=("xq_ptr", "xs_ptr", "w_ptr", "ws_ptr", "bias_ptr", "out_ptr", "N", "K"))
            out.append(f"fp8 block {dtype} {bm}x{bn}: {size} bytes")
        size = compile_sm90(_quantize_kernel, dict(GROUP=128, CHUNK=128, FP8_MAX=448.0, MIN_AMAX=1e-10),
                            {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"})
        out.append(f"quantize {dtype}: {size} bytes")
        size = compile_sm90(_sum_splits_kernel, dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024),
                            {"partial_ptr": "*fp32", "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"})
        out.append(f"sum splits {dtype}: {size} bytes")
    return out


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled and run for real on CUDA")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not type-check like the compiler: compile the real thing too."""
    from tests.support.sm90 import run_without_interpreter

    assert run_without_interpreter("tests.gpu.test_quantized_kernels", "compile_for_sm90").count("bytes") == 12
