"""The preallocated paged KV pool: one tensor, sized from a memory budget (shared with the state
slots of models with linear-attention layers)."""

from __future__ import annotations

import logging

import torch

from llm_service.config import EngineConfig

logger = logging.getLogger(__name__)
_CPU_DEFAULT_BYTES = 512 * 1024 * 1024


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def memory_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV pool and the state slots: `kv_cache_bytes`, else the device default (on
    CUDA `gpu_memory_utilization` of the device minus what is in use, on CPU 512 MiB)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1 - config.gpu_memory_utilization))
    return _CPU_DEFAULT_BYTES


def pool_sizes(config: EngineConfig, block_bytes: int, slot_bytes: int, device: torch.device) -> tuple[int, int]:
    """(KV blocks, state slots) that fit the budget; `slot_bytes` 0 (no state layers): no slots.

    Slots come first: `num_state_slots`, else `max_num_seqs` as long as they take at most half
    the budget; the KV pool gets the rest (`num_kv_blocks` overrides the KV side, and then the
    slots are `num_state_slots` or `max_num_seqs`, outside any budget)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, (config.num_state_slots or config.max_num_seqs) if slot_bytes else 0
    budget = memory_budget(config, device)
    slots = 0
    if slot_bytes:
        slots = config.num_state_slots or min(config.max_num_seqs, budget // 2 // slot_bytes)
        if slots < 1:
            raise ValueError(f"memory budget of {budget} bytes holds no state slot of {slot_bytes} bytes")
    blocks = (budget - slots * slot_bytes) // block_bytes
    if blocks < 1:
        raise ValueError(f"KV budget of {budget - slots * slot_bytes} bytes holds no block of {block_bytes} bytes")
    return int(blocks), int(slots)


def allocate_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)`; the last block is scratch
    (padding rows of captured decode batches write there), never handed out."""
    pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    logger.info("KV pool: %d blocks of %d tokens, %.1f MiB on %s", num_blocks, block_size,
                pool.numel() * pool.element_size() / 2**20, device)
    return pool
