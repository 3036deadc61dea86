"""Block-FP8 weights (`llm_service.model.quantized`) and the tiny writer's quantizer (`mmserve.tiny.quantized`)."""

import pytest
import torch
import torch.nn.functional as F

from llm_service.model import layers
from llm_service.model.quantized import BlockFP8
from mmserve.tiny.quantized import quantize_block_fp8
from tests.support.quantized_reference import dequantize


@pytest.mark.parametrize("shape,block", [((40, 50), [16, 16]), ((64, 128), [16, 16]), ((7, 130), [128, 128]),
                                         ((7, 50), [128, 128]), ((33, 20), [16, 8])])
def test_dequantize_equals_blockwise_product_with_partial_edge_blocks(shape, block):
    weight, scale = quantize_block_fp8(torch.randn(shape, generator=torch.Generator().manual_seed(0)), block)
    assert scale.shape == BlockFP8(tuple(block)).grid(shape)
    got = BlockFP8(tuple(block)).dequantize(weight, scale, torch.float64)
    assert torch.equal(got, dequantize(weight, scale, block))


def test_quantized_weight_is_within_e4m3_rounding():
    original = torch.randn(48, 80, generator=torch.Generator().manual_seed(1))
    weight, scale = quantize_block_fp8(original, [16, 16])
    restored = BlockFP8((16, 16)).dequantize(weight, scale, torch.float32)
    per_block_max = scale.repeat_interleave(16, 0).repeat_interleave(16, 1) * 448
    assert ((restored - original).abs() <= per_block_max / 16).all()  # 3 mantissa bits: <= 1/16 of the block max


def test_fp8_linear_forward_is_a_gemm_with_the_dequantized_weight():
    fmt = BlockFP8((16, 16))
    linear = layers.Linear(32, (16, 16), bias=True, dtype=torch.float64)
    linear.bias.copy_(torch.randn(32, dtype=torch.float64))
    fmt.convert("qkv", linear, torch.device("cpu"))
    weight, scale = quantize_block_fp8(torch.randn(32, 32), [16, 16])
    linear.weight.copy_(weight)
    linear.weight_scale_inv.copy_(scale)
    x = torch.randn(5, 32, dtype=torch.float64)
    assert torch.equal(linear(x), F.linear(x, dequantize(weight, scale, [16, 16]), linear.bias))


def test_bf16_dequantizes_through_float32():
    weight, scale = quantize_block_fp8(torch.randn(16, 16), [16, 16])
    got = BlockFP8((16, 16)).dequantize(weight, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (weight.float() * scale[0, 0]).bfloat16())
