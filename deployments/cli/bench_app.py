"""The app under test, started in this process (Ray + Serve on loopback ports): what the serving
benches (bench/) and `mmserve plan --validate` (deployments/cli/plan_runs.py) run against."""

from __future__ import annotations

import sys

from deployments.cli.ingress_modes import free_loopback_port


def start_serve(num_cpus: float, grpc: bool = False, apart: bool = False) -> tuple[int, int | None]:
    """A quiet Ray (no dashboard) and Serve on free loopback ports: (HTTP port, gRPC port or None);
    apps are then `serve.run` on it. `apart`: the node started by `ray start --head` at once (on GPU
    hosts, where the in-process start has timed out every time). Stop with `stop_app`."""
    import ray
    from ray import serve

    from deployments.serve.router import grpc_options

    if not apart:
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        except Exception as e:  # noqa: BLE001  the node did not start: its logs, then one start from a thin process
            print_ray_logs()
            print(f"ray.init failed ({e})", file=sys.stderr)
            apart = True
    if apart:
        start_head_apart(num_cpus)
        ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    port, grpc_port = free_loopback_port(), free_loopback_port() if grpc else None
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options=grpc_options(port=grpc_port) if grpc else None)
    return port, grpc_port


_HEAD_APART = False  # the node was started by `ray start` (stopped by `ray stop`)


def start_head_apart(num_cpus: float) -> None:
    """Starts the node with `ray start --head` in a process of its own. On H200 hosts, bench/serve.py's
    in-process start timed out five times of five in two sessions (the raylet did not register within
    Ray's fixed 30 s) while `ray start --head` then started it in 6 s (2026-11-26)."""
    import ray

    global _HEAD_APART
    ray.shutdown()  # what the failed start left in this process
    _ray_cli("start", "--head", f"--num-cpus={num_cpus:g}", f"--port={free_loopback_port()}",
             "--include-dashboard=false", "--disable-usage-stats", check=True, timeout=180)
    _HEAD_APART = True


def _ray_cli(*args: str, **run_kwargs) -> None:
    """The `ray` command line from this interpreter, its output on stderr (a bench's stdout ends
    with its JSON line)."""
    import subprocess

    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], stdout=sys.stderr, stderr=sys.stderr,
                   **run_kwargs)


def print_ray_logs(lines: int = 15) -> None:
    """The last lines of the Ray session's own logs (raylet, GCS, agents) on stderr: why a node
    that timed out starting did (seen on a GPU host from bench/serve.py only, 2026-11-26)."""
    from pathlib import Path

    logs = Path("/tmp/ray/session_latest/logs")
    for path in sorted(logs.glob("*")) if logs.is_dir() else []:
        if path.is_file() and path.suffix in (".err", ".out", ".log") and not path.name.startswith("python-core"):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                print(f"--- {path}", *tail, sep="\n", file=sys.stderr)


def start_app(model: str, colocated: bool, num_cpus: float, dtype: str, device: str = "cpu",
              gpus: float = 0.0, replicas: tuple[int, int] | None = None, routing: str = "affinity",
              cpu_threads: int | None = None) -> tuple[str, str]:
    """Starts Ray + Serve + the app (named and served as "bench") in this process; returns its base
    URL and gRPC target (stop with `stop_app`). `replicas`: (encoder, LLM) replicas sharing their
    half of the CPUs (default: one each; colocated: two LLM replicas); `routing`: the app's routing
    policy; `cpu_threads`: the model replicas' torch threads (default: the app's policy)."""
    from ray import serve

    from deployments.config import AppArgs
    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready

    half = num_cpus / 2
    port, grpc_port = start_serve(num_cpus, grpc=True, apart=device != "cpu")
    big = {"max_ongoing_requests": 256, "max_queued_requests": -1}
    encoders, llms = replicas or (1, 2 if colocated else 1)
    args = AppArgs(
        model=model, served_model_name="bench", dtype=dtype, device=device, colocated=colocated, router={"num_cpus": 0, **big},
        encoder={"num_cpus": half / encoders, "num_gpus": gpus, "num_replicas": encoders, "cpu_threads": cpu_threads,
                 **big},
        llm={"num_cpus": half / (llms if replicas else 1), "num_gpus": gpus, "num_replicas": llms,
             "cpu_threads": cpu_threads, **big},
        routing={"policy": routing}, video_decoder={"num_cpus": 0},  # no videos in this workload
    )
    serve.run(build_app(args), name="bench", route_prefix="/")
    wait_until_ready("bench")
    return f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


def stop_app() -> None:
    import ray
    from ray import serve

    global _HEAD_APART
    serve.shutdown()
    ray.shutdown()
    if _HEAD_APART:
        _ray_cli("stop", "--force", timeout=60)
        _HEAD_APART = False
