"""Paged attention: the engine's own decoder layers call `paged` (`llm_service.model.layers`); a
`transformers` decoder runs unchanged, its attention modules calling `paged_attention`, plugged in
through `AttentionInterface`, with an `AttentionBatch` in place of the mask. Either writes the
new K/V into the block pool at `slot_mapping` and attends over each sequence's K/V *read back
from the pool* through its block table, packed (varlen) over all scheduled sequences.

Two backends, chosen and checked once at startup by `choose_backend`:

- `triton` (CUDA default): `mmserve.kernels.triton_attention.paged_attention` straight on the pool at
  any block size, causal over each sequence's cached prefix, GQA, per-layer sliding windows.
  On CPU only under `TRITON_INTERPRET=1` (tests). See docs/attention.md.
- `sdpa` (CPU default): one SDPA call over the packed queries against the gathered K/V of every
  sequence with a block-diagonal causal mask. Dense, O(T * sum(context)) memory: on CUDA only
  when asked for explicitly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llm_service.model.transfer import to_device

logger = logging.getLogger(__name__)
ATTN_IMPLEMENTATION = "mmserve_paged"


@dataclass
class AttentionBatch:
    """Per-step attention metadata, shared by every layer.

    `kv_pool` is `(layers, 2, blocks, block_size, kv_heads, head_dim)`; `slot_mapping` `(T,)` the
    pool slot (`block * block_size + offset`) of each new token; `cu_seqlens_q` `(B + 1,)` int32;
    `context_lens` `(B,)` int32 tokens in the pool per sequence after this step; `block_tables`
    `(B, max_blocks)` int32 (padded with a valid id); `windows` the sliding window of each layer
    (None: full attention); `kv_layers` the pool index of each decoder layer's K/V when the pool
    covers only some layers (hybrid models: not the linear-attention ones), empty when it is the
    layer index itself. `gather_slots` / `masks` are the SDPA path's flat slots of every
    sequence's context and, per window, the `(T, sum(context_lens))` allowed pairs; for a decode
    step (one query per sequence) `decode_slots` `(B, S)` are instead each sequence's context
    slots padded to the longest, and `masks` per window `(B, 1, 1, S)`.
    """

    kv_pool: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    backend: str  # "sdpa" | "triton"
    kv_splits: int = 1  # triton, one query per sequence: key slices (split-K decode; `decode_splits`)
    windows: tuple[int | None, ...] = ()
    kv_layers: tuple[int | None, ...] = ()
    gather_slots: torch.Tensor | None = None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    decode_slots: torch.Tensor | None = None


def layer_windows(text_config, num_layers: int) -> tuple[int | None, ...]:
    """Sliding window of each decoder layer, as `transformers` reads it (`layer_types`)."""
    types = getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers
    window = getattr(text_config, "sliding_window", None)
    return tuple(window if t == "sliding_attention" and window else None for t in types[:num_layers])


def sdpa_metadata(q_lens: list[int], context_lens: list[int], slot_tables: list[torch.Tensor],
                  device: torch.device, windows=(None,)) -> tuple[torch.Tensor, dict[int | None, torch.Tensor]]:
    """Flat pool slots of every sequence's context, and the block-diagonal causal mask per window."""
    gather = to_device(torch.cat(slot_tables), device)
    total_q, total_k = sum(q_lens), sum(context_lens)
    q_seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    k_seq = torch.repeat_interleave(torch.arange(len(context_lens)), torch.tensor(context_lens))
    # position of each query / key inside its own sequence
    q_off = torch.cumsum(torch.tensor([0] + q_lens[:-1]), 0)
    k_off = torch.cumsum(torch.tensor([0] + context_lens[:-1]), 0)
    q_pos = torch.arange(total_q) - q_off[q_seq] + (torch.tensor(context_lens) - torch.tensor(q_lens))[q_seq]
    k_pos = torch.arange(total_k) - k_off[k_seq]
    causal = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    windowed = {w: causal if w is None else causal & (k_pos[None, :] > q_pos[:, None] - w) for w in set(windows)}
    return gather, {w: to_device(mask, device) for w, mask in windowed.items()}


def sdpa_decode_metadata(block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                         block_size: int, windows=(None,)) -> tuple[torch.Tensor, dict[int | None, torch.Tensor]]:
    """A decode step's context slots `(B, S)` (S = `max_context_len`, rows past a sequence's
    context padded) from its block tables, and per window the `(B, 1, 1, S)` keys each query sees."""
    blocks = -(-max_context_len // block_size)
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = (block_tables[:, :blocks].long().unsqueeze(-1) * block_size + offsets).flatten(1)[:, :max_context_len]
    key = torch.arange(max_context_len, device=block_tables.device)
    last = (context_lens.long() - 1).unsqueeze(1)  # the query's own position
    masks = {w: key <= last if w is None else (key <= last) & (key > last - w) for w in set(windows)}
    return slots, {w: mask[:, None, None, :] for w, mask in masks.items()}


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`transformers` attention function: `query` `(1, H, T, D)`, `key`/`value` `(1, Hkv, T, D)`
    (new tokens only, rotary applied); the step's `AttentionBatch` arrives as the `paged_batch`
    keyword, which every decoder passes down to its attention (a mask argument would not survive
    the mask preprocessing of decoders that build their own). Returns `((1, T, H, D), None)`."""
    batch: AttentionBatch = kwargs.get("paged_batch", attention_mask)
    if not isinstance(batch, AttentionBatch):
        raise TypeError("paged attention needs an AttentionBatch in place of the mask")
    out = paged(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                batch, scaling)
    return out.unsqueeze(0), None


def layer_cache(batch: AttentionBatch, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder layer `layer_idx`'s K and V in the pool, `(blocks, block_size, Hkv, D)` each."""
    pool = batch.kv_pool[batch.kv_layers[layer_idx] if batch.kv_layers else layer_idx]
    return pool[0], pool[1]


def paged(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
          scaling: float | None = None) -> torch.Tensor:
    """Decoder layer `layer_idx`'s attention over the step: the new tokens' `k`/`v` `(T, Hkv, D)`
    (rotary applied) written into the pool at `slot_mapping`, then `attend`. Returns `(T, H, D)`."""
    k_cache, v_cache = layer_cache(batch, layer_idx)
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    return attend(layer_idx, q, batch, scaling)


def attend(layer_idx: int, q: torch.Tensor, batch: AttentionBatch, scaling: float | None = None) -> torch.Tensor:
    """The queries `q` `(T, H, D)` of layer `layer_idx` over each sequence's K/V read back from
    the pool (the step's own K/V already written). Returns `(T, H, D)`."""
    k_cache, v_cache = layer_cache(batch, layer_idx)
    kvh, d = k_cache.shape[-2], k_cache.shape[-1]
    window = batch.windows[layer_idx] if batch.windows else None
    if scaling is None:
        scaling = d ** -0.5
    if batch.backend == "triton":
        from mmserve.kernels.triton_attention import paged_attention as triton_paged

        return triton_paged(q.contiguous(), k_cache, v_cache, batch.cu_seqlens_q, batch.context_lens,
                            batch.block_tables, batch.max_query_len, scaling, window, batch.kv_splits)
    decode = batch.decode_slots is not None  # one query per sequence over its own context, `(B, S)` slots
    slots = batch.decode_slots if decode else batch.gather_slots[None]  # packed: one batch of every context
    k = k_cache.view(-1, kvh, d)[slots].transpose(1, 2)  # (B or 1, Hkv, S, D)
    v = v_cache.view(-1, kvh, d)[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2) if decode else q.transpose(0, 1)[None], k, v,
                                         attn_mask=batch.masks[window], scale=scaling, enable_gqa=q.shape[1] != kvh)
    return out[:, :, 0] if decode else out[0].transpose(0, 1)  # (B or T, H, D)


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The attention backend for this replica (`requested`: `EngineConfig.attention_backend`), or
    ValueError saying why it cannot run. `auto` is `triton` on CUDA (never a silent dense fallback
    there) and `sdpa` elsewhere."""
    backend = requested if requested != "auto" else ("triton" if device.type == "cuda" else "sdpa")
    if backend == "sdpa":
        if device.type == "cuda":
            logger.warning("attention_backend='sdpa' on CUDA: dense attention over every step's gathered "
                           "K/V, O(tokens x context) memory; meant for debugging")
        return backend
    try:
        from mmserve.kernels.triton_attention import unsupported_reason
    except ImportError as e:
        raise ValueError(f"attention backend 'triton' needs the triton package: {e}") from e
    if reason := unsupported_reason(device, dtype, head_dim):
        hint = " (attention_backend='sdpa' runs dense attention instead)" if requested == "auto" else ""
        raise ValueError(f"attention backend 'triton' cannot run: {reason}{hint}")
    return backend


def install(decoder) -> None:
    """A `transformers` decoder's attention modules call `paged_attention` from now on (the
    engine's own decoder, `llm_service.model.layers`, calls `paged` itself)."""
    if hasattr(decoder, "set_attn_implementation"):
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
        decoder.set_attn_implementation(ATTN_IMPLEMENTATION)
