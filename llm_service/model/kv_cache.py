"""The preallocated paged KV pool: one tensor, sized from a memory budget (shared with the state
slots and state snapshots of models with linear-attention layers)."""

from __future__ import annotations

import logging
from typing import NamedTuple

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
    """Bytes for the KV pool, the state slots and snapshots: `kv_cache_bytes`, else the device default (on
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


class PoolSizes(NamedTuple):
    blocks: int  # KV blocks
    slots: int  # state slots (one per running sequence)
    snapshots: int  # state snapshot rows (prefix caching of models with state layers)


def pool_sizes(config: EngineConfig, block_bytes: int, slot_bytes: int, device: torch.device) -> PoolSizes:
    """What fits the budget; `slot_bytes` 0 (no state layers): no slots, no snapshots.

    Slots come first: `num_state_slots`, else `max_num_seqs` as long as they take at most half
    the budget. With prefix caching, snapshots (a slot's bytes each) take `state_snapshot_share`
    of the budget (`num_state_snapshots` overrides), at most one per KV block (each belongs to
    the block its prefix ends at). The KV pool gets the rest. `num_kv_blocks` overrides the KV
    side; then slots are `num_state_slots` or `max_num_seqs` and snapshots `num_state_snapshots`
    or one per block, outside any budget."""
    snapshots = bool(slot_bytes) and config.enable_prefix_caching
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
        slots = (config.num_state_slots or config.max_num_seqs) if slot_bytes else 0
        snaps = (blocks if config.num_state_snapshots is None else config.num_state_snapshots) if snapshots else 0
        return PoolSizes(blocks, slots, min(snaps, blocks))
    budget = memory_budget(config, device)
    slots = snaps = 0
    if slot_bytes:
        slots = config.num_state_slots or min(config.max_num_seqs, budget // 2 // slot_bytes)
        if slots < 1:
            raise ValueError(f"memory budget of {budget} bytes holds no state slot of {slot_bytes} bytes")
    if snapshots:  # `num_state_snapshots`, else their share of the budget
        snaps = config.num_state_snapshots
        snaps = int(budget * config.state_snapshot_share) // slot_bytes if snaps is None else snaps
    blocks = (budget - (slots + snaps) * slot_bytes) // block_bytes
    if blocks < 1:
        raise ValueError(f"KV budget of {budget - (slots + snaps) * slot_bytes} bytes holds no block of "
                         f"{block_bytes} bytes: raise gpu_memory_utilization or the replica's num_gpus, or set "
                         "kv_cache_memory_mb")
    return PoolSizes(int(blocks), int(slots), int(min(snaps, blocks)))


def check_holds_a_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """ValueError unless the pool holds one sequence of `max_model_len` tokens (then any request
    the router lets in can finish, alone in the pool if need be)."""
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ValueError(
            f"the KV pool holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than one sequence "
            f"of max_model_len {max_model_len} tokens: set engine.max_model_len to at most {capacity}, or give "
            "the pool more memory (engine.kv_cache_memory_mb, engine.gpu_memory_utilization, llm.num_gpus)"
        )


def allocate_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)`; the last block is scratch
    (padding rows of captured decode batches write there), never handed out."""
    pool = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    logger.info("KV pool: %d blocks of %d tokens, %.1f MiB on %s", num_blocks, block_size,
                pool.nbytes / 2**20, device)
    return pool
