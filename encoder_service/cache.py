"""Embedding cache: an LRU of item outputs bounded in bytes, keyed by everything the result depends on."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mmserve.embeddings import ItemEmbedding
from mmserve.media import MediaItem


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
    return t.num_bytes if isinstance(t, ItemEmbedding) else t.numel() * t.element_size()


class EmbeddingCache:
    """LRU of embeddings whose summed size never exceeds `capacity_bytes`.

    `get` refreshes recency; `put` evicts least-recently-used entries until the new one fits and
    skips entries larger than the whole capacity. Cached tensors are shared: treat them as
    read-only. Thread-safe. Attributes: `hits`, `misses` (counted by `get`), `num_bytes`.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, ItemEmbedding] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> ItemEmbedding | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: str, value: ItemEmbedding) -> bool:
        """Insert (or refresh) `key`; False when `value` alone exceeds the capacity."""
        size = tensor_bytes(value)
        with self._lock:
            if size > self.capacity_bytes:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= tensor_bytes(old)
            while self._entries and self.num_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= tensor_bytes(evicted)
            self._entries[key] = value
            self.num_bytes += size
            return True
