"""SIGTERM to `mmserve serve` with a stream in flight: the stream completes, a new request gets
503, the process exits 0 and prints no stack dump."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 1500  # long enough to be mid-way when the signal comes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_exits_cleanly(tiny_models, tmp_path):
    http_port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}  # its own Ray
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.cli", "serve", "--model", tiny_models["qwen2_vl"], "--dtype", "float64",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--num-cpus", "1", "--grace-period", "120"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    try:
        deadline = time.monotonic() + 240
        while "mmserve ready" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)

        tokens: list[int] = []
        finish: list[str] = []

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 0}
            with httpx.stream("POST", url, json=body, timeout=300) as resp:
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
        os.kill(proc.pid, signal.SIGTERM)
        while "draining" not in (tmp_path / "serve.log").read_text():
            time.sleep(0.05)
        time.sleep(1.0)  # the router has seen the drain mark (it looks every 0.25 s)
        refused = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
        in_flight = len(tokens)
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        assert in_flight < MAX_TOKENS, "the stream finished before the new request came: no drain was observed"
        client.join(timeout=300)
        assert len(tokens) == MAX_TOKENS and finish == ["length"]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = (tmp_path / "serve.log").read_text()
    assert "shutting down" in output
    for dump in ("Traceback", "SIGTERM received", "Stack (most recent call first)"):
        assert dump not in output, output
