"""`mmserve serve` as a user starts it on a network (`--host 0.0.0.0`, the API key in
MMSERVE_API_KEY): "ready" means the app answers ready; only the app listens beyond loopback, the key
is in no command line, the dashboard runs no job without Ray's token, requests need the key; SIGTERM
with a stream in flight drains, then exits cleanly (last: it stops the server). Ctrl-C while the
replicas load stops it cleanly. And the exposures it refuses to start.

Beyond loopback listen the HTTP port, the gRPC proxy, and Serve's per-replica inter-deployment gRPC
servers (Serve binds them to [::]; Ray's token authentication guards them)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest

from deployments.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 1500  # long enough to be mid-way when the signal comes
KEY = "k3y-only-in-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}  # its own Ray
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", MMSERVE_API_KEY=KEY)
    return env


class Served(NamedTuple):
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/chat/completions"

    def output(self) -> str:
        return self.log.read_text()

    def tree(self) -> list[psutil.Process]:
        """The command's process and every process of its embedded Ray cluster."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    http_port, grpc_port = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.cli.main", "serve", "--model", tiny_models["qwen2_vl"], "--dtype", "float64",
         "--host", "0.0.0.0", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--num-cpus", "1",
         "--grace-period", "120"],
        cwd=ROOT, env=_environment(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Served(proc, http_port, grpc_port, log)
    try:
        deadline = time.monotonic() + 240
        while "mmserve ready" not in server.output():
            assert proc.poll() is None and time.monotonic() < deadline, server.output()
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.serve
def test_ready_means_the_app_answers_ready(served):
    """The line comes once an LLM and an Encoder replica are loaded and warm, not when the Router is up."""
    health = httpx.get(f"http://127.0.0.1:{served.http_port}/health", timeout=10)
    models = httpx.get(f"http://127.0.0.1:{served.http_port}/v1/models", headers=AUTH, timeout=10)
    assert health.status_code == 200 and models.status_code == 200, (health.text, models.text)
    output = served.output()
    assert output.index("waiting for the replicas to load their models and warm up") < output.index("mmserve ready")


@pytest.mark.serve
def test_ctrl_c_while_the_replicas_load_stops_cleanly(tiny_models, tmp_path):
    """SIGINT (Ctrl-C) before "ready": Serve and Ray stop, the command exits 0, no trace is dumped,
    and no process of its Ray cluster is left (they share its process group)."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.cli.main", "serve", "--model", tiny_models["qwen2_vl"], "--dtype",
         "float64", "--http-port", str(_free_port()), "--grpc-port", str(_free_port()), "--num-cpus", "1",
         "--no-dashboard"],
        cwd=ROOT, env=_environment(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while "waiting for the replicas" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()
        output = log.read_text()
        assert "SIGINT during start-up: stopping" in output and "mmserve ready" not in output
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        deadline = time.monotonic() + 30
        while [p for p in psutil.process_iter(["pid"]) if _group_of(p) == proc.pid]:
            assert time.monotonic() < deadline, "processes of its Ray cluster are left"
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of it (nothing, when the test passed)
        except ProcessLookupError:
            pass


def _group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None


@pytest.mark.serve
def test_beyond_loopback_only_the_app_listens_and_serve_internals_need_rays_token(served):
    import grpc

    listening, exposed = set(), {}  # exposed: port -> process name
    for process in served.tree():
        try:
            for c in process.net_connections("inet"):
                if c.status != psutil.CONN_LISTEN:
                    continue
                listening.add(c.laddr.port)
                if not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:").split("%")[0]).is_loopback:
                    exposed[c.laddr.port] = process.name()
        except psutil.NoSuchProcess:
            continue
    # Serve opens one inter-deployment gRPC server per replica on [::] (a Serve rule); Ray's token guards it
    replica_servers = {port for port, name in exposed.items() if name.startswith("ray::ServeReplica")}
    assert set(exposed) - replica_servers == {served.http_port, served.grpc_port}, exposed
    assert exposed[served.http_port] == "haproxy"  # the header cap in front of Serve's proxy (on loopback)
    # one per replica: Router, Encoder, LLM, VideoDecoder; Ray's own ports were seen, all on loopback
    assert len(replica_servers) == 4 and len(listening) > 8
    for port in replica_servers:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.serve
def test_the_api_key_is_in_no_command_line(served):
    command_lines = []
    for process in served.tree():
        try:
            command_lines.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    assert any("Router" in line for line in command_lines)  # the replicas were among them
    assert not [line for line in command_lines if KEY in line]
    assert "API key from MMSERVE_API_KEY" in served.output()


@pytest.mark.serve
def test_the_dashboard_runs_no_job_without_the_token(served, tmp_path):
    [url] = re.findall(r"Ray dashboard: (http://[\d.]+:\d+)", served.output())
    assert url.startswith("http://127.0.0.1:")
    assert "token auth on" in served.output()
    marker = tmp_path / "pwned"
    resp = httpx.post(f"{url}/api/jobs/", json={"entrypoint": f"touch {marker}"}, timeout=30)
    assert resp.status_code in (401, 403), resp.text
    time.sleep(2)
    assert not marker.exists()


@pytest.mark.serve
def test_requests_need_the_key(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(served.url, json=body, timeout=60).status_code == 401
    ok = httpx.post(served.url, json=body, headers=AUTH, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def _flood(port: int, header_mb: int, until: float, cut: list) -> None:
    """Requests with a `header_mb` MB header, one after another until `until` (no credentials)."""
    chunk = b"a" * (1 << 20)
    while time.monotonic() < until:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
                for _ in range(header_mb):
                    s.sendall(chunk)
                s.sendall(b"\r\n\r\n")
                s.recv(64)
        except OSError:
            cut.append(1)  # the server closed the connection mid-header


@pytest.mark.serve
def test_a_header_flood_leaves_health_answering_within_a_second(served):
    """8 concurrent requests with 16 MB headers, again and again for 8 s (the attack used 100 MB):
    the header cap answers them at 16 KiB, and /health answers within 1 s throughout."""
    until, cut = time.monotonic() + 8, []
    flooders = [threading.Thread(target=_flood, args=(served.http_port, 16, until, cut)) for _ in range(8)]
    for t in flooders:
        t.start()
    worst = 0.0
    while time.monotonic() < until:
        began = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{served.http_port}/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - began)
        time.sleep(0.1)
    for t in flooders:
        t.join()
    assert worst < 1.0 and len(cut) >= 8, (worst, len(cut))


@pytest.mark.serve
def test_sigterm_drains_then_exits_cleanly(served):
    tokens: list[int] = []
    finish: list[str] = []

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 0}
        with httpx.stream("POST", served.url, json=body, headers=AUTH, timeout=300) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        tokens.extend(choice.get("token_ids", []))
                        if choice.get("finish_reason"):
                            finish.append(choice["finish_reason"])

    client = threading.Thread(target=stream)
    client.start()
    while len(tokens) < 2:
        assert client.is_alive(), "the stream ended before it started"
        time.sleep(0.01)
    os.kill(served.proc.pid, signal.SIGTERM)
    while "draining" not in served.output():
        time.sleep(0.05)
    time.sleep(1.0)  # the router has seen the drain mark (it looks every 0.25 s)
    refused = httpx.post(served.url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                         headers=AUTH, timeout=30)
    in_flight = len(tokens)
    assert refused.status_code == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert in_flight < MAX_TOKENS, "the stream finished before the new request came: no drain was observed"
    client.join(timeout=300)
    assert len(tokens) == MAX_TOKENS and finish == ["length"]
    assert served.proc.wait(timeout=120) == 0
    output = served.output()
    assert "shutting down" in output
    for dump in ("Traceback", "SIGTERM received", "Stack (most recent call first)"):
        assert dump not in output, output


@pytest.mark.parametrize("argv", [
    ["serve", "--host", "0.0.0.0"],
    ["serve", "--dashboard-host", "0.0.0.0"],
    ["serve", "--config", str(ROOT / "deployments" / "serve_config.yaml")],  # its http_options.host: 0.0.0.0
    ["serve", "--host", "0.0.0.0", "--ingress", "direct"],
])
def test_exposure_without_ray_token_auth_is_refused_before_anything_starts(argv, monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert main(argv) == 2
    assert "refusing to listen on" in capsys.readouterr().err


def test_direct_ingress_beyond_loopback_is_refused_even_with_ray_token_auth(monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("MMSERVE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--ingress", "direct"]) == 2
    err = capsys.readouterr().err
    assert "refusing --ingress direct on 0.0.0.0" in err and "bounds no header size" in err


def test_no_header_cap_available_is_refused_before_anything_starts(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("MMSERVE_API_KEY", raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "no-haproxy"))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "without a header cap in front of Serve's proxy" in capsys.readouterr().err


def test_an_api_key_env_that_is_not_set_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("MMSERVE_TEST_UNSET_KEY", raising=False)
    assert main(["serve", "--api-key-env", "MMSERVE_TEST_UNSET_KEY"]) == 2
    assert "MMSERVE_TEST_UNSET_KEY: that environment variable is not set" in capsys.readouterr().err
