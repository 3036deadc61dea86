"""The preallocated paged KV pool: one tensor, sized from a memory budget."""

from __future__ import annotations

import logging

import torch

from llm_service.config import EngineConfig

logger = logging.getLogger(__name__)
_CPU_DEFAULT_BYTES = 512 * 1024 * 1024


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cuda_kv_budget(free: int, total: int, in_use: int, utilization: float, share: float) -> int:
    """KV bytes for a replica that owns `share` of a device of `total` bytes (Ray's fractional
    `num_gpus`; an encoder replica may hold the rest): `utilization` of its share less what it
    already holds (`in_use`: weights, a colocated encoder), and never more than the device has
    `free` beyond its share's headroom (`1 - utilization` of it: activations, CUDA graphs), in
    case another process took more than its own share. With `share` 1 that is the whole device:
    `free - total * (1 - utilization)`, as before shares existed."""
    own = share * total
    return int(min(own * utilization - in_use, free - own * (1 - utilization)))


def num_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """Blocks that fit the budget: `num_kv_blocks`, else `kv_cache_bytes`, else the device default
    (on CUDA `cuda_kv_budget` of the replica's `device_share`)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            in_use = torch.cuda.memory_reserved(device)
            budget = cuda_kv_budget(free, total, in_use, config.gpu_memory_utilization, config.device_share)
            logger.info("KV budget %.1f MiB: %.0f%% of this replica's %.2f share of %.1f GiB, %.1f MiB already "
                        "held, %.1f MiB free on the device", budget / 2**20, 100 * config.gpu_memory_utilization,
                        config.device_share, total / 2**30, in_use / 2**20, free / 2**20)
        else:
            budget = _CPU_DEFAULT_BYTES
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block of {block_bytes} bytes: raise "
                         "gpu_memory_utilization or the replica's num_gpus, or set kv_cache_memory_mb")
    return int(blocks)


def allocate_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)`; the last block is scratch
    (padding rows of captured decode batches write there), never handed out."""
    pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    logger.info("KV pool: %d blocks of %d tokens, %.1f MiB on %s", num_blocks, block_size,
                pool.numel() * pool.element_size() / 2**20, device)
    return pool
