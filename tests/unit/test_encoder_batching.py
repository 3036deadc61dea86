"""Token-budget batch selection, video splitting, the embedding cache and request spreading (pure)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_service.batching import BatchConfig, overtaken, select_batch, temporal_groups
from encoder_service.cache import EmbeddingCache, tensor_bytes
from mmserve.request.encode_calls import balanced_groups, spread

configs = st.builds(
    BatchConfig,
    max_batch_tokens=st.integers(1, 200),
    max_batch_items=st.integers(1, 12),
    batch_wait_ms=st.just(0.0),
    skip_ahead=st.booleans(),
    max_skips=st.integers(0, 5),
)
cost_lists = st.lists(st.integers(1, 300), min_size=1, max_size=40)


def drain(costs: list[int], config: BatchConfig):
    """Run select_batch until the queue is empty: (batches as item ids, times each item was overtaken)."""
    queue = list(range(len(costs)))
    skips = [0] * len(costs)
    batches = []
    while queue:
        sel = select_batch([costs[i] for i in queue], [skips[i] for i in queue], config)
        assert sel.indices, "a non-empty queue always yields a batch"
        for pos in overtaken(sel, len(queue)):
            skips[queue[pos]] += 1
        batches.append([queue[pos] for pos in sel.indices])
        chosen = set(sel.indices)
        queue = [item for pos, item in enumerate(queue) if pos not in chosen]
    return batches, skips


@given(cost_lists, configs)
def test_every_batch_fits_unless_one_oversize_item(costs, config):
    batches, _ = drain(costs, config)
    for batch in batches:
        assert len(batch) <= config.max_batch_items
        total = sum(costs[i] for i in batch)
        assert total <= config.max_batch_tokens or (len(batch) == 1 and costs[batch[0]] > config.max_batch_tokens)


@given(cost_lists, configs)
def test_every_item_is_batched_exactly_once(costs, config):
    batches, _ = drain(costs, config)
    served = [i for b in batches for i in b]
    assert sorted(served) == list(range(len(costs)))


@given(cost_lists, configs)
def test_fifo_mode_serves_in_arrival_order(costs, config):
    config = BatchConfig(config.max_batch_tokens, config.max_batch_items, 0.0, skip_ahead=False)
    batches, skips = drain(costs, config)
    assert [i for b in batches for i in b] == list(range(len(costs)))
    assert max(skips) == 0


@given(cost_lists, configs)
def test_skip_ahead_overtakes_no_item_more_than_max_skips(costs, config):
    config = BatchConfig(config.max_batch_tokens, config.max_batch_items, 0.0, skip_ahead=True,
                         max_skips=config.max_skips)
    batches, skips = drain(costs, config)
    assert max(skips) <= config.max_skips
    # the bound is the whole story: an item served in batch k was overtaken by at most max_skips batches
    for k, batch in enumerate(batches):
        for item in batch:
            later_arrivals_served_before = sum(1 for b in batches[:k] if any(j > item for j in b))
            assert later_arrivals_served_before <= config.max_skips


def test_skip_ahead_fills_leftover_budget_and_fifo_does_not():
    costs, skips = [60, 50, 30], [0, 0, 0]
    fifo = select_batch(costs, skips, BatchConfig(max_batch_tokens=100))
    ahead = select_batch(costs, skips, BatchConfig(max_batch_tokens=100, skip_ahead=True))
    assert fifo.indices == [0] and fifo.full
    assert ahead.indices == [0, 2] and overtaken(ahead, 3) == [1]
    blocked = select_batch(costs, [0, 2, 0], BatchConfig(max_batch_tokens=100, skip_ahead=True, max_skips=2))
    assert blocked.indices == [0]


def test_batch_is_full_only_when_waiting_cannot_grow_it():
    cfg = BatchConfig(max_batch_tokens=100, max_batch_items=3)
    assert not select_batch([10, 20], [0, 0], cfg).full
    assert select_batch([50, 50], [0, 0], cfg).full
    assert select_batch([1, 1, 1, 1], [0] * 4, cfg).full
    assert select_batch([150], [0], cfg) == ([0], 150, True)


@given(st.integers(1, 64), st.integers(1, 50), st.integers(1, 400))
def test_temporal_groups_cover_the_video_within_budget(num_temporal, per_temporal, budget):
    groups = temporal_groups(num_temporal, per_temporal, budget)
    assert groups[0][0] == 0 and groups[-1][1] == num_temporal
    assert all(a < b for a, b in groups) and all(groups[k][1] == groups[k + 1][0] for k in range(len(groups) - 1))
    for a, b in groups:
        assert (b - a) * per_temporal <= budget or b - a == 1


@settings(max_examples=60)
@given(st.integers(0, 4000), st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 300)), max_size=60))
def test_cache_never_exceeds_its_byte_bound(capacity, ops):
    cache = EmbeddingCache(capacity)
    for is_put, key, rows in ops:
        if is_put:
            stored = cache.put(str(key), torch.zeros(rows, 1, dtype=torch.float32))
            assert stored == (rows * 4 <= capacity)
        else:
            cache.get(str(key))
        assert cache.num_bytes <= capacity
        assert cache.num_bytes == sum(tensor_bytes(cache.get(k)) for k in list(cache._entries))


def test_cache_evicts_least_recently_used_and_counts():
    cache = EmbeddingCache(3 * 40)
    for k in "abc":
        cache.put(k, torch.zeros(10))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", torch.zeros(10))
    assert "b" not in cache and {"a", "c", "d"} <= set(cache._entries)
    assert cache.get("b") is None
    assert (cache.hits, cache.misses) == (1, 1)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 8))
def test_balanced_groups_partition_and_balance(sizes, num_groups):
    groups = balanced_groups(sizes, num_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert len(groups) == min(num_groups, len(sizes))
    loads = [sum(sizes[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(sizes)  # largest-first greedy bound


def test_spread_balances_by_tokens_not_count():
    # one huge image and many small ones: round-robin by count would put the huge one with others
    sizes = [8000] + [500] * 16
    groups = spread(sizes)
    assert len(groups) > 1
    assert [0] in groups  # the huge item gets its own call; the small ones share the others
    assert spread([64] * 10) == [list(range(10))]  # a small request stays one call
