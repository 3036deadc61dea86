"""One Triton attention kernel for both runtimes: paged (LLM) and packed varlen (ViT), with split-K decode.

Rows of a program are (query token, query head of one KV group) pairs; grid `(sequences, kv_heads, row
tiles)` (the third axis the key slice with `splits > 1`). Query `i` of a sequence with `q_len` new tokens
and `kv_len` keys sits at position `kv_len - q_len + i`. Only Triton APIs present in 3.6 are used; CI
runs the kernel on CPU tensors under `TRITON_INTERPRET=1`. The layout, masks and tiles: docs/attention.md.
"""

from __future__ import annotations

import functools
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


MAX_SPLITS = 16  # key slices of a split-K decode, at most
MIN_SPLIT_KEYS = 256  # keys per slice, at least


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Key slices for a decode step: enough programs to fill the GPU's SMs twice over, none with
    fewer than `MIN_SPLIT_KEYS` keys of the longest context (1: no split). A decode graph is
    captured at the model's longest context; its slices past a sequence's keys end at once."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 8  # the interpreter: a few
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, 2 * sms // programs, max_context_len // MIN_SPLIT_KEYS))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _attention_kernel(
    Q, K, V, O, cu_seqlens_q, kv_lens, block_tables, kv_starts, Part, Lse,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    stride_pt, stride_ph, stride_lt, stride_lh,
    scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLITS > 1:  # one row tile; the third axis is the key slice
        tile = 0
        split = tl.program_id(2)
    else:
        tile = tl.program_id(2)
        split = 0
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
    if SPLITS > 1:  # this program's slice: whole key tiles
        chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)
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
        p = tl.where(allowed, tl.exp(qk - m_new[:, None]), 0.0)  # a row with no key yet adds nothing
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS > 1:  # the slice's normalised output and log-sum-exp (-inf: no key in this slice)
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        part = acc / l_safe[:, None]
        p_ptrs = Part + (q_start + tok)[:, None] * stride_pt + head[:, None] * stride_ph + split * HEAD_DIM \
            + offs_d[None, :]
        tl.store(p_ptrs, part, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
        tl.store(Lse + (q_start + tok) * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        o_ptrs = O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    Part, Lse, O, stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One (query token, head): its key slices' outputs weighted by exp(their log-sum-exp)."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(Lse + tok * stride_lt + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # a slice with no key: exp(-inf) = 0
    part = tl.load(Part + tok * stride_pt + head * stride_ph + offs_s[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(O + tok * stride_ot + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


def _launch(q, k, v, cu_seqlens_q, kv_lens, max_query_len, scale, *, block_tables=None, page_size=1,
            kv_starts=None, causal: bool, window: int | None, splits: int = 1) -> torch.Tensor:
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
    if splits > 1 and rows > block_m:
        raise ValueError(f"split-K attention takes one row tile ({rows} rows of queries x heads per KV head)")
    paged = block_tables is not None
    dummy = cu_seqlens_q
    part = lse = out
    if splits > 1:
        part = torch.empty(total, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(total, num_heads, splits, dtype=torch.float32, device=q.device)
    grid = (cu_seqlens_q.numel() - 1, num_kv_heads, splits if splits > 1 else triton.cdiv(rows, block_m))
    block_d = max(16, triton.next_power_of_2(head_dim))
    _attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, kv_lens, block_tables if paged else dummy, dummy if paged else kv_starts,
        part, lse,
        q.stride(0), q.stride(1), k.stride(-3), k.stride(-2), v.stride(-3), v.stride(-2),
        out.stride(0), out.stride(1), block_tables.stride(0) if paged else 0,
        part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        float(scale), int(window or 0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=paged, CAUSAL=causal, SLIDING=bool(window),
        PRECISION="ieee", SPLITS=splits, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _combine_kernel[(total, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
            num_warps=4,
        )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    kv_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                    window: int | None = None, splits: int = 1) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V.

    `q` `(T, H, D)` packed by `cu_seqlens_q` `(B + 1,)` int32; `k_cache`/`v_cache`
    `(blocks, page_size, Hkv, D)`; `kv_lens` `(B,)` int32 keys per sequence (new ones included,
    already written to the pool); `block_tables` `(B, max_blocks)` int32. Returns `(T, H, D)`.
    `splits > 1`: split-K over that many key slices (decode: one query per sequence; see
    `decode_splits`).
    """
    k = k_cache.view(-1, *k_cache.shape[2:])
    v = v_cache.view(-1, *v_cache.shape[2:])
    return _launch(q, k, v, cu_seqlens_q, kv_lens, max_query_len, scale, block_tables=block_tables,
                   page_size=k_cache.shape[1], causal=True, window=window, splits=splits)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Bidirectional attention within each packed segment: `q`/`k`/`v` `(T, H, D)`, `cu_seqlens` `(B + 1,)`."""
    cu = cu_seqlens.to(torch.int32)
    lens = (cu[1:] - cu[:-1]).contiguous()
    return _launch(q, k, v, cu, lens, max_seqlen, scale, kv_starts=cu[:-1].contiguous(), causal=False, window=None)
