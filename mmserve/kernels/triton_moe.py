"""The mixture-of-experts experts as two grouped GEMM launches (Triton), after vLLM's `fused_moe`.

A step's `S = T * k` (token, slot) pairs are sorted by expert and each expert's run is padded to a
whole number of `BLOCK_M` rows with the sentinel `S` (`align`), into buffers of a length fixed by
`(S, E, BLOCK_M)` alone: no host sync, so a CUDA graph captures the forward at each batch size. Then
`_expert_gemm_kernel` runs gate/up over every block, `apply_gate` runs in torch, and the same kernel
runs down (times each pair's routing weight) into `(S, H)` float32 rows (float64 for float64 input) in
pair order, which `.view(T, k, H).sum(1)` adds up: deterministic, no atomics. On CPU only in Triton's
interpreter (`TRITON_INTERPRET=1`, tests). docs/attention.md (MoE experts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Blocks(NamedTuple):
    """Tile sizes and launch options of the grouped GEMMs."""

    m: int
    n: int
    k: int
    num_warps: int
    num_stages: int


class Alignment(NamedTuple):
    """The expert-sorted, block-padded pairs (`align`).

    `sorted_pairs` `(P,)` int32: flat pair ids `t * k + slot`, each expert's run starting on a
    multiple of `BLOCK_M` and padded with `S`; `block_experts` `(P / BLOCK_M,)` int32: the expert
    of each block, `E` for the blocks past the last expert's run. `P` = `padded_length(S, E, BLOCK_M)`.
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor


def blocks_for(dtype: torch.dtype, num_pairs: int, num_experts: int) -> Blocks:
    """Tiles for `num_pairs` pairs over `num_experts` experts: 16-row blocks while experts average
    at most 8 pairs (decode), 64 beyond. Not tuned on a GPU (vLLM's defaults are of this size)."""
    block_m = 16 if num_pairs <= 8 * num_experts else 64
    if dtype == torch.float64:
        return Blocks(block_m, 32, 32, 4, 2)
    if dtype == torch.float32:
        return Blocks(block_m, 64, 32, 4, 2)
    return Blocks(block_m, 64, 128, 4, 3) if block_m == 16 else Blocks(block_m, 128, 64, 4, 3)


def padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the pairs once each expert's run is padded to `block_m`, in whole blocks: at
    most `min(E, S)` experts have pairs, each padded by at most `block_m - 1`."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs of `top_k_index` `(T, k)` by expert (token order within one) and pad each
    expert's run to a multiple of `block_m`, on the device, without a host sync."""
    flat = top_k_index.reshape(-1).long()
    num_pairs = flat.numel()
    length = padded_length(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    gap = (padded_ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - start, per expert
    order = torch.argsort(flat, stable=True)
    slots = torch.arange(num_pairs, device=flat.device) + gap[flat[order]]
    sorted_pairs = torch.full((length,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, slots, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return Alignment(sorted_pairs, block_experts)


@triton.jit
def _expert_gemm_kernel(
    A, B, C, Weights, sorted_pairs, block_experts,
    num_pairs, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    NUM_EXPERTS: tl.constexpr, ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """`C[p, n] = (w[p] *) sum_k A[p // ROWS_PER_A, k] * B[e, n, k]` for the pairs `p` of block
    `program_id(1)` (expert `e`) and the `BLOCK_N` outputs of tile `program_id(0)`."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_experts + pid_m)
    if expert >= NUM_EXPERTS:  # past the last expert's padded run
        return
    pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs  # padding rows: the sentinel num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_cols = offs_n % N  # in bounds without a mask; the columns past N are not stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + expert.to(tl.int64) * stride_be + b_cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if WEIGHTED:
        acc = acc * tl.load(Weights + pairs, mask=pair_ok, other=0.0).to(ACC)[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


def _expert_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, alignment: Alignment, blocks: Blocks,
                 rows_per_a: int, routing_weights: torch.Tensor | None = None) -> None:
    """`out[p] = (routing_weights[p] *) a[p // rows_per_a] @ weight[expert of p].T` for every pair `p`."""
    num_experts, n, k = weight.shape
    acc = tl.float64 if a.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(n, blocks.n), alignment.block_experts.numel())
    _expert_gemm_kernel[grid](
        a, weight, out, out if routing_weights is None else routing_weights,
        alignment.sorted_pairs, alignment.block_experts,
        out.shape[0], n, k,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        NUM_EXPERTS=num_experts, ROWS_PER_A=rows_per_a, WEIGHTED=routing_weights is not None, ACC=acc,
        PRECISION="ieee" if a.dtype in (torch.float32, torch.float64) else "tf32",
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, EVEN_K=k % blocks.k == 0,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )


def fused_experts(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  apply_gate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over k of `top_k_weights[t, k] * down_e(apply_gate(gate_up_e(hidden_states[t])))`, `e` =
    `top_k_index[t, k]`, `(T, H)` in `hidden_states`' dtype.

    `hidden_states` `(T, H)`; `gate_up_proj` `(E, 2I, H)` (gate rows, then up rows); `down_proj`
    `(E, H, I)`; `top_k_index` `(T, k)` int; `top_k_weights` `(T, k)` any float dtype; `apply_gate`:
    `(S, 2I)` gate/up rows -> `(S, I)`. The k pairs of a token are summed in float32 (float64 for
    float64 input), in a fixed order.
    """
    num_tokens, top_k = top_k_index.shape
    num_experts, hidden = gate_up_proj.shape[0], gate_up_proj.shape[2]
    num_pairs = num_tokens * top_k
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden)
    blocks = blocks_for(hidden_states.dtype, num_pairs, num_experts)
    alignment = align(top_k_index, num_experts, blocks.m)
    gate_up = hidden_states.new_empty(num_pairs, gate_up_proj.shape[1])
    _expert_gemm(hidden_states, gate_up_proj, gate_up, alignment, blocks, rows_per_a=top_k)
    activated = apply_gate(gate_up).to(hidden_states.dtype)
    pairs = torch.empty(num_pairs, hidden, dtype=acc, device=hidden_states.device)
    _expert_gemm(activated, down_proj, pairs, alignment, blocks, rows_per_a=1,
                 routing_weights=top_k_weights.reshape(-1))
    return pairs.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
