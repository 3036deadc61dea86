"""One Triton attention kernel for both runtimes: paged (LLM) and packed varlen (ViT).

Rows of a program are (query token, query head of one KV group) pairs, so a decode step of a
GQA model fills the tile with the group's heads instead of padding one token to `BLOCK_M`.
Grid: `(sequences, kv_heads, row tiles)`. Per key tile the kernel gathers each key's slot:

- paged: `block_tables[seq, pos // page_size] * page_size + pos % page_size` in a
  `(slots, kv_heads, head_dim)` view of the pool, so any page size works (16, 32, 256, ...);
- packed: `kv_starts[seq] + pos` in a contiguous `(tokens, kv_heads, head_dim)` tensor.

Query `i` of a sequence with `q_len` new tokens and `kv_len` keys sits at position
`kv_len - q_len + i` (chunked prefill and decode attend over their cached prefix). Causal:
keys `<=` that position; sliding window `w`: also `> position - w` (transformers' convention).
Online softmax in float32; `tl.dot` at IEEE precision for float32 inputs (no TF32).

Only Triton APIs present in 3.6 are used (the GPU image); CI runs the same kernel on CPU
tensors with `TRITON_INTERPRET=1` set before `triton` is imported. See docs/attention.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this kernel cannot run here (None: it can)."""
    if dtype not in SUPPORTED_DTYPES:
        return f"the Triton attention kernel takes float16, bfloat16 or float32, not {dtype}"
    if head_dim > 256:
        return f"the Triton attention kernel takes head_dim <= 256, not {head_dim}"
    if device.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET=1 is set: the Triton kernel would run in the interpreter on the GPU"
        return None
    if device.type == "cpu":
        return None if interpreting() else "Triton on CPU runs only under TRITON_INTERPRET=1 (tests)"
    return f"the Triton attention kernel does not run on {device.type}"


@triton.jit
def _attention_kernel(
    Q, K, V, O, cu_seqlens_q, kv_lens, block_tables, kv_starts,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    kv_len = tl.load(kv_lens + seq)
    row0 = tile * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = kv_len - q_len + tok

    lo = 0
    hi = kv_len
    if CAUSAL:
        last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = tl.minimum(kv_len, kv_len - q_len + last_tok + 1)
    if SLIDING:
        first_pos = kv_len - q_len + row0 // GROUP
        lo = tl.maximum(first_pos - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if not PAGED:
        kv_start = tl.load(kv_starts + seq)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        pos_ok = pos < kv_len
        if PAGED:
            block = tl.load(block_tables + seq * stride_bt + pos // PAGE_SIZE, mask=pos_ok, other=0)
            slot = block.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        else:
            slot = (kv_start + pos).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = pos_ok[None, :]
        if CAUSAL:
            allowed = allowed & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _launch(q, k, v, cu_seqlens_q, kv_lens, max_query_len, scale, *, block_tables=None, page_size=1,
            kv_starts=None, causal: bool, window: int | None) -> torch.Tensor:
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if total == 0:
        return out
    rows = max_query_len * group
    block_m = 16 if rows <= 16 else 64
    block_n = 32 if q.dtype == torch.float32 else 64
    paged = block_tables is not None
    dummy = cu_seqlens_q
    grid = (cu_seqlens_q.numel() - 1, num_kv_heads, triton.cdiv(rows, block_m))
    _attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, kv_lens, block_tables if paged else dummy, dummy if paged else kv_starts,
        q.stride(0), q.stride(1), k.stride(-3), k.stride(-2), v.stride(-3), v.stride(-2),
        out.stride(0), out.stride(1), block_tables.stride(0) if paged else 0,
        float(scale), int(window or 0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=paged, CAUSAL=causal, SLIDING=bool(window),
        PRECISION="ieee", num_warps=4, num_stages=2,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    kv_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V.

    `q` `(T, H, D)` packed by `cu_seqlens_q` `(B + 1,)` int32; `k_cache`/`v_cache`
    `(blocks, page_size, Hkv, D)`; `kv_lens` `(B,)` int32 keys per sequence (new ones included,
    already written to the pool); `block_tables` `(B, max_blocks)` int32. Returns `(T, H, D)`.
    """
    page_size = k_cache.shape[1]
    k = k_cache.view(-1, *k_cache.shape[2:])
    v = v_cache.view(-1, *v_cache.shape[2:])
    return _launch(q, k, v, cu_seqlens_q, kv_lens, max_query_len, scale, block_tables=block_tables,
                   page_size=page_size, causal=True, window=window)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Bidirectional attention within each packed segment: `q`/`k`/`v` `(T, H, D)`, `cu_seqlens` `(B + 1,)`."""
    cu = cu_seqlens.to(torch.int32)
    lens = (cu[1:] - cu[:-1]).contiguous()
    return _launch(q, k, v, cu, lens, max_seqlen, scale, kv_starts=cu[:-1].contiguous(), causal=False, window=None)
