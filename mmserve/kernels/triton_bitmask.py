"""Structured outputs' token masks applied to the logits in place, in one launch.

`apply_token_bitmask_(logits, bitmask, rows)`: for each `r`, logits row `rows[r]` keeps the tokens
that bitmask row `r` allows (bit `t % 32` of int32 word `t // 32` set, llguidance's and xgrammar's
layout) and every other token's logit becomes -inf. One program per (mask row, block of `BLOCK`
tokens) reads its words once and writes only the refused tokens' logits, in place of the four
kernels and the `(rows, vocab)` boolean tensor of shift, and, bool, masked_fill (vLLM applies its
masks the same way, PR vllm#26866). Tokens past the bitmask's words (a vocabulary padded beyond the
tokenizer's) are refused; bitmask words past the logits' width are ignored. On CPU the kernel runs
only in Triton's interpreter (`TRITON_INTERPRET=1`, tests); `llm_service.grammar` uses it on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # tokens per program: 64 words, read once (Qwen's 151,936 logits: 75 programs a row)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, logits_stride, bitmask_stride,
                          BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + r).to(tl.int64)
    word = tokens // 32
    bits = tl.load(bitmask_ptr + r * bitmask_stride + word, mask=(tokens < vocab) & (word < words), other=0)
    refused = ((bits >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=(tokens < vocab) & refused)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Mask `logits` `(N, V)` in place from `bitmask` `(R, W)` int32 on the same device: logits row
    `rows[r]` (default: row `r`) keeps only the tokens bitmask row `r` allows."""
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device, dtype=torch.int32)
    if not len(rows):
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    vocab = logits.shape[-1]
    grid = (len(rows), triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[-1], logits.stride(0), bitmask.stride(0),
                                BLOCK=BLOCK, num_warps=4)
