"""FP8 (e4m3) GEMMs with dynamic per-token activation scales, on CUDA (Hopper's FP8 tensor cores).

Activations are quantized at run time by `quantize_activations`, one Triton launch, bit for bit
`mmserve.kernels.fp8.quantize_per_token_group` (its definition, in torch).

- `block_fp8_linear` (Qwen's and DeepSeek's `-FP8` checkpoints, after vLLM's
  `w8a8_block_fp8_matmul`): `weight` `(N, K)` e4m3 with one float32 scale per `block = (bn, bk)`
  block (`weight_scale_inv` `(ceil(N/bn), ceil(K/bk))`; edge blocks may be partial); `x` quantized
  per token per `bk` columns, so each `BLOCK_K = bk` step has one activation scale per row and one
  weight scale per output column. Small batches split K (`triton_splitk`).
- `channel_fp8_linear` (compressed-tensors, per-output-channel weights): `x` quantized per
  token, then `torch._scaled_mm` with the two row-wise scales.

Every shape is fixed by the input's: a CUDA graph captures it. On CPU the Triton kernels run only in
Triton's interpreter (`TRITON_INTERPRET=1`, tests). docs/quantization.md#what-runs-where-all-three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fp8 import FP8, FP8_MAX, MIN_AMAX
from mmserve.kernels.triton_splitk import splits_for, sum_splits, unit_stride_rows


@triton.jit
def _round_to_e4m3(v):
    """`v` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 (as torch's
    cast: -0.0 for what rounds to zero from below): the
    cast after it is exact (Triton's interpreter rounds a float32 -> e4m3 cast wrongly where the
    rounding carries into the exponent)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step = tl.maximum(exponent, -6) - 3  # e4m3: 3 mantissa bits, subnormal below 2**-6
    ulp = ((step + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step) << 23).to(tl.float32, bitcast=True)  # powers of two: both products exact
    magic = 12582912.0  # 1.5 * 2**23: adding it rounds |y| < 2**22 to an integer, ties to even
    rounded = ((tl.abs(v) * inverse + magic) - magic) * ulp
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit kept: -0.0 for what rounds to zero from below


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, groups, stride_xm, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        k = g * GROUP + c + offs
        v = tl.load(x_ptr + row * stride_xm + k, mask=(c + offs < GROUP) & (k < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    for c in range(0, GROUP, CHUNK):
        k = g * GROUP + c + offs
        mask = (c + offs < GROUP) & (k < K)
        v = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX))
        tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * groups + g, scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `(M, K)` (unit column stride) -> (`x_q` `(M, K)` e4m3, `scale` `(M, ceil(K / group))`
    float32), one launch; equal to `fp8.quantize_per_token_group(x, group)`."""
    M, K = x.shape
    groups = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, groups), dtype=torch.float32, device=x.device)
    if M:
        _quantize_kernel[(M, groups)](x, q, scale, K, groups, x.stride(0), GROUP=group,
                                      CHUNK=min(triton.next_power_of_2(group), 1024), FP8_MAX=FP8_MAX,
                                      MIN_AMAX=MIN_AMAX)
    return q, scale


@triton.jit
def _block_fp8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, k_blocks, block_n, blocks_per_split,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    scale_rows = offs_n // block_n  # each output column's row of weight scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * blocks_per_split
    for kb in range(first, tl.minimum(first + blocks_per_split, k_blocks)):
        k = kb * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(xq_ptr + rows[:, None] * K + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        a_scale = tl.load(xs_ptr + rows * k_blocks + kb, mask=m_mask, other=0.0)
        b_scale = tl.load(ws_ptr + scale_rows * k_blocks + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_runs(block: tuple[int, int]) -> bool:
    """Whether the block GEMM takes blocks of `block` `(bn, bk)`: `bk` (the K tile) a power of two >= 32
    (Hopper's FP8 `tl.dot` needs K >= 32)."""
    bk = block[1]
    return bk >= 32 and bk & (bk - 1) == 0


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `(..., K)` @ the block-scaled `weight` `(N, K)`^T (+ `bias`) -> `(..., N)` in `x`'s dtype,
    `x` quantized per token per `block[1]` columns (see the module docstring)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    bn, bk = block
    k_blocks = triton.cdiv(K, bk)
    assert weight.shape[1] == K and weight.is_contiguous() and weight_scale_inv.is_contiguous()
    assert weight_scale_inv.shape == (triton.cdiv(N, bn), k_blocks)
    x2 = unit_stride_rows(x, K)
    xq, xs = quantize_activations(x2, bk)
    M = x2.shape[0]
    if not M:
        return x.new_empty(*lead, N)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    tile_n = 64 if M <= 16 else 32 if M <= 64 else 128  # more programs while M is small
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, tile_n)
    # the float32 partials (split x M x N x 4 bytes) at most a quarter of the weight's N x K bytes
    split, per_split = splits_for(tiles, k_blocks, K // (16 * M)) if M <= 64 else (1, k_blocks)
    out = torch.empty((split, M, N), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, tile_n), split)
    fused_bias = bias is not None and split == 1
    _block_fp8_kernel[grid](xq, xs, weight, weight_scale_inv, bias if fused_bias else out, out, M, N, K, k_blocks, bn,
                            per_split, HAS_BIAS=fused_bias, BLOCK_M=bm, BLOCK_N=tile_n, BLOCK_K=bk, num_warps=4,
                            num_stages=3 if M > 16 else 2)
    out = out[0] if split == 1 else sum_splits(out, bias, x.dtype)
    return out.reshape(*lead, N)


def channel_fp8_runs(weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes the weight `(N, K)`: both dims multiples of 16."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def channel_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `(..., K)` @ (`weight` `(N, K)` e4m3 x `weight_scale` `(N, 1)`)^T + `bias` -> `(..., N)` in
    `x`'s dtype, `x` quantized per token: `_scaled_mm(x_q, weight^T, x_scale, weight_scale^T)`
    (float32 sums, the scales applied to them; a float32 `x` gets a float32 product)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = unit_stride_rows(x, K)
    q, scale = quantize_activations(x2, K)
    out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.float().reshape(1, -1),
                           bias=bias, out_dtype=out_dtype)
    return out.to(x.dtype).reshape(*lead, weight.shape[0])
