"""Readiness without Ray: the watch over fake backends (handles whose `ready()` answers once a replica
is up), what the core does with a request before it is ready, and what the HTTP and gRPC adapters
answer (503 with what it waits for / NOT_SERVING) before, after and while draining."""

from __future__ import annotations

import asyncio
import json

from grpc_health.v1 import health_pb2
from starlette.requests import Request

from deployments.api.grpc_api import GrpcAdapter
from deployments.api.openai_api import OpenAIAdapter
from deployments.core.generation import GenerationOptions
from deployments.core.readiness import Readiness
from deployments.core.request_core import ChatRequest
from mmserve.errors import NotReady
from mmserve.request.prompt_plan import Message
from tests.support.core_fakes import FakeBackend, FakeLLM, make_core, reader

HELLO = ChatRequest((Message("user", ("hello",)),), GenerationOptions(max_tokens=2))


def test_not_ready_until_every_backend_has_answered_once():
    async def scenario():
        llm, encoder = FakeBackend(), FakeBackend()
        readiness = Readiness({"LLM": llm.ready.remote, "Encoder": encoder.ready.remote})
        readiness.start()
        seen = [await readiness.wait(0.05), readiness.reason()]
        llm.start_replica()
        seen += [await readiness.wait(0.05), readiness.reason()]
        encoder.start_replica()
        seen += [await readiness.wait(1.0), readiness.reason()]
        return seen, llm.calls, encoder.calls

    (before, waiting_both, middle, waiting_encoder, after, none), llm_calls, encoder_calls = asyncio.run(scenario())
    assert not before and "the LLM deployment and the Encoder deployment" in waiting_both
    assert not middle and waiting_encoder == ("not ready: waiting for a replica of the Encoder deployment to load "
                                              "its model and warm up")
    assert after and none == ""
    assert (llm_calls, encoder_calls) == (1, 1)  # one call each, waiting for its replica


def test_a_failed_or_unanswered_call_is_made_again():
    async def scenario():
        lost, slow = FakeBackend(fail_first=2), FakeBackend()
        readiness = Readiness({"LLM": lost.ready.remote, "Encoder": slow.ready.remote}, retry_s=0.01,
                              attempt_timeout_s=0.05)
        lost.start_replica()
        readiness.start()
        await asyncio.sleep(0.2)  # the Encoder's calls time out, again and again
        slow.start_replica()
        return await readiness.wait(1.0), lost.calls, slow.calls

    ready, lost_calls, slow_calls = asyncio.run(scenario())
    assert ready and lost_calls == 3 and slow_calls >= 2


def test_ready_stays_ready():
    """Replicas lost later are Serve's health checks' and the failover's: no more calls are made."""
    async def scenario():
        llm = FakeBackend()
        llm.start_replica()
        readiness = Readiness({"LLM": llm.ready.remote})
        first = await readiness.wait(1.0)
        llm.fail_first = 10**6  # every call would fail now
        await asyncio.sleep(0.05)
        return first, await readiness.wait(0.0), llm.calls

    assert asyncio.run(scenario()) == (True, True, 1)


def test_a_request_before_ready_waits_then_gets_503_unavailable(tiny_models):
    llm = FakeLLM()

    async def scenario():
        backend = FakeBackend()
        core = make_core(tiny_models["qwen2_vl"], llm, readiness=Readiness({"LLM": backend.ready.remote}),
                         readiness_wait_s=0.05)
        try:
            await core.generate(None, reader(HELLO), "early")
        except NotReady as e:
            refused = core.failed(e, "early")
        backend.start_replica()
        gen = await core.generate(None, reader(HELLO), "late")
        return refused, [d async for d in gen.deltas()]

    refused, deltas = asyncio.run(scenario())
    assert (refused.http_status, refused.grpc_code.name) == (503, "UNAVAILABLE")
    assert refused.message == ("not ready: waiting for a replica of the LLM deployment to load its model and warm "
                               "up; retry shortly")
    assert len(llm.calls) == 1 and llm.calls[0].request_id == "late" and deltas[-1].finish_reason == "length"


def test_a_request_that_comes_while_a_replica_finishes_loading_waits_for_it(tiny_models):
    """A Router replica that just started in a running app: its first call answers within the wait."""
    async def scenario():
        backend = FakeBackend()
        core = make_core(tiny_models["qwen2_vl"], readiness=Readiness({"LLM": backend.ready.remote}),
                         readiness_wait_s=5.0)
        asyncio.get_running_loop().call_later(0.1, backend.start_replica)
        gen = await core.generate(None, reader(HELLO), "r")
        return [d async for d in gen.deltas()]

    assert asyncio.run(scenario())[-1].finish_reason == "length"


def _http(adapter: OpenAIAdapter) -> list[tuple[int, dict | None, str | None]]:
    """(status, JSON body, Retry-After) of /health and /v1/models."""
    answers = []
    for response in (adapter.health(), adapter.models(Request({"type": "http", "headers": []}))):
        body = json.loads(response.body) if response.body else None
        answers.append((response.status_code, body, response.headers.get("retry-after")))
    return answers


def test_health_models_and_grpc_health_follow_readiness_and_draining(tiny_models):
    async def scenario():
        backend, draining = FakeBackend(), [False]
        core = make_core(tiny_models["qwen2_vl"], readiness=Readiness({"LLM": backend.ready.remote}))
        core._draining = lambda: draining[0]
        http, grpc_adapter = OpenAIAdapter(core), GrpcAdapter(core)

        def states():
            check = grpc_adapter.check(health_pb2.HealthCheckRequest(service=""), None)
            return _http(http), health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)

        seen = [states()]  # the first look starts the watch
        backend.start_replica()
        await core.readiness.wait(1.0)
        seen.append(states())
        draining[0] = True
        seen.append(states())
        return seen

    (before, before_grpc), (after, after_grpc), (drained, drained_grpc) = asyncio.run(scenario())
    waiting = "not ready: waiting for a replica of the LLM deployment to load its model and warm up"
    for status, body, retry_after in before:
        assert (status, body["error"]["message"], body["error"]["code"], retry_after) == (503, waiting, 503, "1")
    assert before_grpc == "NOT_SERVING"
    (health, _, _), (models, card, _) = after
    assert (health, models, card["data"][0]["id"], after_grpc) == (200, 200, "m", "SERVING")
    (health, body, _), (models, _, _) = drained
    assert (health, body["error"]["message"], models, drained_grpc) == (503, "server is shutting down", 200,
                                                                        "NOT_SERVING")


def test_the_router_waits_for_the_encoder_only_where_the_app_has_one():
    from deployments.serve.router import readiness

    llm, encoder = FakeBackend(), FakeBackend()
    assert readiness(encoder, llm).waiting_for == ("LLM", "Encoder")
    assert readiness(None, llm).waiting_for == ("LLM",)  # colocated, or a standalone encoder
