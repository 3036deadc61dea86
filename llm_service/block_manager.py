"""Paged-KV bookkeeping: which block ids are free, who holds each one. No tensors here."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out fixed-size KV blocks by id.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool (ids `0 .. num_blocks - 1`).
        ref_counts: holders of each block id (0: free). A block returns to the free list
            when its count drops to 0.

    A sequence owns a *block table* (a list of ids, logical block i -> physical id). The
    manager grows and frees block tables; it never touches the tensors of the pool.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `block_table` still lacks to hold `num_tokens` tokens."""
        return max(self.blocks_for(num_tokens) - len(block_table), 0)

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_table, num_tokens) <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place until it holds `num_tokens` tokens."""
        missing = self.num_missing(block_table, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{missing} KV blocks needed, {len(self._free)} free")
        for _ in range(missing):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        """Drop this holder's reference to every block of `block_table` and empty it."""
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
        block_table.clear()
