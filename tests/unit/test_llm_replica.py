"""The LLM replica's request path (`LLMReplica`) in process, without Ray, over a real tiny engine:
a request with an image gives the engine's own tokens and its stage times; n choices each run to
their end; embeddings that fail surface as the client's error; waiting prompt tokens are bounded
(429); a consumer that stops aborts its engine requests; and the core runs with Ray unimportable."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from deployments.core.llm_inputs import LocalMedia, PendingRequest
from deployments.core.llm_replica import LLMReplica
from llm_service.sampling import SamplingParams
from mmserve.errors import EmbeddingsLost, InvalidRequest, QueueFull
from tests.support.engine_support import image_prompt
from tests.support.pipeline import runtimes, served_generate, to_planner_messages


def _replica(model_dir: str, max_waiting_tokens: int = 1 << 20, resolve=None) -> LLMReplica:
    """The core over the started engine of `tests.support.pipeline`; `resolve` encodes the router's
    `LocalMedia` handles with its encoder, as a colocated replica does."""
    _, encoder, engine = runtimes(model_dir)

    async def encode(handles):
        return encoder.encode([h.item for h in handles])

    return LLMReplica(engine, max_waiting_tokens, resolve or encode)


def _pending(model_dir: str, messages: list[dict], request_id: str, max_tokens: int, n: int = 1,
             **sampling) -> PendingRequest:
    plan = runtimes(model_dir)[0].plan(to_planner_messages(messages))
    return PendingRequest(request_id=request_id, prompt_token_ids=tuple(plan.token_ids),
                          sampling=SamplingParams(max_tokens=max_tokens, **sampling), positions=plan.positions,
                          ranges=tuple(plan.ranges), embeddings=tuple(LocalMedia(m) for m in plan.media),
                          snapshot_boundaries=plan.snapshot_boundaries, n=n)


def _text_pending(request_id: str, prompt: int, attempt: int = 0, n: int = 1) -> PendingRequest:
    return PendingRequest(
        request_id=request_id, prompt_token_ids=tuple(range(100, 100 + prompt)),
        sampling=SamplingParams(max_tokens=2, ignore_eos=True), positions=None, ranges=(), embeddings=(),
        attempt=attempt, n=n,
    )


async def _drain(stream) -> list[int]:
    return [e.token_id async for e in stream if e.token_id is not None]


async def _events(stream) -> list:
    return [e async for e in stream]


def _idle(engine, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_request_with_an_image_gives_the_engines_tokens_and_its_stage_times(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    messages = image_prompt(3)
    replica = _replica(model_dir)
    events = asyncio.run(_events(replica.generate(_pending(model_dir, messages, "plain", 6))))
    assert [e.token_id for e in events if e.token_id is not None] == served_generate(model_dir, messages, 6)
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
    assert set(events[-1].stages) >= {"embeddings_ms", "prefill_queue_ms", "prefill_ms", "decode_ms"}
    assert replica.waiting_tokens == 0


def test_n_choices_each_run_to_their_end_and_the_last_end_carries_the_stages(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    pending = _pending(model_dir, image_prompt(4), "n", 5, n=3, temperature=1.0, seed=7, ignore_eos=True)
    events = asyncio.run(_events(_replica(model_dir).generate(pending)))
    tokens = {c: [e.token_id for e in events if e.choice == c and e.token_id is not None] for c in range(3)}
    ends = [e for e in events if e.finish_reason]
    assert all(len(t) == 5 for t in tokens.values())
    assert sorted(e.choice for e in ends) == [0, 1, 2] and events[-1] is ends[-1]
    assert [e.stages is not None and "decode_ms" in e.stages for e in ends] == [False, False, True]
    assert len({tuple(t) for t in tokens.values()}) > 1  # each choice samples with its own seed


class _TaskError(Exception):
    """As Ray wraps a replica's exception: the original as `cause`."""

    def __init__(self, cause: BaseException):
        super().__init__(repr(cause))
        self.cause = cause


@pytest.mark.parametrize("error, expected", [
    (_TaskError(InvalidRequest("image 0 could not be decoded")), InvalidRequest),  # out of Ray's wrapper
    (EmbeddingsLost((0,)), EmbeddingsLost),  # the router re-encodes the item and resubmits
])
def test_embeddings_that_fail_surface_to_the_caller_and_nothing_stays_admitted(tiny_models, error, expected):
    model_dir = tiny_models["qwen2_vl"]

    async def failing(handles):
        await asyncio.sleep(0)
        raise error

    replica = _replica(model_dir, resolve=failing)
    with pytest.raises(expected) as info:
        asyncio.run(_events(replica.generate(_pending(model_dir, image_prompt(5), "bad", 4))))
    if expected is InvalidRequest:
        assert str(info.value) == "image 0 could not be decoded"
    assert replica.waiting_tokens == 0 and _idle(replica.engine)


def test_waiting_prompt_tokens_are_bounded(tiny_models):
    llm = _replica(tiny_models["qwen2_vl"], max_waiting_tokens=30)

    async def main():
        first = llm.generate(_text_pending("a", 20))
        head = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0)  # "a" is admitted and waits for its first token
        assert llm.waiting_tokens == 20
        with pytest.raises(QueueFull, match="20 prompt tokens wait"):
            await llm.generate(_text_pending("b", 20)).__anext__()
        small = asyncio.create_task(_drain(llm.generate(_text_pending("c", 5))))  # fits under the bound
        resumed = asyncio.create_task(_drain(llm.generate(_text_pending("d", 20, attempt=1))))  # failover: never refused
        await asyncio.sleep(0)
        assert llm.waiting_tokens == 45
        tokens = [(await head).token_id, *await _drain(first)]
        assert len(tokens) == 2 and len(await small) == 2 and len(await resumed) == 2
        assert llm.waiting_tokens == 0
        assert len(await _drain(llm.generate(_text_pending("e", 40)))) == 2  # alone, even a larger prompt runs

    asyncio.run(main())


def test_a_request_of_n_choices_waits_as_n_prompts(tiny_models):
    """`n` choices are `n` sequences to run: six `n = 16` requests were admitted as six prompts."""
    llm = _replica(tiny_models["qwen2_vl"], max_waiting_tokens=30)

    async def main():
        first = llm.generate(_text_pending("a", 10, n=4))
        head = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0)
        assert llm.waiting_tokens == 40
        with pytest.raises(QueueFull, match="40 prompt tokens wait"):
            await llm.generate(_text_pending("b", 5)).__anext__()
        await head
        await _drain(first)
        assert llm.waiting_tokens == 0

    asyncio.run(main())


def test_a_consumer_that_stops_aborts_every_choice_on_the_engine(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    replica = _replica(model_dir)
    aborted = []
    abort = replica.engine.abort
    replica.engine.abort = lambda request_id: (aborted.append(request_id), abort(request_id))

    async def main():
        stream = replica.generate(_pending(model_dir, image_prompt(6), "stop", 200, n=2, ignore_eos=True))
        async for event in stream:
            if event.token_id is not None and event.choice == 1:
                break  # both choices run: the client went away
        await stream.aclose()
        # the engine's "abort" events reach this loop: it must still run when they are sent
        assert await asyncio.to_thread(_idle, replica.engine)
        await asyncio.sleep(0.1)

    try:
        asyncio.run(main())
    finally:
        del replica.engine.abort
    assert sorted(aborted) == ["stop", "stop#1"] and replica.waiting_tokens == 0


RAY_BLOCKED = """
import asyncio, sys
sys.modules["ray"] = None  # `import ray` fails from here on
from deployments.core.llm_inputs import PendingRequest
from deployments.core.llm_replica import LLMReplica
from llm_service.engine.llm_engine import LLMEngine
from llm_service.model.language_model import LanguageModel
from llm_service.sampling import SamplingParams

async def main():
    engine = LLMEngine(LanguageModel(sys.argv[1], dtype="float32"))
    engine.start()
    try:
        replica = LLMReplica(engine, 1000, resolve=None)
        pending = PendingRequest("r", (100, 101, 102), SamplingParams(max_tokens=3, ignore_eos=True), None, (), ())
        print(len([e async for e in replica.generate(pending) if e.token_id is not None]))
    finally:
        engine.shutdown()

asyncio.run(main())
print(sorted(m for m, module in sys.modules.items() if module and (m == "ray" or m.startswith("ray."))))
"""


def test_the_replica_core_runs_a_request_with_ray_unimportable(tiny_models):
    from tests.unit.test_structure import ROOT

    out = subprocess.run([sys.executable, "-c", RAY_BLOCKED, tiny_models["qwen2_vl"]], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "[]"]
