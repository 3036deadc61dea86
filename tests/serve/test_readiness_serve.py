"""Readiness on a running Serve: an app whose LLM and Encoder replicas cannot be scheduled yet (each
needs a custom resource an actor holds, as replicas wait for GPU nodes to join) answers 503 on
/health and /v1/models, NOT_SERVING on gRPC health and 503 + Retry-After to a chat request, saying
what it waits for; as each replica gets its resource, loads and warms up, the app follows, and once
ready the first request is about as fast as the next ones of its shape."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.media_factory import data_uri, image_bytes
from tests.support.serve_fixtures import GATES, _app_args, hold

pytestmark = pytest.mark.serve
APP = "gated"
WAITING_FOR = "not ready: waiting for a replica of {} to load its model and warm up"


def _image_request(i: int) -> dict:
    content = [{"type": "text", "text": f"Describe picture number {i}."},
               {"type": "image_url", "image_url": {"url": data_uri(image_bytes(112, 112, seed=300 + i))}}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "return_stage_times": True}


class Gated:
    def __init__(self, base: str, grpc_target: str, holders: dict):
        self.base, self.grpc_target, self.holders = base, grpc_target, holders

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=30)

    def grpc_status(self) -> str:
        with grpc.insecure_channel(self.grpc_target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="mmserve.v1.VLMService"), metadata=(("application", APP),),
                timeout=30)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def release(self, which: str) -> None:
        """The replica waiting for this gate gets its resource (its holder goes)."""
        import ray

        if (holder := self.holders.pop(which, None)) is not None:
            ray.kill(holder)

    def wait_for_health(self, until, timeout_s: float = 180) -> httpx.Response:
        deadline = time.monotonic() + timeout_s
        while not until(resp := self.health()):
            assert time.monotonic() < deadline, (resp.status_code, resp.text)
            time.sleep(0.2)
        return resp

    def wait_until_ready(self) -> None:
        self.release("llm")
        self.release("encoder")
        self.wait_for_health(lambda r: r.status_code == 200)


@pytest.fixture(scope="module")
def gated(serve_ports, tiny_models):
    """The app deployed with both gates held (Serve does not wait for it to run)."""
    import ray
    from ray import serve

    from deployments.serve.app import build_app

    llm_gate, encoder_gate = GATES
    holders = {"llm": hold(llm_gate), "encoder": hold(encoder_gate)}
    args = _app_args(tiny_models["qwen2_vl"], APP, readiness_wait_s=0.2,
                     llm={"num_cpus": 0.1, "resources": {llm_gate: 1}},
                     encoder={"num_cpus": 0.1, "resources": {encoder_gate: 1}})
    serve.run_many([serve.RunTarget(build_app(args), name=APP, route_prefix=f"/{APP}")],
                   wait_for_applications_running=False)
    app = Gated(f"http://127.0.0.1:{serve_ports[0]}/{APP}", f"127.0.0.1:{serve_ports[1]}", holders)
    try:
        yield app
    finally:
        serve.delete(APP)
        for holder in app.holders.values():
            ray.kill(holder)


def test_not_ready_until_an_llm_and_an_encoder_replica_are_loaded_and_warm(gated):
    # the Router is up (its answer, not the proxy's), the LLM and Encoder replicas cannot be scheduled
    resp = gated.wait_for_health(lambda r: r.status_code == 503 and "not ready" in r.text)
    both = WAITING_FOR.format("the LLM deployment and the Encoder deployment")
    assert resp.json()["error"]["message"] == both and resp.headers["retry-after"] == "1"
    models = httpx.get(gated.base + "/v1/models", timeout=30)
    assert models.status_code == 503 and models.json()["error"]["message"] == both
    assert gated.grpc_status() == "NOT_SERVING"
    began = time.monotonic()
    chat = httpx.post(gated.base + "/v1/chat/completions", json=_image_request(0), timeout=60)
    assert chat.status_code == 503 and chat.headers["retry-after"] == "1"
    assert chat.json()["error"]["message"] == both + "; retry shortly"
    assert time.monotonic() - began < 10  # it waited readiness_wait_s (0.2 s), not for the replicas

    gated.release("llm")  # the LLM replica is scheduled, loads its model and warms up
    encoder_only = WAITING_FOR.format("the Encoder deployment")
    resp = gated.wait_for_health(lambda r: r.status_code == 200 or r.json()["error"]["message"] == encoder_only)
    assert resp.status_code == 503 and resp.json()["error"]["message"] == encoder_only
    assert gated.grpc_status() == "NOT_SERVING"

    gated.release("encoder")
    assert gated.wait_for_health(lambda r: r.status_code != 503 or "not ready" not in r.text).status_code == 200
    assert httpx.get(gated.base + "/v1/models", timeout=30).json()["data"][0]["id"] == APP
    assert gated.grpc_status() == "SERVING"


def test_the_first_request_after_ready_is_about_as_fast_as_the_next(gated):
    """Before the warm-ups the first image request took ~2x the next ones (+130 ms on ~120 ms on 2
    CPU cores, 72 ms of it in the router: its handles' first calls, the chat template, image header
    reading); now +20 ms. The first is one sample while the suite's other process computes, so it is
    held to the slowest of the next six, not to their median (a cold first request still exceeds them
    on a quiet box); the latency figure itself is bench/cli.py's `readme_first_answer_ms`."""
    gated.wait_until_ready()
    timings = []
    for i in range(7):
        began = time.perf_counter()
        resp = httpx.post(gated.base + "/v1/chat/completions", json=_image_request(10 + i), timeout=120)
        assert resp.status_code == 200, resp.text
        timings.append((time.perf_counter() - began, resp.json()["usage"]["stage_ms"]["router_ms"] / 1000))
    (first, first_router), rest = timings[0], timings[1:]
    assert first <= max(t for t, _ in rest) + 0.03, timings
    assert first_router <= max(r for _, r in rest) + 0.01, timings
