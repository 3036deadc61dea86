"""Paged-KV bookkeeping: which block ids are free, who holds each one, which prefix each caches.

No tensors here.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockManager:
    """Hands out fixed-size KV blocks by id, and reuses blocks of identical prompt prefixes.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool (ids `0 .. num_blocks - 1`).
        ref_counts: holders of each block id (0: free).
        num_cached_tokens: prompt tokens served from cached blocks instead of being computed.

    A sequence owns a *block table* (a list of ids, logical block i -> physical id). The
    manager grows and frees block tables; it never touches the tensors of the pool.

    Prefix caching: a full prompt block whose K/V are computed is `register`ed under the hash of
    its whole prefix (see `Sequence.block_hashes`). A freed block keeps its hash and stays
    reusable until the free list hands it out for something else (least recently freed first);
    then `on_evict` hears of the hash that left the cache (hybrid models drop its state snapshot).
    """

    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int], None] | None = None):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.ref_counts = [0] * num_blocks
        self.num_cached_tokens = 0
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._on_evict = on_evict

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
            block, _ = self._free.popitem(last=False)
            if (old := self._hash_of.pop(block, None)) is not None:  # evict its cached prefix
                del self._by_hash[old]
                if self._on_evict is not None:
                    self._on_evict(old)
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        """Drop this holder's reference to every block of `block_table` and empty it."""
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
        block_table.clear()

    # -- prefix caching ---------------------------------------------------------------------------
    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids caching the longest run of `hashes` from the start (nothing is taken yet)."""
        return list(itertools.takewhile(lambda block: block is not None, map(self._by_hash.get, hashes)))

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def can_allocate_after(self, cached: Sequence[int], num_tokens: int) -> bool:
        """Whether an empty table could take `cached` and then grow to `num_tokens` tokens."""
        free_cached = sum(1 for b in cached if self.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(cached) <= len(self._free) - free_cached

    def take_cached(self, block_table: list[int], cached: Sequence[int]) -> None:
        """Start the empty `block_table` with the cached blocks (one more holder each)."""
        if block_table:
            raise ValueError("cached blocks can only start an empty block table")
        for block in cached:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            block_table.append(block)
        self.num_cached_tokens += len(cached) * self.block_size

    def register(self, block: int, block_hash: int) -> None:
        """`block` now holds the K/V of the prefix `block_hash` (first registration wins)."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
