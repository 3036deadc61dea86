"""The end of a split-K GEMM in one launch: `(SPLIT, M, N)` float32 partial sums -> their sum (+ a
bias) in the output dtype, the splits added in order (deterministic, no atomics). Used by the
quantized GEMMs (`triton_w4a16`, `triton_fp8_block`) when a small batch gives too few output
tiles to fill the GPU. On CPU only in Triton's interpreter (`TRITON_INTERPRET=1`, tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024

# split K until about this many programs run (two per H100/H200 SM); not tuned on a GPU here
TARGET_PROGRAMS = 264


def unit_stride_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` as `(rows, width)` with unit column stride (a copy only where the view has none)."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def splits_for(tiles: int, k_tiles: int, max_split: int) -> tuple[int, int]:
    """(splits, K tiles per split) for `tiles` output tiles over `k_tiles` K tiles: more splits
    while the tiles alone are fewer than `TARGET_PROGRAMS`, at most `max_split` (the partial sums
    are written and read once more: the caller bounds their bytes against the weight's), every
    split non-empty."""
    split = max(1, min(k_tiles, max_split, TARGET_PROGRAMS // max(tiles, 1)))
    per_split = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, per_split), per_split


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`partial` `(SPLIT, M, N)` float32, contiguous -> `(M, N)` in `dtype`: the sum over splits + `bias`."""
    split, M, N = partial.shape
    out = torch.empty((M, N), dtype=dtype, device=partial.device)
    if M * N:
        _sum_splits_kernel[(triton.cdiv(M * N, BLOCK),)](partial, bias if bias is not None else out, out, M * N, N,
                                                         SPLIT=split, HAS_BIAS=bias is not None, BLOCK=BLOCK)
    return out
