"""The production overlay's topology on a Ray cluster of several nodes on this machine.

`ray start --head --num-cpus=0` (the KubeRay head) plus one worker node per group of the GPU
overlay (routers, encoder, llm) started with that group's Ray labels and custom resource. Every
`ray start` has its own `MMSERVE_CACHE` and the head's stays empty, so a model resolved by the
builder, or by a replica on the wrong node, is not found where it is used. The GPU overlay's
serve config is deployed through the Serve controller (as `serve deploy` / KubeRay do), with CPU
sizes and the tiny model. Only the router node has the API key in its environment.

Serve's proxies run on the head only here: the nodes share one host, so their ports would clash.
Cleanup kills only the processes this test started (their process groups), never `ray stop`.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.k8s.test_k8s_render import groups, rayservice
from tests.support.serve_fixtures import _free_port

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "multinode-key"
DEPLOY_TIMEOUT_S = 240
GROUP_OF = {"Router": "routers", "Encoder": "encoder", "LLM": "llm", "VideoDecoder": "video"}


def cpu_sized(serve_config: dict, http_port: int) -> dict:
    """The GPU overlay's serve config with CPU sizes, the tiny model and one proxy (on the head)."""
    (app,) = serve_config["applications"]
    args = app["args"]
    args.update(model=None, dtype="float32", device="cpu")
    for name in ("router", "encoder", "llm", "video_decoder"):
        args[name] = {**args[name], "num_cpus": 0.25, "num_gpus": 0}
    args["video_decode"] = {**args["video_decode"], "min_replicas": 1, "max_replicas": 1}
    args["router"]["num_replicas"] = 1
    args["encoder_pool"] = {**args["encoder_pool"], "min_replicas": 1, "max_replicas": 1}
    scaling = args["llm"]["autoscaling"]
    args["llm"]["autoscaling"] = {**scaling, "max_replicas": scaling["min_replicas"]}
    args["engine"] = {**args.get("engine", {}), "kv_cache_memory_mb": 16, "cuda_graphs": False}
    serve_config.pop("grpc_options", None)
    return {**serve_config, "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port}}


def replicas_per_group(args: dict) -> dict[str, int]:
    return {
        "routers": args["router"]["num_replicas"],
        "encoder": args["encoder_pool"]["max_replicas"],
        "llm": args["llm"]["autoscaling"]["max_replicas"],
        "video": args["video_decode"]["max_replicas"],
    }


class LocalCluster:
    """Ray nodes on this machine, each a `ray start --block` in its own process group."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="mmk8s", dir="/tmp"))  # short: Unix socket paths
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        # Ray 2.60 turns token auth on when a token exists (~/.ray/auth_token): this cluster's own
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}

    def cache(self, node: str) -> Path:
        return self.root / f"cache-{node}"

    def start(self, node: str, *args: str, env: dict[str, str] | None = None) -> None:
        environ = {k: v for k, v in os.environ.items() if k != "MMSERVE_API_KEY"}  # only where `env` says
        environ.update(PYTHONPATH=str(ROOT), MMSERVE_CACHE=str(self.cache(node)), RAY_USAGE_STATS_ENABLED="0")
        environ.update(self.auth_env)
        environ.update(env or {})
        command = [
            # a temp dir per node: nodes of one session in one dir would share socket paths
            str(Path(sys.executable).parent / "ray"), "start", "--block", f"--temp-dir={self.root / node}",
            f"--dashboard-agent-listen-port={_free_port()}", "--min-worker-port=0", "--max-worker-port=0", *args,
        ]
        log = open(self.root / f"{node}.log", "w")
        self.nodes[node] = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_head(self) -> None:
        self.start(
            "head", "--head", "--num-cpus=0", f"--port={self.port}", "--include-dashboard=false",
            f"--ray-client-server-port={_free_port()}",
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # workers join once the GCS listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.nodes["head"].poll() is None, self.logs()
            time.sleep(0.5)
        raise TimeoutError("the head's GCS did not come up in 60 s\n" + self.logs())

    def start_worker(self, node: str, labels: dict[str, str], resources: dict[str, float], env=None) -> None:
        self.start(
            node, f"--address={self.address}", "--num-cpus=1",
            "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()),
            "--resources=" + json.dumps(resources), env=env,
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for process in self.nodes.values():
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for process in self.nodes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # raylet, GCS, workers: all in the node's group
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _driver(address: str, config: dict, timeout_s: float) -> dict:
    """Runs in a subprocess (the test process may hold a Ray of its own): deploy through the
    controller, wait for RUNNING, and return where each replica runs."""
    import ray
    from ray import serve
    from ray._private import state
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + 60
    while sum(n["Alive"] for n in ray.nodes()) < 5:  # the head + one node per group
        if time.monotonic() > deadline:
            return {"error": f"nodes did not join: {[(n['Alive'], n['Labels']) for n in ray.nodes()]}"}
        time.sleep(0.5)
    serve.start(proxy_location=config["proxy_location"], http_options=config["http_options"])
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get("mmserve")
        if app is not None and app.status == "RUNNING":
            break
        if app is not None and app.status == "DEPLOY_FAILED" or time.monotonic() > deadline:
            return {"error": f"app {app.status if app else 'missing'}: {app.message if app else ''}",
                    "deployments": {n: d.message for n, d in (app.deployments.items() if app else [])}}
        time.sleep(1)
    nodes = {n["NodeID"]: n["Labels"].get("mmserve.io/group", "head") for n in ray.nodes() if n["Alive"]}
    replicas = [
        (a["ActorClassName"].rsplit(":", 1)[-1], nodes.get(a["Address"]["NodeID"], "?"))
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith("ServeReplica:mmserve:")
    ]
    return {"replicas": replicas, "node_groups": sorted(nodes.values())}


def _image_data_uri() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 84), (200, 30, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.timeout(DEPLOY_TIMEOUT_S + 120)
def test_production_overlay_places_each_deployment_on_its_group():
    import yaml

    started = time.monotonic()
    http_port = _free_port()
    config = cpu_sized(yaml.safe_load(rayservice("gpu")["spec"]["serveConfigV2"]), http_port)
    args = config["applications"][0]["args"]
    assert args["api_key_env"] == "MMSERVE_API_KEY"
    counts = replicas_per_group(args)
    cluster = LocalCluster()
    on_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM"))  # `timeout` still cleans up
    try:
        cluster.start_head()
        for group in groups("gpu")[1:]:
            name = group["groupName"]
            (resource,) = group["resources"]
            deployment = {"routers": "router", "encoder": "encoder", "llm": "llm", "video": "video_decoder"}[name]
            per_replica = args[deployment]["resources"][resource]
            env = {"MMSERVE_API_KEY": API_KEY} if name == "routers" else None
            cluster.start_worker(name, group["labels"], {resource: per_replica * counts[name]}, env=env)
        driver = subprocess.run(
            [sys.executable, "-m", "tests.k8s.test_k8s_multinode", cluster.address, json.dumps(config), str(DEPLOY_TIMEOUT_S)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **cluster.auth_env}, capture_output=True, text=True,
            timeout=DEPLOY_TIMEOUT_S + 60,
        )
        assert driver.returncode == 0, driver.stderr[-3000:] + cluster.logs()
        result = json.loads(driver.stdout.strip().splitlines()[-1])
        assert "error" not in result, json.dumps(result, indent=1) + cluster.logs()
        assert result["node_groups"] == sorted(["head", "router", "encoder", "llm", "video"])
        placed = sorted(map(tuple, result["replicas"]))
        expected = sorted(
            [("Router", "router")] * counts["routers"] + [("Encoder", "encoder")] * counts["encoder"]
            + [("LLM", "llm")] * counts["llm"] + [("VideoDecoder", "video")] * counts["video"]
        )
        assert placed == expected

        body = {
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _image_data_uri()}},
                {"type": "text", "text": "What is in the image?"},
            ]}],
            "max_tokens": 4,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["prompt_tokens"] > 10 and answer["usage"]["completion_tokens"] >= 1

        # the builder built nothing; every worker node built the tiny model for its own replicas, once
        assert not cluster.cache("head").exists()
        for node in ("routers", "encoder", "llm"):
            built = sorted(p.name for p in cluster.cache(node).iterdir() if p.is_dir())
            assert built == ["tiny-qwen2_vl-seed0"], (node, built)
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, on_sigterm)
        print(f"multi-node test: {time.monotonic() - started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    print(json.dumps(_driver(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]))))
