"""Encoded results waiting to be fetched over gRPC, pinned until fetched or expired.

Bookkeeping only, thread-safe: the encoder publishes from its worker threads, the gRPC server
fetches from its event loop (`wait_acquire` is woken by `put`, from any thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmserve.errors import Overloaded
from mmserve.settings import setting


@dataclass
class _Entry:
    tensor: torch.Tensor
    pins: int
    expires_at: float
    fetching: int = 0


@dataclass
class ResultStore:
    """Embeddings by content hash, each pinned once per `put` until `release`d or `ttl_s` passes.

    `ttl_s` and `max_bytes` are settings of the app's `grpc` (`mmserve.settings`); a `put` of a new
    entry over `max_bytes` raises `Overloaded` (one entry alone is always admitted); `clock`:
    monotonic seconds (injectable for tests). An entry leaves the store when its pins are all
    released, or when its TTL has passed, but never while a fetch is streaming it (`acquire` ... `finish`).
    """

    ttl_s: float = setting(300.0, "how long an unfetched embedding stays pinned after its last put",
                           name="result_ttl_s", gt=0)
    max_bytes: int = setting(2 << 30, "pinned embeddings per encoder; over it encodes are refused (503)",
                             name="result_store_bytes", ge=1)
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _num_bytes: int = 0
    _waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = field(default_factory=dict)

    def put(self, content_hash: str, tensor: torch.Tensor) -> None:
        """Pin `tensor` under `content_hash` for one more fetch (the same item may be put twice)."""
        with self._lock:
            now = self.clock()
            self._evict_expired(now)
            if (entry := self._entries.get(content_hash)) is None:
                entry = _Entry(tensor, 1, now + self.ttl_s)
                if self._entries and self._num_bytes + tensor.nbytes > self.max_bytes:
                    raise Overloaded(f"the encoder's store of unfetched results is full ({self.max_bytes} bytes)")
                self._entries[content_hash] = entry
                self._num_bytes += tensor.nbytes
            else:
                entry.pins += 1
                entry.expires_at = now + self.ttl_s
            waiters = self._waiters.pop(content_hash, [])
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def acquire(self, content_hash: str) -> torch.Tensor | None:
        """Start a fetch: the tensor, protected from eviction until `finish`; None if absent."""
        with self._lock:
            return self._acquire_locked(content_hash)

    async def wait_acquire(self, content_hash: str, timeout_s: float) -> torch.Tensor | None:
        """`acquire`, waiting up to `timeout_s` for a `put` of `content_hash` (no polling)."""
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._lock:
                tensor, remaining = self._acquire_locked(content_hash), deadline - time.monotonic()
                if tensor is not None or remaining <= 0:
                    return tensor
                self._waiters.setdefault(content_hash, []).append((loop, event))
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
            finally:
                with self._lock:
                    waiters = self._waiters.get(content_hash, [])
                    if (loop, event) in waiters:
                        waiters.remove((loop, event))
                        if not waiters:
                            del self._waiters[content_hash]

    def finish(self, content_hash: str, delivered: bool) -> None:
        """End a fetch; a delivered one releases one pin."""
        with self._lock:
            if (entry := self._entries.get(content_hash)) is None:
                return
            entry.fetching -= 1
            entry.pins -= delivered
            if entry.pins <= 0 and entry.fetching == 0:
                self._remove(content_hash)

    def __contains__(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._num_bytes

    def _acquire_locked(self, content_hash: str) -> torch.Tensor | None:
        self._evict_expired(self.clock())
        if (entry := self._entries.get(content_hash)) is None:
            return None
        entry.fetching += 1
        return entry.tensor

    def _remove(self, content_hash: str) -> None:
        self._num_bytes -= self._entries.pop(content_hash).tensor.nbytes

    def _evict_expired(self, now: float) -> None:
        for content_hash in [h for h, e in self._entries.items() if e.expires_at <= now and e.fetching == 0]:
            self._remove(content_hash)
