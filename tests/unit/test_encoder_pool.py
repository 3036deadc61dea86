"""The encoder pool's scheduling, dedup, cache and failure isolation, on a fake encoder (fast)."""

import asyncio
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encoder_service.batching import BatchConfig
from encoder_service.pool import EncoderPool, PoolConfig
from mmserve.errors import InvalidRequest
from tests.support.encoder_fakes import FakeEncoder, corrupt_item, expected_output, fake_item


def run(coro):
    return asyncio.run(coro)


async def with_pool(encoder, config, body):
    pool = EncoderPool(encoder, config)
    try:
        return await body(pool)
    finally:
        await pool.close()


item_specs = st.tuples(st.integers(1, 40), st.integers(1, 5))  # (tokens per temporal patch, temporal patches)
request_lists = st.lists(st.lists(item_specs, min_size=1, max_size=4), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_lists, st.integers(8, 120), st.integers(1, 6), st.booleans(), st.sampled_from(["tokens", "patches"]))
def test_every_item_answered_exactly_once_within_budget(requests, budget, max_items, skip_ahead, unit):
    config = PoolConfig(BatchConfig(budget, max_items, batch_wait_ms=1, cost_unit=unit, skip_ahead=skip_ahead),
                        preprocess_workers=2, cache_bytes=0)
    encoder = FakeEncoder()
    ids = iter(range(10**6))
    specs = [[(next(ids), n, t) for n, t in req] for req in requests]

    async def body(pool):
        return await asyncio.gather(*[pool.encode([fake_item(i, n, t) for i, n, t in req]) for req in specs])

    answers = run(with_pool(encoder, config, body))
    for req, outs in zip(specs, answers):
        assert len(outs) == len(req)
        for (i, n, t), out in zip(req, outs):
            assert torch.equal(out.rows, expected_output(i, n, t))
    # each temporal patch of each item went through exactly one forward
    seen = sorted((i, first + k) for batch in encoder.batches for i, first, nt in batch for k in range(nt))
    assert seen == sorted((i, k) for req in specs for i, _, t in req for k in range(t))
    scale = 1 if unit == "tokens" else 4
    sizes = {i: n for req in specs for i, n, _ in req}
    for batch in encoder.batches:
        assert len(batch) <= max_items
        cost = sum(sizes[i] * nt * scale for i, _, nt in batch)
        assert cost <= budget or (len(batch) == 1 and batch[0][2] == 1)


def test_oversize_video_is_split_and_reassembled_in_order():
    encoder = FakeEncoder()
    config = PoolConfig(BatchConfig(max_batch_tokens=25, batch_wait_ms=0), cache_bytes=0)
    [out] = run(with_pool(encoder, config, lambda pool: pool.encode([fake_item(7, 10, 5)])))
    assert torch.equal(out.rows, expected_output(7, 10, 5))
    assert [b for b in encoder.batches] == [[(7, 0, 2)], [(7, 2, 2)], [(7, 4, 1)]]


def test_concurrent_requests_share_one_batch():
    encoder = FakeEncoder()
    config = PoolConfig(BatchConfig(max_batch_tokens=1000, batch_wait_ms=50), cache_bytes=0)

    async def body(pool):
        return await asyncio.gather(*[pool.encode([fake_item(i, 5)]) for i in range(6)])

    run(with_pool(encoder, config, body))
    assert len(encoder.batches) == 1 and len(encoder.batches[0]) == 6


def test_full_budget_runs_without_waiting():
    encoder = FakeEncoder()
    config = PoolConfig(BatchConfig(max_batch_tokens=10, batch_wait_ms=10_000), cache_bytes=0)

    async def body(pool):
        start = time.monotonic()
        await asyncio.gather(pool.encode([fake_item(1, 6)]), pool.encode([fake_item(2, 4)]))
        return time.monotonic() - start

    assert run(with_pool(encoder, config, body)) < 5  # 6 + 4 tokens fill the budget: no 10 s wait
    # one batch with both (queue order follows preprocessing completion, which load can swap)
    assert len(encoder.batches) == 1 and sorted(encoder.batches[0]) == [(1, 0, 1), (2, 0, 1)]


def test_identical_items_in_flight_are_encoded_once():
    encoder = FakeEncoder(forward_s=0.05)
    config = PoolConfig(BatchConfig(batch_wait_ms=5), cache_bytes=0)

    async def body(pool):
        outs = await asyncio.gather(*[pool.encode([fake_item(3, 8)]) for _ in range(10)])
        return outs, pool.stats()

    outs, stats = run(with_pool(encoder, config, body))
    assert sum(len(b) for b in encoder.batches) == 1
    assert stats.dedup_hits == 9 and all(torch.equal(o[0].rows, expected_output(3, 8)) for o in outs)


def test_cache_hit_skips_the_forward_and_is_counted():
    encoder = FakeEncoder()
    config = PoolConfig(BatchConfig(batch_wait_ms=0), cache_bytes=1 << 20)

    async def body(pool):
        first = await pool.encode([fake_item(4, 8), fake_item(4, 8)])  # repeated in one request: dedup
        second = await pool.encode([fake_item(4, 8)])
        return first, second, pool.stats()

    first, second, stats = run(with_pool(encoder, config, body))
    assert len(encoder.batches) == 1
    assert torch.equal(second[0].rows, first[0].rows) and (stats.cache_hits, stats.dedup_hits) == (1, 1)
    assert stats.cache_bytes == first[0].rows.numel() * 8 == first[0].num_bytes and stats.queued_tokens == 0


def test_corrupt_item_fails_only_its_own_request():
    encoder = FakeEncoder()
    config = PoolConfig(BatchConfig(batch_wait_ms=30), cache_bytes=0)

    async def body(pool):
        return await asyncio.gather(
            pool.encode([fake_item(1, 4)]), pool.encode([fake_item(2, 4), corrupt_item()]),
            pool.encode([fake_item(3, 4)]), return_exceptions=True,
        )

    ok1, bad, ok3 = run(with_pool(encoder, config, body))
    assert isinstance(bad, InvalidRequest) and "decode" in str(bad)
    assert torch.equal(ok1[0].rows, expected_output(1, 4)) and torch.equal(ok3[0].rows, expected_output(3, 4))


def test_failing_forward_is_isolated_to_its_item():
    encoder = FakeEncoder(fail_forward_ids=frozenset({2}))
    config = PoolConfig(BatchConfig(batch_wait_ms=30), cache_bytes=0)

    async def body(pool):
        return await asyncio.gather(*[pool.encode([fake_item(i, 4)]) for i in (1, 2, 3)], return_exceptions=True)

    one, two, three = run(with_pool(encoder, config, body))
    assert isinstance(two, RuntimeError)
    assert torch.equal(one[0].rows, expected_output(1, 4)) and torch.equal(three[0].rows, expected_output(3, 4))


def test_cancelled_caller_does_not_cancel_shared_work():
    encoder = FakeEncoder(forward_s=0.1)
    config = PoolConfig(BatchConfig(batch_wait_ms=0), cache_bytes=0)

    async def body(pool):
        first = asyncio.create_task(pool.encode([fake_item(5, 4)]))
        second = asyncio.create_task(pool.encode([fake_item(5, 4)]))
        await asyncio.sleep(0.02)
        first.cancel()
        return await second

    [out] = run(with_pool(encoder, config, body))
    assert torch.equal(out.rows, expected_output(5, 4))


def test_queued_tokens_count_admitted_items_until_answered():
    encoder = FakeEncoder(forward_s=0.2)
    config = PoolConfig(BatchConfig(batch_wait_ms=0), cache_bytes=0)

    async def body(pool):
        task = asyncio.gather(pool.encode([fake_item(1, 30)]), pool.encode([fake_item(2, 12, 2)]))
        await asyncio.sleep(0.05)
        during = pool.queued_tokens
        await task
        return during, pool.queued_tokens

    assert run(with_pool(encoder, config, body)) == (54, 0)


def test_encode_threadsafe_from_another_thread():
    encoder = FakeEncoder()

    async def body(pool):
        await pool.encode([fake_item(1, 2)])  # binds the pool to this loop
        return await asyncio.to_thread(pool.encode_threadsafe, [fake_item(9, 3)], 30)

    [out] = run(with_pool(encoder, PoolConfig(BatchConfig(batch_wait_ms=0)), body))
    assert torch.equal(out.rows, expected_output(9, 3))


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError):
        BatchConfig(max_batch_tokens=0)
    with pytest.raises(ValueError):
        PoolConfig(preprocess_workers=0)


def test_each_item_reports_its_queue_and_encode_time_and_a_hit_none():
    """`ItemEmbedding.timing`: a miss waits for its batch (batch_wait_ms) and then its forward; the
    same item again is a cache hit with zero queue and encode, stamped when the call returns."""
    encoder = FakeEncoder(forward_s=0.02)
    config = PoolConfig(BatchConfig(max_batch_tokens=1000, batch_wait_ms=30))

    async def body(pool):
        before = time.time()
        [first] = await pool.encode([fake_item(1, 5)])
        [second] = await pool.encode([fake_item(1, 5)])
        return before, first.timing, second.timing, time.time()

    before, miss, hit, after = run(with_pool(encoder, config, body))
    assert not miss.hit and miss.queue_ms >= 25 and miss.encode_ms >= 15
    assert hit.hit and hit.queue_ms == 0 and hit.encode_ms == 0
    assert before <= miss.done_at <= hit.done_at <= after


def test_a_requests_embedding_stages_are_its_last_items_and_fit_in_its_wait():
    from mmserve.inputs.encode_timing import EncodeTiming, embedding_stages

    early, last = EncodeTiming(5.0, 50.0, False, 100.0), EncodeTiming(20.0, 30.0, False, 100.2)
    stages = embedding_stages([early, last], waited_ms=300.0, received_at=100.25)
    assert stages == pytest.approx({"encode_queue_ms": 20.0, "encode_ms": 30.0, "embedding_transfer_ms": 50.0})
    cut = embedding_stages([last], waited_ms=60.0, received_at=100.25)  # the encoder began before the LLM saw it
    assert cut == pytest.approx({"encode_queue_ms": 0.0, "encode_ms": 10.0, "embedding_transfer_ms": 50.0})
    hit = embedding_stages([EncodeTiming(0.0, 0.0, True, 100.0)], waited_ms=3.0, received_at=100.001)
    assert hit["encode_ms"] == 0 and hit["encode_queue_ms"] == 0 and hit["embedding_transfer_ms"] == pytest.approx(1.0)
    assert embedding_stages([], 1.0, 0.0) == dict.fromkeys(stages, 0.0)
    assert embedding_stages([None], 1.0, 0.0) == {}
