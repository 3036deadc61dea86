"""The app under test, started in this process (Ray + Serve on loopback ports): what the serving
benches (bench/) and `mmserve plan --validate` (deployments/cli/plan_runs.py) run against."""

from __future__ import annotations

from deployments.cli.ingress_modes import free_loopback_port


def start_serve(num_cpus: float, grpc: bool = False, apps: dict | None = None) -> tuple[int, int | None]:
    """A quiet Ray (no dashboard; its head started as every entry point starts it: `ray_head`) and
    Serve on free loopback ports: (HTTP port, gRPC port or None), with the mmserve `apps` ({name: args})
    running on it, each under /name (one alone: under /). Stop with `stop_app`. RayStartFailed (with the
    lines of Ray's logs that say why) when Ray did not start."""
    from ray import serve

    from deployments.cli.ray_head import HeadSpec, start_head
    from deployments.serve.app import build_app
    from deployments.serve.router import grpc_options

    global _HEAD
    _HEAD = start_head(HeadSpec(num_cpus=num_cpus))
    port, grpc_port = free_loopback_port(), free_loopback_port() if grpc else None
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options=grpc_options(port=grpc_port) if grpc else None)
    for name, args in (apps or {}).items():
        serve.run(build_app(args), name=name, route_prefix="/" if len(apps) == 1 else f"/{name}")
    return port, grpc_port


_HEAD = None  # the Ray head `start_serve` started (`stop_app` stops it)


def start_app(model: str, colocated: bool, num_cpus: float, dtype: str, device: str = "cpu",
              gpus: float = 0.0, replicas: tuple[int, int] | None = None, routing: str = "affinity",
              cpu_threads: int | None = None) -> tuple[str, str]:
    """Starts Ray + Serve + the app (named and served as "bench") in this process; returns its base
    URL and gRPC target (stop with `stop_app`). `replicas`: (encoder, LLM) replicas sharing their
    half of the CPUs (default: one each; colocated: two LLM replicas); `routing`: the app's routing
    policy; `cpu_threads`: the model replicas' torch threads (default: the app's policy)."""
    from deployments.config import AppArgs
    from deployments.serve.router import wait_until_ready

    half = num_cpus / 2
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
    port, grpc_port = start_serve(num_cpus, grpc=True, apps={"bench": args})
    wait_until_ready("bench")
    return f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


def stop_app() -> None:
    from ray import serve

    global _HEAD
    serve.shutdown()
    if _HEAD is not None:
        _HEAD.stop()
        _HEAD = None
