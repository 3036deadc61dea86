"""Encoded results waiting to be fetched over gRPC, pinned until fetched or expired.

Bookkeeping only, thread-safe: the encoder publishes from its worker threads, the gRPC server
fetches from its event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    tensor: torch.Tensor
    pins: int
    expires_at: float
    fetching: int = 0


@dataclass
class ResultStore:
    """Embeddings by content hash, each pinned once per `put` until `release`d or `ttl_s` passes.

    Attributes:
        ttl_s: how long an unfetched result is kept after its last `put`.
        clock: monotonic seconds (injectable for tests).
    An entry leaves the store when its pins are all released, or when its TTL has passed, but
    never while a fetch is streaming it (`acquire` ... `finish`).
    """

    ttl_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, content_hash: str, tensor: torch.Tensor) -> None:
        """Pin `tensor` under `content_hash` for one more fetch (the same item may be put twice)."""
        with self._lock:
            now = self.clock()
            self._evict_expired(now)
            entry = self._entries.get(content_hash)
            if entry is None:
                self._entries[content_hash] = _Entry(tensor, 1, now + self.ttl_s)
            else:
                entry.pins += 1
                entry.expires_at = now + self.ttl_s

    def acquire(self, content_hash: str) -> torch.Tensor | None:
        """Start a fetch: the tensor, protected from eviction until `finish`; None if absent."""
        with self._lock:
            self._evict_expired(self.clock())
            entry = self._entries.get(content_hash)
            if entry is None:
                return None
            entry.fetching += 1
            return entry.tensor

    def finish(self, content_hash: str, delivered: bool) -> None:
        """End a fetch; a delivered one releases one pin."""
        with self._lock:
            entry = self._entries.get(content_hash)
            if entry is None:
                return
            entry.fetching -= 1
            if delivered:
                entry.pins -= 1
            if entry.pins <= 0 and entry.fetching == 0:
                del self._entries[content_hash]

    def __contains__(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(e.tensor.numel() * e.tensor.element_size() for e in self._entries.values())

    def _evict_expired(self, now: float) -> None:
        expired = [h for h, e in self._entries.items() if e.expires_at <= now and e.fetching == 0]
        for content_hash in expired:
            del self._entries[content_hash]
