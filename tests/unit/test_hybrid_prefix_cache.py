"""Prefix caching on hybrid language models (linear-attention state snapshots at block boundaries):
a request resumes from the deepest snapshot of its cached prefix (the system prompt, after an
image, the whole prompt) or misses, and its greedy tokens equal `transformers` generate (float64).

Two models, as in tests/unit/test_hybrid_engine.py: the deeper `qwen3_5_text` LM (8 layers, 6 linear :
2 full) and MiniCPM-V 4.6's tiny checkpoint (4 layers, 3 : 1).
"""

import pytest

from tests.support.engine_support import Collector, make_engine, plan_request, run_until_done
from tests.support.media_factory import image_bytes
from tests.support.reference import reference_generate
from tests.unit.test_hybrid_engine import deep_dir  # noqa: F401  (fixture)

BLOCK = 8
MAX_TOKENS = 6
SYSTEM = "You are a careful assistant. You describe pictures briefly and answer questions about them. " * 2
OTHER_SYSTEM = "Respond only in short rhymes, whatever the topic may be. " * 3


def _messages(system: str | None, image_seed: int | None, question: str) -> list[dict]:
    out = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    content = [{"type": "image", "bytes": image_bytes(112, 112, image_seed)}] if image_seed is not None else []
    return out + [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def _points(request) -> tuple[int, int, int]:
    """The snapshot points of a system + image + question prompt: system end, image end, prompt end."""
    (rng, _), = request.media
    system = request.snapshot_boundaries[0] // BLOCK * BLOCK
    image = (rng.offset + rng.length) // BLOCK * BLOCK
    end = (len(request.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert 0 < system < image < end
    return system, image, end


@pytest.fixture(params=["deep", "minicpmv"])
def hybrid_dir(request) -> str:
    return request.getfixturevalue("deep_dir" if request.param == "deep" else "minicpmv_dir")


def test_requests_resume_from_each_kind_of_snapshot_and_equal_monolithic(hybrid_dir):
    engine = make_engine(hybrid_dir, block_size=BLOCK, max_num_batched_tokens=512)
    assert engine.config.enable_prefix_caching and engine.scheduler.snapshots is not None
    first = _messages(SYSTEM, 1, "What is in this picture?")
    system, image, end = _points(plan_request(hybrid_dir, first, "x", 1))
    cases = [  # name, messages, the cached prefix it resumes from (0: a miss)
        ("first", first, 0),
        ("other image", _messages(SYSTEM, 2, "What is in this picture?"), system),
        ("same image, other question", _messages(SYSTEM, 1, "Which colours do you see?"), image),
        ("same prompt", first, end),
        ("other system prompt", _messages(OTHER_SYSTEM, 1, "What is in this picture?"), 0),
        ("text only, same system prompt", _messages(SYSTEM, None, "Say hello."), system),
    ]
    for i, (name, messages, resumed) in enumerate(cases):
        before = engine.stats()
        collector = Collector()
        collector.add(engine, plan_request(hybrid_dir, messages, f"r{i}", MAX_TOKENS))
        run_until_done(engine, collector)
        after = engine.stats()
        assert collector.tokens(f"r{i}") == reference_generate(hybrid_dir, messages, MAX_TOKENS), name
        assert after.num_cached_tokens - before.num_cached_tokens == resumed, name
        assert after.num_snapshot_resumes - before.num_snapshot_resumes == (resumed > 0), name
    stats = engine.stats()
    assert 0 < stats.num_snapshots <= engine.scheduler.snapshots.num_snapshots
    assert stats.snapshot_bytes == stats.num_snapshots * engine.runner.states.row_bytes
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks
    assert engine.scheduler.slots.num_free_slots == engine.scheduler.slots.num_slots


def test_concurrent_requests_on_a_tiny_pool_evict_snapshots_with_their_blocks(deep_dir):  # noqa: F811
    """A pool of 24 blocks of 8 and 3 snapshot rows: prompts sharing a system prompt and images
    run side by side, preempt each other and evict cached blocks; snapshots go with their blocks,
    and every answer equals generate."""
    engine = make_engine(deep_dir, block_size=BLOCK, num_kv_blocks=24, num_state_snapshots=3, num_state_slots=3,
                         max_num_batched_tokens=48)
    prompts = [_messages(SYSTEM if i % 3 else OTHER_SYSTEM, i % 2, f"Question {i}?") for i in range(6)]
    collector = Collector()
    for i, messages in enumerate(prompts):
        collector.add(engine, plan_request(deep_dir, messages, f"c{i}", MAX_TOKENS))
    run_until_done(engine, collector)
    for i, messages in enumerate(prompts):
        assert collector.tokens(f"c{i}") == reference_generate(deep_dir, messages, MAX_TOKENS), i
    snaps = engine.scheduler.snapshots
    assert snaps.num_saved > snaps.num_snapshots  # the cache filled and rows were reused
    assert all(engine.scheduler.blocks.is_cached(h) for h in snaps._by_hash)  # none outlives its block
    assert snaps.num_used + snaps.num_free == snaps.num_snapshots
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


def test_snapshots_off_computes_every_prompt_in_full(minicpmv_dir):
    engine = make_engine(minicpmv_dir, block_size=BLOCK, state_snapshot_share=0.0)
    messages = _messages(SYSTEM, 1, "What is in this picture?")
    for name in ("a", "b"):
        collector = Collector()
        collector.add(engine, plan_request(minicpmv_dir, messages, name, MAX_TOKENS))
        run_until_done(engine, collector)
        assert collector.tokens(name) == reference_generate(minicpmv_dir, messages, MAX_TOKENS)
    assert engine.stats().num_cached_tokens == 0 and engine.stats().num_snapshots == 0


def test_a_request_whose_inputs_arrive_later_resumes_from_a_snapshot_within_what_is_present(hybrid_dir):
    """A streamed request (`ready`: its inputs present up to a token) whose cached prefix reaches
    past what is present: the prefix is cut to what is present first and then to the deepest
    snapshot within it (cut the other way round, it named a block with no snapshot: KeyError, seen
    as a gRPC video request after the same video over HTTP)."""
    engine = make_engine(hybrid_dir, block_size=BLOCK, max_num_batched_tokens=512)
    messages = _messages(SYSTEM, 1, "What is in this picture? Tell me about its colours and shapes. " * 3)
    collector = Collector()
    collector.add(engine, plan_request(hybrid_dir, messages, "first", MAX_TOKENS))
    run_until_done(engine, collector)
    request = plan_request(hybrid_dir, messages, "again", MAX_TOKENS)
    system, image, end = _points(request)
    ready = image + 2 * BLOCK + 1  # present beyond the image's snapshot, short of the prompt's
    assert image < (ready - 1) // BLOCK * BLOCK < end
    before = engine.stats()
    collector.events["again"] = []
    engine.add_request(request, collector.events["again"].append, ready)
    for _ in range(3):
        engine.step()
    assert engine.stats().num_cached_tokens - before.num_cached_tokens == image  # the deepest snapshot within
    engine.extend("again", None)
    run_until_done(engine, collector)
    assert collector.tokens("again") == collector.tokens("first") == reference_generate(hybrid_dir, messages,
                                                                                         MAX_TOKENS)
