"""LoRA deltas of a batch whose rows run under different adapters, in two launches per projection.

A projection's adapters sit in slot-stacked buffers (`llm_service.model.lora.SlotStacks`): `a`
`(slots, S, R, K)` and `b` `(slots, S, N, R)` for its `S` output slices (q | k | v, gate | up, or
one), zero beyond an adapter's rank and for a slice it does not target; `scales` `(slots,)`.
`token_slot` `(>= T,)` int32 names each row's slot, -1 for the base model. Then

- `shrink`: `h[t, s] = x[t] @ a[slot[t], s]^T` `(T, S, R)` float32, one program per (row, slice);
- `expand`: `y[t, offset[s] + n] += scales[slot[t]] * h[t, s] @ b[slot[t], s, n]^T`, one program per
  (row, slice, block of `BLOCK_N` outputs), in place on the projection's output.

Every launch has the batch's shape whatever the rows' adapters (a row of the base model is masked
out), so a decode CUDA graph captures them once and replays any mix of adapters (vLLM's punica
kernels take the same shape: shrink, then expand). On CPU they run only in Triton's interpreter
(`TRITON_INTERPRET=1`, tests); `LoraSet` launches them on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128  # input columns per iteration of a shrink program
BLOCK_N = 128  # outputs per expand program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, K, x_stride, a_slot_stride, a_slice_stride, a_rank_stride,
                   h_stride, R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    on = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, R)
    acc = tl.zeros((R,), dtype=tl.float32)
    a_base = a_ptr + slot * a_slot_stride + s * a_slice_stride
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * x_stride + k, mask=(k < K) & on, other=0.0).to(tl.float32)
        a = tl.load(a_base + r[:, None] * a_rank_stride + k[None, :], mask=(k[None, :] < K) & on, other=0.0)
        acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(h_ptr + t * h_stride + s * R + r, acc)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, scale_ptr, slot_ptr, offset_ptr, size_ptr, y_ptr, h_stride, b_slot_stride,
                   b_slice_stride, b_out_stride, y_stride, R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    size = tl.load(size_ptr + s)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (n < size) & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, R)
    h = tl.load(h_ptr + t * h_stride + s * R + r)
    b = tl.load(b_ptr + slot * b_slot_stride + s * b_slice_stride + n[:, None] * b_out_stride + r[None, :],
                mask=keep[:, None], other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1) * tl.load(scale_ptr + slot)
    out = y_ptr + t * y_stride + tl.load(offset_ptr + s) + n
    y = tl.load(out, mask=keep, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=keep)


def lora_shrink_expand_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                        offsets: torch.Tensor, sizes: torch.Tensor, token_slot: torch.Tensor,
                        max_size: int) -> None:
    """Add each row's adapter delta to `y` `(T, out)` in place (the module docstring); `x` `(T, K)`,
    `offsets` / `sizes` `(S,)` int32 where each slice lies in `y`, `max_size` the largest slice."""
    rows, (_, slices, rank, k) = x.shape[0], a.shape
    if not rows:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    h = torch.empty(rows, slices, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, slices)](x, a, token_slot, h, k, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
                                   h.stride(0), R=rank, BLOCK_K=BLOCK_K)
    _expand_kernel[(rows, slices, triton.cdiv(max_size, BLOCK_N))](
        h, b, scales, token_slot, offsets, sizes, y, h.stride(0), b.stride(0), b.stride(1), b.stride(2),
        y.stride(0), R=rank, BLOCK_N=BLOCK_N)
