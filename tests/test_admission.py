"""Admission control: the LLM deployment's bound on waiting prompt tokens (429 / RESOURCE_EXHAUSTED
at once, Retry-After over HTTP) and Serve's queue bound with its 429, set from the config."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deployments.config import AppArgs, DeploymentArgs
from deployments.failures import classify
from deployments.llm import LLMDeployment, PendingRequest
from deployments.openai_api import error_response
from llm_service.sampling import SamplingParams
from mmserve.errors import QueueFull


def _pending(request_id: str, prompt: int, attempt: int = 0) -> PendingRequest:
    return PendingRequest(
        request_id=request_id, prompt_token_ids=tuple(range(100, 100 + prompt)),
        sampling=SamplingParams(max_tokens=2, ignore_eos=True), positions=None, ranges=(), embeddings=(),
        attempt=attempt,
    )


async def _drain(stream) -> list[int]:
    return [e.token_id async for e in stream if e.token_id is not None]


def test_waiting_prompt_tokens_are_bounded(tiny_models):
    llm = LLMDeployment.func_or_class(tiny_models["qwen2_vl"], "float64", "cpu", max_waiting_tokens=30)

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


def test_a_full_queue_is_429_with_retry_after_and_resource_exhausted():
    failure = classify(QueueFull("20 prompt tokens wait for the language model (limit 30)"))
    assert (failure.kind, failure.http_status, failure.grpc_code) == ("busy", 429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    response = error_response(failure.http_status, failure.message)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert "server busy" in response.body.decode()


def test_serve_queue_bounds_come_from_the_config():
    args = AppArgs()
    router, llm, encoder = args.router.options("Router"), args.llm.options("LLM"), args.encoder.options("Encoder")
    assert router["max_queued_requests"] == 64 and llm["max_queued_requests"] == 64
    assert encoder["max_queued_requests"] == -1  # the encoder is bounded by queued bytes
    assert router["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert DeploymentArgs(max_queued_requests=3).options("LLM")["max_queued_requests"] == 3
