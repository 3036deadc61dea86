"""Per-channel FP8 and AWQ int4 weights (`llm_service.model.quantized`) against the tiny writer's
quantizers (`mmserve.tiny.quantized`) and the reference's element-wise dequantization."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_service.model import layers
from llm_service.model.quantized import AWQ, ChannelFP8, unpack_int4
from mmserve.tiny.quantized import pack_int4, quantize_awq, quantize_block_fp8
from tests.support.quantized_reference import dequantize, dequantize_awq, unpack_awq


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2 ** 16))
def test_int4_packing_round_trips_in_awq_order(rows, words, seed):
    values = torch.randint(0, 16, (rows, 8 * words), generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert torch.equal(unpack_int4(packed), values.to(torch.int32))
    assert torch.equal(unpack_awq(packed), values)


def test_awq_nibble_order_is_autoawqs():
    """Column c of a word sits at bits 4 * [0, 4, 1, 5, 2, 6, 3, 7][c] (AutoAWQ's `order_map` inverted)."""
    values = torch.arange(8).view(1, 8) + 1  # 1..8
    word = int(pack_int4(values)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]


def _awq_linear(out_sizes, inp, group, seed=0):
    fmt = AWQ(group)
    linear = layers.Linear(inp, out_sizes, bias=True, dtype=torch.float64)
    weight = torch.randn(sum(out_sizes), inp, generator=torch.Generator().manual_seed(seed))
    fmt.convert("proj", linear, torch.device("cpu"))
    stored = quantize_awq(weight, group)
    for name, tensor in stored.items():
        getattr(linear, name).copy_(tensor)
    linear.bias.copy_(torch.randn(sum(out_sizes), dtype=torch.float64))
    return fmt, linear, weight, stored


def test_awq_linear_forward_is_a_gemm_with_the_dequantized_weight():
    fmt, linear, _, stored = _awq_linear((32, 16, 16), 64, 16)
    assert linear.weight is None and linear.quantization is fmt
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.equal(fmt.dense(linear, torch.float64), dequantize_awq(**stored))
    assert torch.equal(linear(x), F.linear(x, dequantize_awq(**stored), linear.bias))


def test_awq_quantization_is_within_half_a_step():
    fmt, linear, weight, stored = _awq_linear((48,), 64, 32, seed=3)
    step = stored["scales"].double().repeat_interleave(32, 0).t()  # (out, in)
    assert ((fmt.dense(linear, torch.float64) - weight.double()).abs() <= step * 0.5 + 1e-3).all()


def test_packed_awq_parts_concatenate_along_columns():
    """q | k | v packed at load (`layers.pack_checkpoint_tensors`) == one projection quantized whole."""
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    parts = {name: quantize_awq(w, 32) for name, w in zip(("q_proj", "k_proj", "v_proj"), weight.split([32, 16, 16]))}
    waiting = {f"l.{name}.{param}": t for name, stored in parts.items() for param, t in stored.items()}
    made = layers.pack_checkpoint_tensors(waiting)
    whole = quantize_awq(weight, 32)
    assert not waiting and all(torch.equal(made[f"l.qkv_proj.{p}"], whole[p]) for p in whole)


def test_channel_fp8_dequantizes_per_row():
    weight, scale = quantize_block_fp8(torch.randn(24, 40, generator=torch.Generator().manual_seed(4)), [1, 40])
    assert scale.shape == (24, 1)
    linear = layers.Linear(40, (16, 8), bias=False, dtype=torch.float64)
    ChannelFP8().convert("gate_up", linear, torch.device("cpu"))
    linear.weight.copy_(weight)
    linear.weight_scale.copy_(scale)
    assert torch.equal(ChannelFP8().dense(linear, torch.float64), dequantize(weight, scale, [1, 40]))
    got = ChannelFP8().dense(linear, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (weight.float() * scale).bfloat16())


def test_awq_convert_refuses_packed_slices_off_the_word_columns():
    linear = layers.Linear(64, (12, 12), bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"proj: its packed slices \(12, 12\) are not whole groups of 8 output"):
        AWQ(32).convert("proj", linear, torch.device("cpu"))
