"""Prefix caching: identical prompt prefixes (identical images by content hash) reuse KV blocks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_service.engine.block_manager import BlockManager
from tests.support.engine_support import Collector, image_prompt, make_engine, plan_request, run_until_done
from tests.support.reference import reference_generate

MAX_TOKENS = 6
BLOCK = 8


def _run(engine, model_dir, messages, request_id) -> list[int]:
    collector = Collector()
    collector.add(engine, plan_request(model_dir, messages, request_id, MAX_TOKENS))
    run_until_done(engine, collector)
    return collector.tokens(request_id)


def test_identical_image_prompt_reuses_its_blocks_and_equals_monolithic(model_dir):
    engine = make_engine(model_dir, block_size=BLOCK)
    messages = image_prompt(1)
    prompt_len = len(plan_request(model_dir, messages, "x", 1).prompt_token_ids)
    expected = reference_generate(model_dir, messages, MAX_TOKENS)
    assert _run(engine, model_dir, messages, "first") == expected
    cached_before = engine.stats().num_cached_tokens
    assert _run(engine, model_dir, messages, "second") == expected
    assert engine.stats().num_cached_tokens - cached_before == (prompt_len - 1) // BLOCK * BLOCK


def test_another_image_with_the_same_token_ids_does_not_reuse_image_blocks(model_dir):
    engine = make_engine(model_dir, block_size=BLOCK)
    first, second = image_prompt(1), image_prompt(2)
    ids = [plan_request(model_dir, m, "x", 1) for m in (first, second)]
    assert ids[0].prompt_token_ids == ids[1].prompt_token_ids  # only the pixels differ
    image_start = ids[0].media[0][0].offset
    _run(engine, model_dir, first, "first")
    cached_before = engine.stats().num_cached_tokens
    assert _run(engine, model_dir, second, "second") == reference_generate(model_dir, second, MAX_TOKENS)
    assert engine.stats().num_cached_tokens - cached_before == image_start // BLOCK * BLOCK  # text before it only


def test_prefix_caching_off_computes_everything(model_dir):
    engine = make_engine(model_dir, block_size=BLOCK, enable_prefix_caching=False)
    messages = image_prompt(3)
    first, second = _run(engine, model_dir, messages, "a"), _run(engine, model_dir, messages, "b")
    assert first == second == reference_generate(model_dir, messages, MAX_TOKENS)
    assert engine.stats().num_cached_tokens == 0


def test_cached_blocks_are_evicted_when_the_pool_needs_them(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir, block_size=BLOCK, num_kv_blocks=8)  # 64 tokens: one prompt at a time
    prompts = [[{"role": "user", "content": [{"type": "text", "text": f"Story {i}: " + "tell me more " * 4}]}]
               for i in range(4)]
    for i, messages in enumerate(prompts):
        assert _run(engine, model_dir, messages, f"r{i}") == reference_generate(model_dir, messages, MAX_TOKENS)
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache"]), st.integers(0, 5), st.integers(1, 40)),
                    max_size=60))
def test_block_manager_invariants(ops):
    """Random allocate / free / register / take-cached: counts stay consistent, nothing leaks."""
    bm = BlockManager(num_blocks=12, block_size=4)
    tables: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}  # table -> hashes registered for its leading blocks
    for op, who, size in ops:
        table = tables.setdefault(who, [])
        if op == "alloc" and bm.can_allocate(table, size):
            bm.allocate(table, size)
            hashes = [hash((who, i)) for i in range(len(table))]
            for block, h in zip(table, hashes):
                bm.register(block, h)
            prompts[who] = hashes
        elif op == "free":
            bm.free(table)
        elif op == "cache" and not table and who in prompts:
            cached = bm.cached_prefix(prompts[who])
            if bm.can_allocate_after(cached, size):
                bm.take_cached(table, cached)
                bm.allocate(table, size)
        held = [b for t in tables.values() for b in t]
        assert all(bm.ref_counts[b] == held.count(b) for b in range(bm.num_blocks))
        assert bm.num_free_blocks == sum(1 for c in bm.ref_counts if c == 0)
        assert len(set(bm._by_hash.values())) == len(bm._by_hash) == len(bm._hash_of)
    for table in tables.values():
        bm.free(table)
    assert bm.num_free_blocks == bm.num_blocks


def test_same_image_after_an_encoder_identity_change_does_not_reuse_kv(model_dir):
    """The media part of a block's cache key is the output's key (content + encoder identity):
    the same image encoded by an upgraded encoder (new weights fingerprint) misses the cache."""
    import dataclasses

    from mmserve.inputs.embeddings import ItemEmbedding

    engine = make_engine(model_dir, block_size=BLOCK)
    messages = image_prompt(3)
    request = plan_request(model_dir, messages, "old-encoder", MAX_TOKENS)
    (rng, old), = request.media
    upgraded = ItemEmbedding(old.parts, key=old.key + "+new-weights")
    again = dataclasses.replace(request, request_id="new-encoder", media=((rng, upgraded),))
    collector = Collector()
    collector.add(engine, request)
    run_until_done(engine, collector)
    cached_before = engine.stats().num_cached_tokens
    collector.add(engine, again)
    run_until_done(engine, collector)
    assert engine.stats().num_cached_tokens - cached_before == rng.offset // BLOCK * BLOCK  # text before it only
    same = dataclasses.replace(request, request_id="same-encoder")
    cached_before = engine.stats().num_cached_tokens
    collector.add(engine, same)
    run_until_done(engine, collector)
    assert engine.stats().num_cached_tokens - cached_before > rng.offset // BLOCK * BLOCK  # image blocks reused
