"""Serve's ingress modes side by side: `mmserve serve --ingress proxy|direct`, and `proxy` beyond
loopback. `proxy` runs behind the request cap `mmserve serve` puts in front on every interface
(deployments/cli/ingress_modes.py; on loopback too since issue 59), `direct` without it; the load
comes from one address, so the cap's per-client connection limit is off (0).

Each mode serves the embedded tiny model from its own `mmserve serve` (one after the other, same
CPUs). Per mode: /health and a 1-token request one at a time (the ingress cost: the tiny model's
own time is the same in every mode), an unloaded run of short generations (p99 TTFT), then the
soak's burst (256 requests at once): how fast 429s come back and the admitted requests' p99 TTFT.

    python bench/ingress.py [--quick] [--modes proxy direct proxy-capped]

(Serve's own HAProxy mode is not offered by `mmserve serve`: it listens on every interface.)

Last line: one JSON object with, per mode, `small_request_p50_ms`, `health_p50_ms`,
`burst_shed_p50_ms`, `burst_admitted_p99_ttft_ms`, `unloaded_p99_ttft_ms`, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import httpx

from deployments.cli.ingress_modes import free_loopback_port
from mmserve.loadgen.metrics import percentile

ROOT = Path(__file__).resolve().parents[1]
MODES = ("proxy", "direct", "proxy-capped")


def direct_ports(pid: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """The Router replica's direct-ingress HTTP and gRPC ports (Serve allocates them from 30000
    and 40000), found among `pid`'s descendants as a load balancer's health check would (its gRPC
    port: the one whose server has the health service), waiting up to `timeout_s` for them."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                if "Router" not in " ".join(p.cmdline()):
                    continue
                ports = {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            except psutil.NoSuchProcess:
                continue
            http = [port for port in ports if 30000 <= port < 31000]
            grpc = [port for port in sorted(ports) if 40000 <= port < 41000 and _serves_health(port)]
            if http and grpc:
                return min(http), grpc[0]
        if time.monotonic() > deadline:
            raise RuntimeError("no Router replica listens on direct-ingress ports")
        time.sleep(1.0)


def _serves_health(port: int) -> bool:
    """Whether the gRPC server on `port` has the health service: the replica's other gRPC servers
    (Serve's inter-deployment one) may take a port in the same range, and answer UNIMPLEMENTED."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        except grpc.RpcError as e:
            return e.code() != grpc.StatusCode.UNIMPLEMENTED
    return True


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (a `mmserve serve` started with start_new_session):
    its process group is not enough, since Serve runs HAProxy in a process group of its own."""
    import psutil

    for p in psutil.process_iter():
        with suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getsid(p.pid) == sid:
                p.kill()


class Server:
    def __init__(self, mode: str, log_dir: Path):
        self.mode, self.http_port = mode, free_loopback_port()
        ingress = "proxy" if mode == "proxy-capped" else mode
        host = "0.0.0.0" if mode == "proxy-capped" else "127.0.0.1"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_ENABLE"))}
        env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
        self.log = log_dir / f"{mode}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.cli.main", "serve", "--ingress", ingress, "--host", host,
             "--http-port", str(self.http_port), "--grpc-port", str(free_loopback_port()), "--no-dashboard",
             "--max-connections-per-client", "0"],
            cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while "mmserve ready" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        port = direct_ports(self.proc.pid)[0] if self.mode == "direct" else self.http_port
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        kill_session(self.proc.pid)
        self.proc.wait()


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float, float | None]:
    """(status, seconds to the response, seconds to the first token or None)."""
    began = time.perf_counter()
    async with client.stream("POST", url, json={**body, "stream": True}) as resp:
        answered = time.perf_counter() - began
        first = None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                first = time.perf_counter() - began
        return resp.status_code, answered, first


async def measure(base: str, model: str, small: int, unloaded: int, burst: int) -> dict:
    url = f"{base}/v1/chat/completions"
    tiny = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    gen = {"model": model, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 16,
           "ignore_eos": True}
    limits = httpx.Limits(max_connections=burst + 8, max_keepalive_connections=burst + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for _ in range(5):  # warm
            await client.post(url, json=tiny)
        health, small_ms = [], []
        for _ in range(small):
            t = time.perf_counter()
            assert (await client.get(f"{base}/health")).status_code == 200
            health.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            assert (await client.post(url, json=tiny)).status_code == 200
            small_ms.append((time.perf_counter() - t) * 1000)
        ttft_unloaded = []
        for _ in range(unloaded):
            status, _, first = await _one(client, url, gen)
            assert status == 200 and first is not None
            ttft_unloaded.append(first * 1000)
        results = await asyncio.gather(*[_one(client, url, gen) for _ in range(burst)])
    shed = [answered * 1000 for status, answered, _ in results if status == 429]
    admitted = [first * 1000 for status, _, first in results if status == 200 and first is not None]
    other = [status for status, _, _ in results if status not in (200, 429)]
    out = {
        "health_p50_ms": round(statistics.median(health), 2),
        "small_request_p50_ms": round(statistics.median(small_ms), 2),
        "unloaded_p99_ttft_ms": round(percentile(ttft_unloaded, 99), 1),
        "burst_shed": len(shed), "burst_admitted": len(admitted), "burst_other": len(other),
        "burst_shed_p50_ms": round(percentile(shed, 50), 1) if shed else None,
        "burst_admitted_p99_ttft_ms": round(percentile(admitted, 99), 1) if admitted else None,
    }
    out["burst_p99_ttft_over_unloaded"] = (round(out["burst_admitted_p99_ttft_ms"] / out["unloaded_p99_ttft_ms"], 2)
                                           if admitted else None)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--quick", action="store_true", help="30 small requests, 10 unloaded, the 256 burst")
    ap.add_argument("--small-requests", type=int, default=None)
    ap.add_argument("--burst", type=int, default=256)
    ns = ap.parse_args(argv)
    small = ns.small_requests or (30 if ns.quick else 200)
    unloaded = 10 if ns.quick else 30
    from mmserve.tiny import default_model_dir, ensure_tiny_model

    ensure_tiny_model()
    model = default_model_dir().name
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as logs:
        for mode in ns.modes:
            server = Server(mode, Path(logs))
            try:
                figures[mode] = asyncio.run(measure(server.wait_ready(), model, small, unloaded, ns.burst))
            finally:
                server.stop()
            print(f"{mode}: {figures[mode]}", flush=True)
    print(f"{'':32}" + "".join(f"{m:>14}" for m in figures))
    for k in next(iter(figures.values()), {}):
        print(f"{k:32}" + "".join(f"{str(figures[m][k]):>14}" for m in figures))
    result = {f"{k}_{m.replace('-', '_')}": v for m, f in figures.items() for k, v in f.items()}
    result.update({f"small_request_p50_{m.replace('-', '_')}_over_proxy": round(
        figures[m]["small_request_p50_ms"] / figures["proxy"]["small_request_p50_ms"], 3)
        for m in figures if m != "proxy" and "proxy" in figures})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
