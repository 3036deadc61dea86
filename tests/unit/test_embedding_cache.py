"""EmbeddingCache: replacing a key, refusing an oversized value, rejecting a negative capacity."""

import pytest
import torch

from encoder_service.cache import EmbeddingCache


def _rows(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)  # 4 bytes a row


def test_replacing_a_key_frees_its_old_bytes_before_evicting_others():
    cache = EmbeddingCache(100)
    cache.put("a", _rows(10))
    cache.put("b", _rows(12))
    assert cache.put("b", _rows(15))  # 40 + 60 fits once b's old 48 bytes are gone
    assert set(cache._entries) == {"a", "b"} and cache.num_bytes == 100


def test_an_oversized_value_is_refused_and_evicts_nothing():
    cache = EmbeddingCache(100)
    cache.put("a", _rows(25))
    assert not cache.put("big", _rows(26))
    assert "big" not in cache and "a" in cache and (len(cache), cache.num_bytes) == (1, 100)


def test_capacity_zero_caches_nothing_and_negative_is_rejected():
    assert not EmbeddingCache(0).put("a", _rows(1))
    with pytest.raises(ValueError, match="capacity_bytes"):
        EmbeddingCache(-1)
