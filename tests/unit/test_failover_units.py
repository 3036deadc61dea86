"""Failover logic without Ray: a fake LLM client whose replica dies mid-stream."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray import exceptions as ray_exceptions

from deployments.core.failover import Failover
from deployments.core.failures import classify, replica_lost
from deployments.core.generation import Generation
from deployments.core.llm_inputs import PendingRequest, StoredEmbedding
from llm_service.sampling import SamplingParams
from mmserve.request.prompt_plan import RequestPlan
from tests.support.core_fakes import FakeLLM, FakeStream


def _pending(max_tokens: int) -> PendingRequest:
    return PendingRequest(
        request_id="r1", prompt_token_ids=(11, 12, 13), sampling=SamplingParams(max_tokens=max_tokens),
        positions=None, ranges=(), embeddings=(),
    )


class _Tokenizer:
    """Token i is the word "<i>" (a word-level backend: the detokenizer streams through it)."""

    def __init__(self):
        from tokenizers import Tokenizer, models

        self.backend_tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(1000)}, unk_token="<0>"))

    def decode(self, ids, **kw):
        return self.backend_tokenizer.decode(ids, **kw)


async def _run(llm: FakeLLM, max_tokens: int, retries: int = 2):
    resumed = []
    failover = Failover(llm, _pending(max_tokens), retries, lambda p: resumed.append(p.resumed_tokens))
    stream, first = await failover.start()
    plan = RequestPlan(token_ids=[11, 12, 13], items=[], ranges=[], expansions=[], positions=None)
    gen = Generation("r1", plan, _pending(max_tokens).sampling, (), stream, first, _Tokenizer(), failover.resume)
    tokens = [d.token_id async for d in gen.deltas() if d.token_id is not None]
    return tokens, resumed, gen


async def _run_choices(llm: FakeLLM, max_tokens: int, n: int, seed: int = 5):
    pending = dataclasses.replace(_pending(max_tokens), n=n,
                                  sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed))
    failover = Failover(llm, pending, 2)
    stream, first = await failover.start()
    plan = RequestPlan(token_ids=[11, 12, 13], items=[], ranges=[], expansions=[], positions=None)
    gen = Generation("r1", plan, pending.sampling, (), stream, first, _Tokenizer(), failover.resume, n=n)
    tokens = {i: [] for i in range(n)}
    async for d in gen.deltas():
        if d.token_id is not None:
            tokens[d.index].append(d.token_id)
    return tokens


def test_a_request_of_three_choices_lost_mid_stream_resumes_each_choice_from_its_own_tokens():
    """n = 3, the replica lost after 7 tokens (choices at 3, 2, 2), a choice's continuation lost
    again after 4: every choice ends with the tokens of an uninterrupted run (each its own seed)."""
    expected = asyncio.run(_run_choices(FakeLLM([None]), 10, 3))
    assert len({tuple(t) for t in expected.values()}) == 3 and all(len(t) == 10 for t in expected.values())
    llm = FakeLLM([7, None, 4, None, None])
    assert asyncio.run(_run_choices(llm, 10, 3)) == expected
    first, *resumed = llm.calls
    assert first.n == 3 and len(resumed) == 4
    by_choice = {c.request_id.split(".")[0]: c for c in resumed[:3]}
    for choice, sent in ((0, 3), (1, 2), (2, 2)):
        one = by_choice[f"r1#{choice}"]
        assert one.n == 1 and one.sampling.seed == 5 + choice and one.resumed_tokens == sent
        assert one.prompt_token_ids == (11, 12, 13) + tuple(expected[choice][:sent])
        assert one.sampling.max_tokens == 10 - sent


def test_a_stream_resumes_on_another_replica_with_the_tokens_sent():
    expected, _, _ = asyncio.run(_run(FakeLLM([None]), 20))
    assert len(expected) == 20
    llm = FakeLLM([5, 3, None])  # the first replica dies after 5 tokens, the second after 3 more
    tokens, resumed, gen = asyncio.run(_run(llm, 20))
    assert tokens == expected
    assert resumed == [5, 8]
    assert gen.num_generated == 20
    second, third = llm.calls[1], llm.calls[2]
    assert second.prompt_token_ids == (11, 12, 13) + tuple(expected[:5])
    assert second.sampling.max_tokens == 15 and second.resumed_tokens == 5
    assert third.prompt_token_ids == (11, 12, 13) + tuple(expected[:8])
    assert third.sampling.max_tokens == 12
    assert len({c.request_id for c in llm.calls}) == 3  # a fresh engine key per submission


def test_a_request_lost_before_its_first_token_runs_again():
    expected, _, _ = asyncio.run(_run(FakeLLM([None]), 6))
    tokens, resumed, _ = asyncio.run(_run(FakeLLM([0]), 6))
    assert tokens == expected and resumed == [0]


def test_retries_are_bounded_then_unavailable():
    with pytest.raises(ray_exceptions.ActorDiedError) as info:
        asyncio.run(_run(FakeLLM([2, 1, 1, None]), 20, retries=2))
    failure = classify(info.value)
    assert failure.kind == "lost" and failure.http_status == 503
    assert failure.grpc_code.name == "UNAVAILABLE"


def test_other_errors_are_not_retried():
    llm = FakeLLM([2, None], error=RuntimeError)
    with pytest.raises(RuntimeError):
        asyncio.run(_run(llm, 20))
    assert len(llm.calls) == 1
    assert not replica_lost(RuntimeError("x"))
    assert replica_lost(ray_exceptions.ActorUnavailableError("x", b"\0" * 16))


# -- encoder failover -------------------------------------------------------------------------
def _done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    (future.set_exception if isinstance(value, BaseException) else future.set_result)(value)
    return future


def test_resolve_names_exactly_the_items_of_a_lost_encoder_call():
    from deployments.serve.transport import resolve
    from mmserve.errors import EmbeddingsLost
    from mmserve.inputs.embeddings import ItemEmbedding

    import torch

    async def main(second_call_error: BaseException):
        ok = _done([ItemEmbedding((torch.zeros(2, 4),), "a"), ItemEmbedding((torch.ones(3, 4),), "b")])
        dead = _done(second_call_error)
        handles = (StoredEmbedding(ok, 0), StoredEmbedding(dead, 0), StoredEmbedding(ok, 1), StoredEmbedding(dead, 1))
        return await resolve(handles, None)

    with pytest.raises(EmbeddingsLost) as info:
        asyncio.run(main(ray_exceptions.ActorDiedError()))
    assert info.value.items == (1, 3)
    with pytest.raises(ValueError, match="bad pixels"):  # an item's own error is not a lost encoder
        asyncio.run(main(ValueError("bad pixels")))


def test_embeddings_lost_crosses_processes_with_its_items():
    import pickle

    from mmserve.errors import EmbeddingsLost

    error = pickle.loads(pickle.dumps(EmbeddingsLost((0, 2))))
    assert error.items == (0, 2) and "2 media items to re-encode" in str(error)


def test_items_of_a_lost_encoder_are_reencoded_and_the_request_resubmitted():
    from mmserve.errors import EmbeddingsLost

    class LLMWithMedia(FakeLLM):
        """Loses the embeddings of every handle whose ref is 'dead' (its encoder died) at submission."""

        def generate(self, pending):
            lost = tuple(i for i, h in enumerate(pending.embeddings) if h.ref == "dead")
            if lost:
                self.calls.append(pending)
                return FakeStream(iter([EmbeddingsLost(lost)]))
            return super().generate(pending)

    reencoded = []

    async def reencode(handles, lost):
        reencoded.append(lost)
        return tuple(StoredEmbedding("live", h.index) if i in lost else h for i, h in enumerate(handles))

    async def run(refs: list[str], retries: int = 2):
        pending = dataclasses.replace(_pending(6), embeddings=tuple(StoredEmbedding(r, i) for i, r in enumerate(refs)))
        llm = LLMWithMedia([None, None])
        stream, first = await Failover(llm, pending, retries, reencode=reencode).start()
        return [first.token_id] + [e.token_id async for e in stream], llm.calls

    expected, _ = asyncio.run(run(["live", "live", "live"]))
    tokens, calls = asyncio.run(run(["live", "dead", "dead"]))
    assert tokens == expected and reencoded == [(1, 2)]
    assert [h.ref for h in calls[-1].embeddings] == ["live", "live", "live"]
    assert calls[-1].prompt_token_ids == calls[0].prompt_token_ids and calls[-1].request_id != calls[0].request_id

    async def never_live(handles, lost):
        return handles  # every encoder stays dead

    async def bounded():
        pending = dataclasses.replace(_pending(6), embeddings=(StoredEmbedding("dead", 0),))
        await Failover(LLMWithMedia([]), pending, 2, reencode=never_live).start()

    with pytest.raises(EmbeddingsLost):
        asyncio.run(bounded())
