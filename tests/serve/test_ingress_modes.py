"""`mmserve serve --ingress direct` (Serve 2.60's experimental ingress mode), launched
as a user launches it, with the API key in the environment and small admission bounds: auth,
health and reflection, streaming equal to unary over HTTP and gRPC, a burst that gets 429s with
Retry-After while the admitted requests give the unloaded tokens, and a drain on SIGTERM.

In `direct` the Router replica listens itself (HTTP from port 30000, gRPC from 40000): the test
finds its ports as a load balancer would. Serve's own HAProxy mode is no choice
(tests/serve/test_serve_command.py). The default mode (`proxy`, header-capped beyond loopback) is tests/serve/test_serve_command.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.ingress import direct_ports
from mmserve.rpc.vlm_client import VLMClient, user
from tests.support.serve_command import launch, serve_config, stop, wait_ready_or_exit
from tests.support.serve_fixtures import _free_port

pytestmark = pytest.mark.serve

KEY = "ingress-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12, "ignore_eos": True,
        "temperature": 0}


class Served(NamedTuple):
    mode: str
    proc: subprocess.Popen
    http: str  # base URL clients use
    grpc: str  # host:port clients use
    log: Path

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module", params=["direct"])
def served(request, tiny_models, tmp_path_factory):
    mode = request.param
    http_port, grpc_port = _free_port(), _free_port()
    root = tmp_path_factory.mktemp(f"ingress-{mode}")
    config = root / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_config(
        tiny_models["qwen2_vl"], http_port, grpc_port, api_key_env="MMSERVE_API_KEY", max_pending_requests=2,
        router={"num_replicas": 1, "num_cpus": 0.1, "max_ongoing_requests": 4, "max_queued_requests": 2})))
    log = root / "serve.log"
    proc = launch(["--config", str(config), "--ingress", mode, "--num-cpus", "1", "--grace-period", "120",
                   "--no-dashboard"], log, MMSERVE_API_KEY=KEY)
    try:
        assert wait_ready_or_exit(proc, log, timeout_s=240) is None, log.read_text()[-5000:]
        if mode == "direct":
            http_port, grpc_port = direct_ports(proc.pid)
        yield Served(mode, proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
    finally:  # the whole session
        stop(proc)


def _stream_text(url: str, body: dict) -> tuple[str, list[int]]:
    text, tokens = [], []
    with httpx.stream("POST", url, json={**body, "stream": True, "return_token_ids": True}, headers=AUTH,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content", ""))
                    tokens.extend(choice.get("token_ids", []))
    return "".join(text), tokens


def test_http_auth_health_and_streaming_equal_to_unary(served):
    assert "ingress " + served.mode in served.output()
    assert httpx.get(f"{served.http}/health", timeout=30).status_code == 200
    url = f"{served.http}/v1/chat/completions"
    assert httpx.post(url, json=BODY, timeout=60).status_code == 401
    unary = httpx.post(url, json={**BODY, "return_token_ids": True}, headers=AUTH, timeout=120)
    assert unary.status_code == 200, unary.text
    choice = unary.json()["choices"][0]
    text, tokens = _stream_text(url, BODY)
    assert text == choice["message"]["content"] and len(tokens) == BODY["max_tokens"]


def test_grpc_auth_health_reflection_and_streaming_equal_to_unary(served):
    with grpc.insecure_channel(served.grpc) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert "mmserve.v1.VLMService" in {s.name for s in answer.list_services_response.service}
    with VLMClient(served.grpc) as c, pytest.raises(grpc.RpcError) as refused:
        c.generate([user("hi")], max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with VLMClient(served.grpc, api_key=KEY) as c:
        unary = c.generate([user("tell me a story")], max_tokens=12, ignore_eos=True)
        streamed = list(c.stream([user("tell me a story")], max_tokens=12, ignore_eos=True))
    assert [t for r in streamed for t in r.token_ids] == list(unary.token_ids) and len(unary.token_ids) == 12


def test_a_burst_gets_429s_and_the_admitted_requests_their_tokens(served):
    url = f"{served.http}/v1/chat/completions"
    expected = httpx.post(url, json=BODY, headers=AUTH, timeout=120).json()["choices"][0]["message"]["content"]
    responses: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: responses.append(httpx.post(url, json=BODY, headers=AUTH, timeout=120)))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shed = [r for r in responses if r.status_code == 429]
    ok = [r for r in responses if r.status_code == 200]
    assert len(shed) + len(ok) == 16, [r.status_code for r in responses]
    assert shed and len(ok) >= 2 and all(r.headers.get("retry-after") for r in shed)
    assert all(r.json()["choices"][0]["message"]["content"] == expected for r in ok)


def test_sigterm_drains_the_stream_in_flight_then_exits(served):
    tokens: list[int] = []
    body = {**BODY, "max_tokens": 150}

    def stream() -> None:
        tokens.extend(_stream_text(f"{served.http}/v1/chat/completions", body)[1])

    client = threading.Thread(target=stream)
    client.start()
    time.sleep(1.0)  # the stream has started
    os.kill(served.proc.pid, signal.SIGTERM)
    client.join(timeout=300)
    assert len(tokens) == body["max_tokens"]
    assert served.proc.wait(timeout=120) == 0
    assert "draining" in served.output() and "Traceback" not in served.output()
