"""Admission by work and latency (`deployments.core.admission`): a request's `n` choices take `n`
places, planned work is admitted while its expected time to first token fits `ttft_budget_s`, and
one client's flood does not lock out another; through the request core and on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from deployments.core.admission import WORK_PER_SEQUENCE, Admission
from deployments.core.generation import GenerationOptions
from deployments.core.request_core import ChatRequest
from mmserve.errors import QueueFull
from mmserve.request.prompt import Message
from tests.support.core_fakes import FakeLLM, FakeStream, make_core, reader


class HeldLLM(FakeLLM):
    """A `FakeLLM` whose streams send nothing until `release()`."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    def release(self) -> None:
        self.gate.set()

    def generate(self, pending):
        stream = super().generate(pending)
        gate = self.gate

        class Held(FakeStream):
            async def __anext__(self):
                await gate.wait()
                return await stream.__anext__()

        return Held(None)


def test_six_requests_of_sixteen_choices_are_sixteen_sequences_each(tiny_models):
    """Six concurrent n = 16 requests were admitted as six (a plain request beside them then took
    37 s): with 16 places, the first holds them all and the other five get 429 at once."""
    llm = HeldLLM()
    core = make_core(tiny_models["qwen2_vl"], llm, max_pending_requests=16)
    request = ChatRequest((Message("user", ("Tell me a story",)),), GenerationOptions(max_tokens=2, n=16))

    async def run():
        tasks = [asyncio.ensure_future(core.generate(None, reader(request), f"r{i}")) for i in range(6)]
        for _ in range(3000):  # 30 s
            if sum(t.done() for t in tasks) == 5 and llm.calls:
                break
            await asyncio.sleep(0.01)
        refused = [t for t in tasks if t.done()]
        assert len(refused) == 5 and core.pending.held == 16 and len(llm.calls) == 1, (len(refused), len(llm.calls))
        llm.release()
        gen = await next(t for t in tasks if not t.done())
        async for _ in gen.deltas():
            pass
        return [t.exception() for t in refused]

    errors = asyncio.run(run())
    assert all(isinstance(e, QueueFull) and "16 sequences wait for their first token" in str(e) for e in errors)
    assert core.pending.held == 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _served(admission: Admission, client: str, prompt: int, seconds: float, clock: Clock) -> None:
    """One request of `prompt` tokens admitted alone and answered after `seconds`."""
    with admission.take(client, 1) as ticket:
        admission.admit(ticket, prompt)
        clock.now += seconds
        admission.started(ticket)


def test_planned_work_is_admitted_while_its_expected_wait_fits_the_ttft_budget():
    clock = Clock()
    admission = Admission(max_sequences=64, ttft_budget_s=2.0, clock=clock)
    _served(admission, "a", 1000 - WORK_PER_SEQUENCE, 0.5, clock)  # learns 0.5 ms per token of work
    assert admission.seconds_per_work == pytest.approx(0.0005)
    with admission.take("a", 1) as first, admission.take("a", 1) as second, admission.take("a", 1) as third:
        admission.admit(first, 1500 - WORK_PER_SEQUENCE)  # ~0.75 s expected
        admission.admit(second, 2000 - WORK_PER_SEQUENCE)  # ~1.75 s with the first ahead
        with pytest.raises(QueueFull, match=r"~2\.2 s to a first token, over the budget of 2 s \(ttft_budget_s\)"):
            admission.admit(third, 1000 - WORK_PER_SEQUENCE)
    assert admission.work == 0 and admission.held == 0
    with admission.take("a", 1) as alone:  # nothing ahead: always admitted, however large
        admission.admit(alone, 100_000)


def test_one_clients_flood_does_not_lock_out_another():
    """Client "flood" fills every place; "other" is refused once, which makes it active: from then
    on "flood" holds at most half, and "other" gets the next free place. Alone, a client may take
    them all."""
    clock = Clock()
    admission = Admission(max_sequences=4, ttft_budget_s=10_000.0, clock=clock)  # places only
    held = [admission.take("flood", 1) for _ in range(4)]
    for hold in held:
        hold.__enter__()
    with pytest.raises(QueueFull, match="4 sequences wait"):
        admission.check("other")
    held.pop().__exit__(None, None, None)
    with pytest.raises(QueueFull, match="this client's requests hold 3 of the 4 places"):
        admission.check("flood")  # over its share (2) while "other" waits
    with admission.take("other", 1):
        assert admission.held == 4
    clock.now += 60  # "other" is gone: "flood" has it all again
    with admission.take("flood", 1):
        assert admission.held == 4
    for hold in held:
        hold.__exit__(None, None, None)


def test_a_request_that_failed_over_teaches_no_pace(tiny_models):
    """A request resubmitted after a lost LLM replica waited for the loss, not for the queue: its time
    to first token is no sample of the seconds per work (the soak's replica kills would otherwise
    have the next requests refused)."""
    core = make_core(tiny_models["qwen2_vl"], FakeLLM(die_after=[0]))
    request = ChatRequest((Message("user", ("Hello",)),), GenerationOptions(max_tokens=2))

    async def run(request_id: str):
        gen = await core.generate(None, reader(request), request_id)
        async for _ in gen.deltas():
            pass

    asyncio.run(run("lost"))
    assert core.pending.seconds_per_work is None
    asyncio.run(run("plain"))
    assert core.pending.seconds_per_work is not None


def test_a_burst_is_shed_from_its_start_by_what_its_first_requests_have_waited():
    """A pace learned while idle undercounted a burst (its first requests' TTFT teaches the pace only
    once they get it, 8.8 s p99 admitted against a 5 s budget): while the requests admitted first
    still wait, what each has waited over the work pending at its admission bounds the pace from
    below, and refuses more work, before its body is even read."""
    clock = Clock()
    admission = Admission(max_sequences=64, ttft_budget_s=2.0, clock=clock)
    _served(admission, "a", 200 - WORK_PER_SEQUENCE, 0.02, clock)  # idle: 0.1 ms per token of work
    assert admission.work_per_sequence == 64 + round(0.2 * (200 - 64))  # the guess before planning moves
    with admission.take("a", 1) as first:
        admission.admit(first, 200 - WORK_PER_SEQUENCE)
        with admission.take("a", 1) as second:
            admission.admit(second, 200 - WORK_PER_SEQUENCE)
            admission.check("a")  # the idle pace: ~0.05 s expected
            clock.now += 1.2  # the first has waited 1.2 s over 200 of work ahead: >= 6 ms per token of work
            assert admission.rate() == pytest.approx(1.2 / 200)
            with pytest.raises(QueueFull, match=r"~3\.2 s to a first token, over the budget of 2 s"):
                admission.check("a")  # (400 pending + the guess, 130 by now) x 6 ms
            admission.started(first)
    assert admission.work == 0 and admission.held == 0 and not admission._waiting
    assert admission.rate() == pytest.approx(0.8 * 0.0001 + 0.2 * 1.2 / 200)
