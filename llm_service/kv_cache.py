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


def cuda_kv_budget(free: int, total: int, in_use: int, utilization: float, share: float) -> int:
    """KV bytes for a replica that owns `share` of a device of `total` bytes (Ray's fractional
    `num_gpus`; an encoder replica may hold the rest): `utilization` of its share less what it
    already holds (`in_use`: weights, a colocated encoder), and never more than the device has
    `free` beyond its share's headroom (`1 - utilization` of it: activations, CUDA graphs), in
    case another process took more than its own share. With `share` 1 that is the whole device:
    `free - total * (1 - utilization)`, as before shares existed."""
    own = share * total
    return int(min(own * utilization - in_use, free - own * (1 - utilization)))


def memory_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV pool and the state slots: `kv_cache_bytes`, else the device default (on
    CUDA `cuda_kv_budget` of the replica's `device_share`, on CPU 512 MiB)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return _CPU_DEFAULT_BYTES
    free, total = torch.cuda.mem_get_info(device)
    in_use = torch.cuda.memory_reserved(device)
    budget = cuda_kv_budget(free, total, in_use, config.gpu_memory_utilization, config.device_share)
    logger.info("KV budget %.1f MiB: %.0f%% of this replica's %.2f share of %.1f GiB, %.1f MiB already held, "
                "%.1f MiB free on the device", budget / 2**20, 100 * config.gpu_memory_utilization,
                config.device_share, total / 2**30, in_use / 2**20, free / 2**20)
    return budget


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
        raise ValueError(f"KV budget of {budget - slots * slot_bytes} bytes holds no block of {block_bytes} bytes: "
                         "raise gpu_memory_utilization or the replica's num_gpus, or set kv_cache_memory_mb")
    return int(blocks), int(slots)


def allocate_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)`; the last block is scratch
    (padding rows of captured decode batches write there), never handed out."""
    pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    logger.info("KV pool: %d blocks of %d tokens, %.1f MiB on %s", num_blocks, block_size,
                pool.numel() * pool.element_size() / 2**20, device)
    return pool
