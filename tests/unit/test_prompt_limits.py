"""A request's text is bounded before it is tokenized, its tokens before positions are computed,
and tokenizing a long prompt in a worker thread leaves the router's event loop running."""

import asyncio
import time

import pytest

from mmserve.errors import InvalidRequest, RequestTooLarge
from mmserve.request.prompt import Message
from mmserve.request.prompt_plan import RequestPlanner


@pytest.fixture(scope="module")
def planner_of(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])
    return lambda **limits: RequestPlanner(tiny_models["qwen2_vl"], tokenizer, **limits)


def test_text_over_the_character_limit_is_refused_before_tokenizing(planner_of):
    planner = planner_of(max_prompt_chars=1000)
    planner.plan([Message("user", ("a" * 500,)), Message("assistant", ("b" * 500,))])  # at the limit
    with pytest.raises(RequestTooLarge, match="request text has 1001 characters; the limit is 1000"):
        planner.plan([Message("user", ("a" * 500,)), Message("assistant", ("b" * 501,))])


def test_a_prompt_over_the_context_is_refused_by_its_token_count(planner_of):
    text = "the cat sat on the mat " * 50
    tokens = len(planner_of().plan([Message("user", (text,))]).token_ids)
    planner_of(max_model_len=tokens).plan([Message("user", (text,))])
    with pytest.raises(InvalidRequest, match=f"prompt has {tokens} tokens, media included; the model's context is "
                                             f"{tokens - 1} tokens"):
        planner_of(max_model_len=tokens - 1).plan([Message("user", (text,))])


def test_tokenizing_a_long_prompt_leaves_the_event_loop_running(planner_of):
    """Planned in a worker thread as the router does, a ~1 MB prompt must not hold the GIL for its
    whole tokenization: a 1 ms ticker on the event loop keeps ticking (it ticked a few times in
    seconds when the tokenizer held the GIL)."""
    planner = planner_of()
    text = " ".join(["hello", "world", "the", "cat", "sat", "on", "a", "mat"] * 30_000)

    async def run() -> tuple[float, int]:
        ticks = 0
        task = asyncio.ensure_future(asyncio.to_thread(planner.plan, [Message("user", (text,))]))
        start = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        await task
        return time.perf_counter() - start, ticks

    seconds, ticks = asyncio.run(run())
    assert ticks >= 0.1 * seconds * 1000, (seconds, ticks)  # at least a tenth of the ticks a free loop makes
