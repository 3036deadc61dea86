"""Embedding cache: an LRU of item outputs bounded in bytes, keyed by everything the result depends on."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch
from cachetools import LRUCache

from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import MediaItem


@dataclass(frozen=True)
class EncoderIdentity:
    """What besides the media bytes decides an embedding: a change here must miss the cache.

    model_id: the checkpoint's name; weights_fingerprint: hash of the vision-tower tensors (a
    rolling upgrade with new weights never serves stale embeddings); preprocess_fingerprint: hash
    of the image/video processor settings; dtype: the forward's dtype.
    """

    model_id: str
    weights_fingerprint: str
    preprocess_fingerprint: str
    dtype: str

    def key(self, item: MediaItem) -> str:
        h = hashlib.blake2b(digest_size=20)
        for part in (self.model_id, self.weights_fingerprint, self.preprocess_fingerprint, self.dtype):
            h.update(part.encode())
            h.update(b"\0")
        h.update(item.content_hash.encode())
        return h.hexdigest()


def tensor_bytes(t: torch.Tensor | ItemEmbedding) -> int:
    return t.num_bytes if isinstance(t, ItemEmbedding) else t.nbytes


class EmbeddingCache:
    """LRU of embeddings whose summed size never exceeds `capacity_bytes` (a `cachetools.LRUCache`).

    `get` refreshes recency; `put` evicts least-recently-used entries until the new one fits and
    skips entries larger than the whole capacity. Cached tensors are shared: treat them as
    read-only. Thread-safe. Attributes: `hits`, `misses` (counted by `get`), `num_bytes`.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.hits = 0
        self.misses = 0
        self._entries: LRUCache[str, ItemEmbedding] = LRUCache(maxsize=capacity_bytes, getsizeof=tensor_bytes)
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._entries.maxsize

    @property
    def num_bytes(self) -> int:
        return self._entries.currsize

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> ItemEmbedding | None:
        with self._lock:
            value = self._entries.get(key)
            self.hits += value is not None
            self.misses += value is None
            return value

    def put(self, key: str, value: ItemEmbedding) -> bool:
        """Insert (or refresh) `key`; False when `value` alone exceeds the capacity."""
        if tensor_bytes(value) > self.capacity_bytes:
            return False
        with self._lock:
            self._entries.pop(key, None)  # cachetools 5 would count the old value while evicting
            self._entries[key] = value
            return True
