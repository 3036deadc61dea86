"""The preallocated paged KV pool: one tensor, sized from a memory budget."""

from __future__ import annotations

import logging

import torch

from llm_service.config import EngineConfig

logger = logging.getLogger(__name__)
_CPU_DEFAULT_BYTES = 512 * 1024 * 1024


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """Blocks that fit the budget: `num_kv_blocks`, else `kv_cache_bytes`, else the device default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1 - config.gpu_memory_utilization))
        else:
            budget = _CPU_DEFAULT_BYTES
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block of {block_bytes} bytes")
    return int(blocks)


def allocate_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)`; the last block is scratch
    (padding rows of captured decode batches write there), never handed out."""
    pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    logger.info("KV pool: %d blocks of %d tokens, %.1f MiB on %s", num_blocks, block_size,
                pool.numel() * pool.element_size() / 2**20, device)
    return pool
