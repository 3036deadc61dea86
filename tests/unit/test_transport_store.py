"""ResultStore: pinned until fetched or expired, never evicted under a fetch in progress."""

import torch

from encoder_service.rpc.result_store import ResultStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pinned_until_fetched_once_per_put():
    store = ResultStore(ttl_s=10)
    store.put("h", torch.ones(2))
    store.put("h", torch.ones(2))  # the same item for two requests
    for _ in range(2):
        assert store.acquire("h") is not None
        store.finish("h", delivered=True)
    assert "h" not in store and store.acquire("h") is None


def test_failed_fetch_keeps_the_pin():
    store = ResultStore(ttl_s=10)
    store.put("h", torch.ones(2))
    store.acquire("h")
    store.finish("h", delivered=False)
    assert "h" in store


def test_expires_after_ttl_but_not_under_a_fetch():
    clock = Clock()
    store = ResultStore(ttl_s=5, clock=clock)
    store.put("a", torch.ones(1))
    store.put("b", torch.ones(1))
    assert store.acquire("b") is not None  # fetch of b in progress
    clock.now = 6
    store.put("c", torch.ones(1))
    assert "a" not in store and "b" in store and "c" in store
    store.finish("b", delivered=True)
    assert "b" not in store and store.num_bytes == 4
