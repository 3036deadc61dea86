"""The app's caches as the routing simulation (`mmserve.capacity.routing`) keeps them: an encoder
replica's embedding cache (bytes, LRU: `encoder_service/cache.py`) and an LLM replica's prefix cache
(KV blocks by prefix hash; an unreferenced block stays cached until the pool needs it, the least
recently freed first: `llm_service/engine/block_manager.py`). Bookkeeping only: keys and sizes."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence

from cachetools import LRUCache

ENCODER_CACHE_BYTES = 1 << 30  # the app's `encoder_pool.cache_bytes` default (encoder_service.pool.PoolConfig)


class EmbeddingLRU:
    """Item keys and their embedding bytes, at most `capacity_bytes` in all, least recently used
    evicted first; an item larger than the whole capacity is not kept (as `EmbeddingCache.put`)."""

    def __init__(self, capacity_bytes: int):
        self._entries: LRUCache[str, int] = LRUCache(maxsize=capacity_bytes, getsizeof=lambda size: size)

    def get(self, key: str) -> bool:
        """Whether `key` is cached (refreshing it)."""
        return self._entries.get(key) is not None

    def put(self, key: str, size: int) -> None:
        if size > self._entries.maxsize:
            return
        self._entries.pop(key, None)
        self._entries[key] = size

    def keys(self) -> list[str]:
        return list(self._entries.keys())


class PrefixCache:
    """An LLM replica's cached prompt blocks: `blocks` in the pool; a block held by a running
    sequence is referenced, a freed one stays cached (a later prompt with the same prefix takes it
    back) until the pool needs room, the least recently freed first. A sequence frees its blocks
    last-first, as the engine does, so a prompt's tail leaves the cache before its head."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self._refs: Counter = Counter()  # block hash -> holders (referenced blocks only)
        self._free: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently freed first

    def cached(self, h: int) -> bool:
        return h in self._refs or h in self._free

    def acquire(self, hashes: Sequence[int]) -> int:
        """Take the longest cached run of `hashes` from the start (one more holder each); its length."""
        held = len(list(itertools.takewhile(self.cached, hashes)))
        self.register(hashes[:held], 0)
        return held

    def register(self, hashes: Sequence[int], held: int) -> None:
        """A sequence holding `hashes[:held]` computed the rest: it holds them all now."""
        for h in hashes[held:]:
            self._free.pop(h, None)
            self._refs[h] += 1

    def release(self, hashes: Sequence[int], held: int) -> None:
        """A sequence holding `hashes[:held]` is done with them (finished or preempted)."""
        for h in reversed(hashes[:held]):
            self._refs[h] -= 1
            if not self._refs[h]:
                del self._refs[h]
                self._free[h] = None

    def trim(self, used_blocks: int) -> None:
        """Evict the least recently freed blocks until they fit beside `used_blocks` in the pool."""
        while self._free and len(self._free) + used_blocks > self.blocks:
            self._free.popitem(last=False)
