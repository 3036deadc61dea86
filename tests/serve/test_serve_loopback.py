"""`mmserve serve` on loopback as a laptop user starts it (no API key, no flag but ports): the request
cap runs in front of Serve's proxy there too, so one local client cannot starve the others; without
a key nothing serves gRPC; Serve's route table and the OpenAPI schema are off; start-up answers no
404 and never hangs (issue 59's probes, on loopback).

Per-client limits count by source address: every 127.0.0.0/8 address is loopback, so the other
clients here come from 127.0.0.2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from tests.support.serve_command import READY, launch, listeners, stop, wait_ready_or_exit
from tests.support.serve_fixtures import _free_port

pytestmark = pytest.mark.serve

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OTHER = "127.0.0.2"  # another client


class Served(NamedTuple):
    proc: subprocess.Popen
    port: int
    log: Path
    start_up: list  # (status or error, seconds) of each /health poll until "ready"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()


def _get(url: str, source: str = OTHER, timeout: float = 5.0) -> tuple[int | str, float]:
    began = time.monotonic()
    try:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout) as client:
            status = client.get(url).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, time.monotonic() - began


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("loopback") / "serve.log"
    start_up: list = []
    proc = launch(["--model", tiny_models["qwen2_vl"], "--dtype", "float64", "--http-port", str(port),
                   "--num-cpus", "1", "--no-dashboard", "--grace-period", "5"], log)

    def poll() -> None:  # /health from the start, as a load balancer would
        while proc.poll() is None and READY not in log.read_text():
            start_up.append(_get(f"http://127.0.0.1:{port}/health", timeout=30))
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        assert wait_ready_or_exit(proc, log, timeout_s=240) is None, log.read_text()[-5000:]
        poller.join(timeout=60)
        yield Served(proc, port, log, start_up)
    finally:
        stop(proc)


def test_start_up_answers_no_404_and_never_hangs(served):
    """Before "ready" nothing listens on the port (the cap starts once the app answers ready): no 404
    between Serve's proxy coming up and the routes existing, no /health held for seconds."""
    assert served.start_up, "no poll ran"
    statuses = {status for status, _ in served.start_up}
    assert 404 not in statuses, served.start_up
    assert max(seconds for _, seconds in served.start_up) < 5, served.start_up
    assert _get(f"{served.base}/health")[0] == 200


def test_without_an_api_key_no_grpc_proxy_listens(served):
    exposed = {s.port: s.process for s in listeners(served.proc.pid) if not s.loopback}
    # what is left beyond loopback: Serve's inter-deployment server of each replica (Ray's token guards it)
    assert all(name.startswith("ray::ServeReplica") for name in exposed.values()), exposed
    assert "no API key: Serve's gRPC proxy is not started" in served.output()
    assert "no gRPC (no API key)" in served.output()


def test_the_openapi_schema_and_serves_route_table_are_off(served):
    for path in ("/openapi.json", "/-/routes", "/docs"):
        assert _get(served.base + path)[0] == 404, path
    assert _get(served.base + "/-/healthz")[0] == 200  # Serve's own liveness stays


def _trickle(port: int, until: float) -> None:
    """A chat request whose body comes a byte a second (a slow client, or one that means to stall)."""
    body = json.dumps(BODY).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            for byte in body:
                if time.monotonic() > until:
                    return
                s.sendall(bytes([byte]))
                time.sleep(1)
    except OSError:
        pass


def test_trickled_bodies_starve_no_one(served):
    """70 connections trickling their bodies (the probe's count: above the Router's 64 places) while
    others ask: every other request is answered within seconds, /health too."""
    until = time.monotonic() + 20
    tricklers = [threading.Thread(target=_trickle, args=(served.port, until), daemon=True) for _ in range(70)]
    for t in tricklers:
        t.start()
    time.sleep(3)
    answers = []
    for source in (OTHER, "127.0.0.1", OTHER):
        began = time.monotonic()
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=15) as client:
            try:
                answers.append((client.post(f"{served.base}/v1/chat/completions", json=BODY).status_code,
                                time.monotonic() - began))
            except httpx.HTTPError as e:
                answers.append((type(e).__name__, time.monotonic() - began))
        answers.append(_get(f"{served.base}/health"))
    asked_in_time = time.monotonic() < until
    for t in tricklers:
        t.join()
    assert all(status == 200 and seconds < 10 for status, seconds in answers), answers
    assert asked_in_time, "the tricklers stopped before the others had asked"


def test_one_clients_unfinished_connections_are_capped_and_health_answers(served):
    """300 connections with unfinished headers from one loopback address: past its 256 the cap closes
    them at once, and /health (another address) answers every poll."""
    held, closed = [], 0
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        time.sleep(1)
        for s in held:
            s.settimeout(0.05)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:  # still open, waiting for the rest of its headers
                pass
        polls = [_get(f"{served.base}/health", timeout=2) for _ in range(16)]
    finally:
        for s in held:
            s.close()
    assert closed >= 300 - 256 - 1, closed
    assert all(status == 200 for status, _ in polls), polls


def test_a_huge_body_is_refused_without_stalling_health(served):
    """A 60 MB prompt (under the 64 MiB body limit: the text cap refuses it, 413) while /health is asked
    every 0.1 s: each answer within a second. A body over the limit is refused by the cap from its
    Content-Length, before a byte of it goes further (no Serve request id on the answer)."""
    url = f"{served.base}/v1/chat/completions"
    done: dict = {}

    def send() -> None:
        big = {"messages": [{"role": "user", "content": "a" * (60 << 20)}], "max_tokens": 2}
        done["status"] = httpx.post(url, json=big, timeout=120).status_code

    sender = threading.Thread(target=send)
    sender.start()
    polls = []
    while sender.is_alive():
        polls.append(_get(f"{served.base}/health", timeout=1))
        time.sleep(0.1)
    sender.join()
    assert done["status"] == 413 and polls and all(status == 200 for status, _ in polls), (done, polls)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % ((64 << 20) + 1)
                  + b"x" * (32 << 10))
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413") and b"x-request-id" not in answer.lower(), answer
