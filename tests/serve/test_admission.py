"""Admission control: a full queue's 429 / RESOURCE_EXHAUSTED (Retry-After over HTTP; the LLM
replica's bound on waiting prompt tokens is tested on its core, `tests/unit/test_llm_replica.py`)
and Serve's queue bound with its 429, set from the config."""

from __future__ import annotations

import grpc
import pytest

from deployments.api.openai_api import error_response
from deployments.config import AppArgs, DeploymentArgs
from deployments.core.failures import classify
from mmserve.errors import QueueFull


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
    assert router["max_queued_requests"] == router["max_ongoing_requests"] == 1024  # streams, mostly
    assert llm["max_queued_requests"] == llm["max_ongoing_requests"] == 64
    assert DeploymentArgs(max_ongoing_requests=200).options("Router")["max_queued_requests"] == 200
    assert encoder["max_queued_requests"] == -1  # the encoder is bounded by queued bytes
    assert router["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert DeploymentArgs(max_queued_requests=3).options("LLM")["max_queued_requests"] == 3


def test_a_deployment_given_in_part_keeps_its_own_defaults_for_the_rest():
    """`router: {num_replicas: 2}` replaced the Router's defaults with the class's (1 CPU, 64 requests),
    not those the configuration page lists for it (0.25, 1024)."""
    args = AppArgs.model_validate({"router": {"num_replicas": 2}, "llm": {"num_cpus": 0.1}})
    assert (args.router.num_replicas, args.router.num_cpus, args.router.max_ongoing_requests) == (2, 0.25, 1024)
    assert (args.llm.num_cpus, args.llm.max_ongoing_requests) == (0.1, 64)
    assert AppArgs.model_validate({"router": {"max_ongoing_requests": 8}}).router.num_cpus == 0.25


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
