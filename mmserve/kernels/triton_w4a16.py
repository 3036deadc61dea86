"""AWQ int4 weights times 16-bit activations (W4A16) in one Triton GEMM, the int4 unpacked in registers.

`awq_gemm(x, qweight, qzeros, scales, group_size)`: `x` `(M, K)` @ `W` `(K, N)` -> `(M, N)` in `x`'s
dtype, where `W[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]` and `q`, `z` are
the 4-bit values of `qweight` `(K, N/8)` / `qzeros` `(K/group_size, N/8)` int32 (eight a word, the
4 bits at `4 i` holding column `AWQ_ORDER[i]` of the word's 8: AutoAWQ's order, vLLM's too) and `s`
is `scales` `(K/group_size, N)` float16. Each K tile lies in one group (`BLOCK_K` divides
`group_size`); small M splits K (`triton_splitk`). Shapes are fixed by `(M, N, K)` alone: a CUDA graph
captures it. On CPU only in Triton's interpreter, where bfloat16 `tl.dot` is wrong (the CPU tests run
float16 and float32). docs/quantization.md#what-runs-where-all-three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.triton_splitk import splits_for, sum_splits, unit_stride_rows


@triton.jit
def _awq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
                     tiles_per_split, GROUP: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    words = N // 8
    column = offs_n % 8
    shifts = ((column % 2) * 4 + column // 2) * 4  # AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7): column c at nibble i
    m_mask, n_mask = offs_m < M, offs_n < N
    word = offs_n // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, K // BLOCK_K)):
        k = tile * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
        q = tl.load(qweight_ptr + k[:, None].to(tl.int64) * words + word[None, :], mask=n_mask[None, :], other=0)
        group = tile * BLOCK_K // GROUP
        z = tl.load(qzeros_ptr + group * words + word, mask=n_mask, other=0)
        s = tl.load(scales_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        q = (q >> shifts[None, :]) & 0xF
        z = (z >> shifts) & 0xF
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k(group_size: int) -> int | None:
    """The K tile for `group_size`: the largest of 128, 64, 32, 16 dividing it (None: no kernel)."""
    return next((b for b in (128, 64, 32, 16) if group_size % b == 0), None)


def runs(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Whether `awq_gemm` takes these shapes: a 16-bit or float32 `x` with unit column stride, the
    group a multiple of 16."""
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.stride(-1) == 1
            and block_k(group_size) is not None and qweight.shape[0] % group_size == 0)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `(..., K)` @ the AWQ weight `(K, N)` (+ `bias`) -> `(..., N)` in `x`'s dtype (see the module docstring)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = unit_stride_rows(x, K)
    M, N = x2.shape[0], qweight.shape[1] * 8
    assert qweight.shape[0] == K and scales.shape == (K // group_size, N) and qzeros.shape == (K // group_size, N // 8)
    bk = block_k(group_size)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    bn = 64 if M <= 16 else 128
    if not M:
        return x.new_empty(*lead, N)
    k_tiles = K // bk
    # the float32 partials (split x M x N x 4 bytes) at most a quarter of the weight's N x K / 2 bytes
    split, per_split = splits_for(triton.cdiv(M, bm) * triton.cdiv(N, bn), k_tiles, K // (32 * M)) if M <= 64 \
        else (1, k_tiles)
    out = torch.empty((split, M, N), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    fused_bias = bias is not None and split == 1
    _awq_gemm_kernel[grid](x2, qweight, qzeros, scales, bias if fused_bias else out, out, M, N, K, x2.stride(0),
                           per_split, GROUP=group_size, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                           HAS_BIAS=fused_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                           num_stages=2 if M <= 16 else 3)
    out = out[0] if split == 1 else sum_splits(out, bias, x.dtype)
    return out.reshape(*lead, N)
