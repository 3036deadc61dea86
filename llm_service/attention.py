"""Paged attention plugged into the `transformers` decoder layers through `AttentionInterface`.

The decoder runs unchanged: its attention modules project Q/K/V and apply M-RoPE, then call the
function registered here with an `AttentionBatch` in place of the mask. That function writes the
new K/V into the block pool at `slot_mapping` and attends over each sequence's K/V *read back
from the pool* through its block table, packed (varlen) over all scheduled sequences.

- CPU (and CUDA without a varlen kernel): one SDPA call over the packed queries against the
  gathered K/V of every sequence, with a block-diagonal causal mask; sliding-window layers
  (`module.sliding_window`) use that mask restricted to their window (`window_masks`).
- CUDA: `torch.nn.attention.varlen.varlen_attn` straight on the paged pool (`block_table`,
  `seqused_k`), or `flash_attn_varlen_func` when `flash-attn` is installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
ATTN_IMPLEMENTATION = "mmserve_paged"


@dataclass
class AttentionBatch:
    """Per-step attention metadata, shared by every layer.

    `kv_pool` is `(layers, 2, blocks, block_size, kv_heads, head_dim)`; `slot_mapping` `(T,)` the
    pool slot (`block * block_size + offset`) of each new token; `cu_seqlens_q` `(B + 1,)` int32;
    `context_lens` `(B,)` int32 tokens in the pool per sequence after this step; `block_tables`
    `(B, max_blocks)` int32 (padded with a valid id). `gather_slots` / `mask` are the CPU path's
    flat slots of every sequence's context and the `(T, sum(context_lens))` allowed pairs.
    """

    kv_pool: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    backend: str  # "sdpa" | "varlen" | "flash_attn"
    gather_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # CPU path, sliding-window layers: per window size, `mask` restricted to the last `window` keys.
    window_masks: dict[int, torch.Tensor] | None = None


def sdpa_metadata(q_lens: list[int], context_lens: list[int], slot_tables: list[torch.Tensor],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pool slots of every sequence's context, and the block-diagonal causal mask."""
    gather = torch.cat(slot_tables).to(device)
    total_q, total_k = sum(q_lens), sum(context_lens)
    q_seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    k_seq = torch.repeat_interleave(torch.arange(len(context_lens)), torch.tensor(context_lens))
    # position of each query / key inside its own sequence
    q_off = torch.cumsum(torch.tensor([0] + q_lens[:-1]), 0)
    k_off = torch.cumsum(torch.tensor([0] + context_lens[:-1]), 0)
    q_pos = torch.arange(total_q) - q_off[q_seq] + (torch.tensor(context_lens) - torch.tensor(q_lens))[q_seq]
    k_pos = torch.arange(total_k) - k_off[k_seq]
    mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return gather, mask.to(device)


def sliding_windows(decoder) -> tuple[int, ...]:
    """The window sizes of the decoder's sliding-window attention layers (`transformers` attention
    modules carry `sliding_window`: an int on sliding layers, None on full ones)."""
    return tuple(sorted({int(w) for m in decoder.modules() if (w := getattr(m, "sliding_window", None))}))


def sdpa_window_masks(q_lens: list[int], context_lens: list[int], windows: tuple[int, ...],
                      device: torch.device) -> dict[int, torch.Tensor]:
    """Per window, the block-diagonal causal mask of `sdpa_metadata` further restricted as
    `transformers`' `sliding_window_overlay`: a query at position p sees keys at p - window < k <= p."""
    if not windows:
        return {}
    q_seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    k_seq = torch.repeat_interleave(torch.arange(len(context_lens)), torch.tensor(context_lens))
    q_off = torch.cumsum(torch.tensor([0] + q_lens[:-1]), 0)
    k_off = torch.cumsum(torch.tensor([0] + context_lens[:-1]), 0)
    q_pos = torch.arange(sum(q_lens)) - q_off[q_seq] + (torch.tensor(context_lens) - torch.tensor(q_lens))[q_seq]
    k_pos = torch.arange(sum(context_lens)) - k_off[k_seq]
    causal = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return {w: (causal & (k_pos[None, :] > q_pos[:, None] - w)).to(device) for w in windows}


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`transformers` attention function: `query` `(1, H, T, D)`, `key`/`value` `(1, Hkv, T, D)`
    (new tokens only, rotary applied); the step's `AttentionBatch` arrives as the `paged_batch`
    keyword, which every decoder passes down to its attention (a mask argument would not survive
    the mask preprocessing of decoders that build their own). Returns `((1, T, H, D), None)`."""
    batch: AttentionBatch = kwargs.get("paged_batch", attention_mask)
    if not isinstance(batch, AttentionBatch):
        raise TypeError("paged attention needs an AttentionBatch in place of the mask")
    pool = batch.kv_pool[module.layer_idx]
    k_cache, v_cache = pool[0], pool[1]  # (blocks, block_size, Hkv, D)
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_new = key[0].transpose(0, 1)  # (T, Hkv, D)
    v_new = value[0].transpose(0, 1)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k_new)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v_new)
    q = query[0].transpose(0, 1)  # (T, H, D)
    window = getattr(module, "sliding_window", None)
    if batch.backend == "sdpa":
        out = _sdpa(q, k_cache, v_cache, batch, scaling, batch.window_masks[window] if window else batch.mask)
    elif window:
        raise RuntimeError(f"the {batch.backend} attention backend has no sliding-window path")
    elif batch.backend == "flash_attn":
        out = _flash_attn(q, k_cache, v_cache, batch, scaling)
    else:
        out = _varlen(q, k_cache, v_cache, batch, scaling)
    return out.unsqueeze(0), None


def _sdpa(q, k_cache, v_cache, batch: AttentionBatch, scaling, mask):
    kvh, d = k_cache.shape[-2], k_cache.shape[-1]
    k = k_cache.view(-1, kvh, d)[batch.gather_slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
    v = v_cache.view(-1, kvh, d)[batch.gather_slots].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scaling,
        enable_gqa=q.shape[1] != kvh,
    )
    return out[0].transpose(0, 1)  # (T, H, D)


def _varlen(q, k_cache, v_cache, batch: AttentionBatch, scaling):
    from torch.nn.attention.varlen import varlen_attn

    cu_k = F.pad(torch.cumsum(batch.context_lens, 0, dtype=torch.int32), (1, 0))
    return varlen_attn(
        q, k_cache, v_cache, batch.cu_seqlens_q, cu_k, batch.max_query_len, batch.max_context_len,
        scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k_cache.shape[-2],
        seqused_k=batch.context_lens, block_table=batch.block_tables,
    )


def _flash_attn(q, k_cache, v_cache, batch: AttentionBatch, scaling):
    from flash_attn import flash_attn_varlen_func

    cu_k = F.pad(torch.cumsum(batch.context_lens, 0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=batch.cu_seqlens_q, cu_seqlens_k=cu_k,
        max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_context_len,
        softmax_scale=scaling, causal=True, block_table=batch.block_tables,
    )


def choose_backend(device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """The attention path for this device: see the module docstring."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    try:
        import flash_attn  # noqa: F401

        if block_size % 256 == 0:  # flash-attn 2's paged KV wants pages of 256 tokens
            return "flash_attn"
    except ImportError:
        pass
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        if "block_table" in inspect.signature(varlen_attn).parameters:  # paged KV in newer torch only
            return "varlen"
    except ImportError:
        pass
    logger.warning("no paged varlen attention kernel; falling back to masked SDPA on %s", device)
    return "sdpa"


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
