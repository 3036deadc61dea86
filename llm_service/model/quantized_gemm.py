"""Which GEMM a quantized `Linear` (`llm_service.model.quantized`) runs: a kernel on the stored
tensors, or the formats' dequantize + `F.linear` (None from here).

- block FP8 (`triton_fp8.block_fp8_linear`) and per-channel FP8 (`triton_fp8.channel_fp8_linear`,
  `torch._scaled_mm`): on CUDA devices of compute capability 9.0 and later (FP8 tensor cores),
  activations quantized per token at run time;
- AWQ int4 (`triton_w4a16.awq_gemm`): on any CUDA device;

each for float16 / bfloat16 inputs and the shapes its kernel takes; everything else dequantizes.
`MMSERVE_QUANTIZED_GEMM` (read at each call) overrides: `dequantize` always, `kernels` wherever
their shapes fit, the CPU included (Triton's interpreter); `auto` (default) as above.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "MMSERVE_QUANTIZED_GEMM"
MODES = ("auto", "dequantize", "kernels")
HALF = (torch.float16, torch.bfloat16)


def mode() -> str:
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: one of {', '.join(MODES)}")
    return value


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kernel_runs(x: torch.Tensor, fp8: bool) -> bool:
    """Whether a kernel (`fp8`: an FP8 one) takes inputs like `x` here (its shapes aside)."""
    chosen = mode()
    if chosen == "kernels":
        return x.dtype in (*HALF, torch.float32)
    if chosen == "dequantize" or not x.is_cuda or x.dtype not in HALF:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return not fp8 or _capability(index) >= (9, 0)


def block_fp8(linear, x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor | None:
    """`linear`'s output by the block-scaled FP8 GEMM, or None where it does not run."""
    if kernel_runs(x, fp8=True):
        from mmserve.kernels import triton_fp8

        if triton_fp8.block_runs(block):
            return triton_fp8.block_fp8_linear(x, linear.weight, linear.weight_scale_inv, block, linear.bias)


def channel_fp8(linear, x: torch.Tensor) -> torch.Tensor | None:
    """`linear`'s output by `torch._scaled_mm` with per-token and per-channel scales, or None."""
    if kernel_runs(x, fp8=True):
        from mmserve.kernels import triton_fp8

        if triton_fp8.channel_fp8_runs(linear.weight):
            return triton_fp8.channel_fp8_linear(x, linear.weight, linear.weight_scale, linear.bias)


def awq(linear, x: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """`linear`'s output by the W4A16 Triton GEMM, or None."""
    if kernel_runs(x, fp8=False):
        from mmserve.kernels import triton_w4a16

        if triton_w4a16.runs(x, linear.qweight, group_size):
            return triton_w4a16.awq_gemm(x, linear.qweight, linear.qzeros, linear.scales, group_size, linear.bias)
