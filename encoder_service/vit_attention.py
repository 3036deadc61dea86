"""Packed ViT attention: one attention call per layer over every item of a batch (docs/attention.md).

`use_packed_attention(tower)` registers `packed_attention` with `transformers`' `AttentionInterface`.
Its name contains "flash" because the Qwen2-VL / Qwen2.5-VL vision attention hands `cu_seqlens` to
flash-like implementations only. CUDA: torch's varlen flash attention (float16/bfloat16), else the
Triton varlen kernel; CPU: `grouped_sdpa`, one batched SDPA per distinct segment length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VIT_ATTN_IMPLEMENTATION = "mmserve_flash_packed_vit"


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """`query`/`key`/`value` `(1, H, T, D)` of all segments packed by `cu_seq_lens_q`;
    returns `((1, T, H, D), None)`."""
    if cu_seq_lens_q is None:
        raise ValueError("packed ViT attention needs cu_seq_lens_q (a 'flash' implementation name passes it)")
    other_keys = cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
    if other_keys and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):
        raise ValueError("packed ViT attention is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    lengths = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    max_len = int(max_length_q) if max_length_q is not None else int(lengths.max())
    if (flash := _torch_varlen(q)) is not None:
        cu = cu_seq_lens_q.to(torch.int32)
        out = flash(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scaling)
    elif _use_triton(q):
        from mmserve.kernels.triton_attention import varlen_attention

        out = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, max_len, scaling)
    else:
        out = grouped_sdpa(q, k, v, lengths, scaling)
    return out.unsqueeze(0), None


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Segments `(T, H, D)` of `lengths` -> one batched SDPA call per distinct length -> `(T, H, D)`.

    Exact FLOPs (no padding, no cross-segment mask): CPU has no varlen attention kernel, and
    one call over segments padded to the longest measured 2x slower than this on mixed sizes.
    """
    total, heads, dim = q.shape
    lengths = lengths[lengths > 0]  # a padded batch's unused segments (encoder_service.vit_graphs)
    distinct = torch.unique(lengths).tolist()
    if len(distinct) == 1:  # one item, or equal windows / frames: a single call
        num, length = lengths.numel(), distinct[0]

        def batched(t):
            return t.reshape(num, length, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=scaling)
        return out.transpose(1, 2).reshape(total, heads, dim)
    starts = torch.cumsum(lengths, 0) - lengths
    out = torch.empty_like(q)
    for length in distinct:
        segments = (lengths == length).nonzero()[:, 0]
        rows = (starts[segments, None] + torch.arange(length, device=q.device)).flatten()

        def batched(t):
            return t[rows].view(segments.numel(), length, heads, dim).transpose(1, 2)

        group = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=scaling)
        out[rows] = group.transpose(1, 2).reshape(-1, heads, dim)
    return out


def _torch_varlen(q: torch.Tensor):
    """torch's varlen flash attention where it runs (CUDA, float16/bfloat16, head_dim a multiple
    of 8 up to 256), else None. Non-causal by default."""
    d = q.shape[-1]
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        return None
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def _use_triton(q: torch.Tensor) -> bool:
    if q.device.type != "cuda":
        return False
    try:
        from mmserve.kernels.triton_attention import unsupported_reason
    except ImportError:
        return False
    return unsupported_reason(q.device, q.dtype, q.shape[-1]) is None


def use_packed_attention(tower: torch.nn.Module) -> torch.nn.Module:
    """Route every attention layer of `tower` through `packed_attention`; returns `tower`.

    Set on the config directly: `set_attn_implementation` would try to load a flash-attn kernel
    for a name containing "flash".
    """
    from transformers import AttentionInterface

    AttentionInterface.register(VIT_ATTN_IMPLEMENTATION, packed_attention)
    tower.config._attn_implementation = VIT_ATTN_IMPLEMENTATION
    return tower
