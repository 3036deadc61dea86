"""Packed ViT attention: one attention call per layer over every item of a batch.

The towers stay unmodified: `use_packed_attention(tower)` registers `packed_attention` with
`transformers`' `AttentionInterface` and selects it on the tower's config. Its name contains
"flash" because the Qwen2-VL / Qwen2.5-VL vision attention hands `cu_seqlens` to the
attention function only for flash-like implementations; for any other it loops over the
segments with one small call each, in every layer.

- CUDA: the Triton varlen kernel (`mmserve.triton_attention.varlen_attention`), bidirectional
  within each segment, no padding.
- CPU (or no usable Triton): one SDPA call over the segments padded to the longest, keys past
  each segment's end masked (no mask when all segments have one length, e.g. windows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VIT_ATTN_IMPLEMENTATION = "mmserve_flash_packed_vit"


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """`query`/`key`/`value` `(1, H, T, D)` of all segments packed by `cu_seq_lens_q`;
    returns `((1, T, H, D), None)`."""
    if cu_seq_lens_q is None or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q, cu_seq_lens_k)):
        raise ValueError("packed ViT attention needs equal cu_seq_lens_q / cu_seq_lens_k (self-attention)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    lengths = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    max_len = int(max_length_q) if max_length_q is not None else int(lengths.max())
    if _use_triton(q):
        from mmserve.triton_attention import varlen_attention

        out = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, max_len, scaling)
    else:
        out = padded_sdpa(q, k, v, lengths, max_len, scaling)
    return out.unsqueeze(0), None


def padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, max_len: int,
                scaling: float) -> torch.Tensor:
    """Segments `(T, H, D)` of `lengths` -> one `(B, H, max_len, D)` SDPA call -> `(T, H, D)`."""
    total, heads, dim = q.shape
    num = lengths.numel()
    if num == 1 or bool((lengths == max_len).all()):  # no padding at all
        def batched(t):
            return t.reshape(num, max_len, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=scaling)
        return out.transpose(1, 2).reshape(total, heads, dim)
    seg = torch.repeat_interleave(torch.arange(num, device=q.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    dest = seg * max_len + torch.arange(total, device=q.device) - starts[seg]

    def padded(t):
        out = t.new_zeros(num * max_len, heads, dim)
        out[dest] = t
        return out.view(num, max_len, heads, dim).transpose(1, 2)

    valid = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=valid[:, None, None, :],
                                         scale=scaling)
    return out.transpose(1, 2).reshape(num * max_len, heads, dim)[dest]


def _use_triton(q: torch.Tensor) -> bool:
    if q.device.type != "cuda":
        return False
    try:
        from mmserve.triton_attention import unsupported_reason
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
