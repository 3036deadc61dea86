"""Admission control: the LLM deployment's bound on waiting prompt tokens (429 / RESOURCE_EXHAUSTED
at once, Retry-After over HTTP) and Serve's queue bound with its 429, set from the config."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deployments.api.openai_api import error_response
from deployments.config import AppArgs, DeploymentArgs
from deployments.core.failures import classify
from deployments.core.llm_inputs import PendingRequest
from deployments.serve.llm import LLMDeployment
from llm_service.sampling import SamplingParams
from mmserve.errors import QueueFull


def _pending(request_id: str, prompt: int, attempt: int = 0, n: int = 1) -> PendingRequest:
    return PendingRequest(
        request_id=request_id, prompt_token_ids=tuple(range(100, 100 + prompt)),
        sampling=SamplingParams(max_tokens=2, ignore_eos=True), positions=None, ranges=(), embeddings=(),
        attempt=attempt, n=n,
    )


async def _drain(stream) -> list[int]:
    return [e.token_id async for e in stream if e.token_id is not None]


def test_waiting_prompt_tokens_are_bounded(tiny_models):
    args = AppArgs(model=tiny_models["qwen2_vl"], dtype="float64", device="cpu", engine={"max_waiting_tokens": 30})
    llm = LLMDeployment.func_or_class(args, args.engine.resolve(1.0))

    async def main():
        first = llm.generate(_pending("a", 20))
        head = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0)  # "a" is admitted and waits for its first token
        assert llm.waiting_tokens == 20
        with pytest.raises(QueueFull, match="20 prompt tokens wait"):
            await llm.generate(_pending("b", 20)).__anext__()
        small = asyncio.create_task(_drain(llm.generate(_pending("c", 5))))  # fits under the bound
        resumed = asyncio.create_task(_drain(llm.generate(_pending("d", 20, attempt=1))))  # a failover: never refused
        await asyncio.sleep(0)
        assert llm.waiting_tokens == 45
        tokens = [(await head).token_id, *await _drain(first)]
        assert len(tokens) == 2 and len(await small) == 2 and len(await resumed) == 2
        assert llm.waiting_tokens == 0
        assert len(await _drain(llm.generate(_pending("e", 40)))) == 2  # alone, even a larger prompt runs

    try:
        asyncio.run(main())
    finally:
        llm.engine.shutdown()


def test_a_request_of_n_choices_waits_as_n_prompts(tiny_models):
    """`n` choices are `n` sequences to run: six `n = 16` requests were admitted as six prompts."""
    args = AppArgs(model=tiny_models["qwen2_vl"], dtype="float64", device="cpu", engine={"max_waiting_tokens": 30})
    llm = LLMDeployment.func_or_class(args, args.engine.resolve(1.0))

    async def main():
        first = llm.generate(_pending("a", 10, n=4))
        head = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0)
        assert llm.waiting_tokens == 40
        with pytest.raises(QueueFull, match="40 prompt tokens wait"):
            await llm.generate(_pending("b", 5)).__anext__()
        await head
        await _drain(first)
        assert llm.waiting_tokens == 0

    try:
        asyncio.run(main())
    finally:
        llm.engine.shutdown()


def test_a_full_queue_is_429_with_retry_after_and_resource_exhausted():
    failure = classify(QueueFull("20 prompt tokens wait for the language model (limit 30)"))
    assert (failure.kind, failure.http_status, failure.grpc_code) == ("busy", 429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    response = error_response(failure.http_status, failure.message)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert "server busy" in response.body.decode()


def test_serve_queue_bounds_come_from_the_config():
    args = AppArgs()
    router, llm, encoder = args.router.options("Router"), args.llm.options("LLM"), args.encoder.options("Encoder")
    # as many as a replica runs: Serve queues requests it has not yet assigned even with idle replicas
    assert router["max_queued_requests"] == router["max_ongoing_requests"] == 64
    assert llm["max_queued_requests"] == llm["max_ongoing_requests"]
    assert DeploymentArgs(max_ongoing_requests=200).options("Router")["max_queued_requests"] == 200
    assert encoder["max_queued_requests"] == -1  # the encoder is bounded by queued bytes
    assert router["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert DeploymentArgs(max_queued_requests=3).options("LLM")["max_queued_requests"] == 3


@pytest.mark.serve
def test_a_burst_over_the_queue_bounds_gets_429_and_the_rest_completes(serve_ports, tiny_models):
    import threading

    import httpx
    from ray import serve

    from deployments.serve.app import build_app
    from tests.support.serve_fixtures import _app_args

    app = "admission"
    # Serve sheds past 4 running + 2 queued; the router past 2 requests without a first token
    router = {"num_cpus": 0.1, "max_ongoing_requests": 4, "max_queued_requests": 2}
    args = _app_args(tiny_models["qwen2_vl"], app, router=router, max_pending_requests=2)
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    url = f"http://127.0.0.1:{serve_ports[0]}/{app}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}
    try:
        expected = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
        responses: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: responses.append(httpx.post(url, json=body, timeout=120)))
                   for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        serve.delete(app)
    shed = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(shed) + len(served) == 16, [r.status_code for r in responses]
    assert shed and len(served) >= 2
    assert all(r.headers.get("retry-after") == "1" for r in shed)
    assert any("wait for their first token (limit 2)" in r.text for r in shed)  # the router's own bound
    assert all(r.json()["choices"][0]["message"]["content"] == expected for r in served)
