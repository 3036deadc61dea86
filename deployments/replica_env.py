"""What a replica resolves on the node it runs on: the model directory, secrets, CPU threads.

Serve builds the application (calls `build_app`) in a task that may run on any node — on
KubeRay usually the head, which has no GPU and no model volume — so the builder passes the
model and secrets as the user wrote them, and each replica resolves them here, in its
constructor. A failure names the path or variable and the node, and fails that replica.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from pathlib import Path

logger = logging.getLogger("ray.serve")


def model_name(model: str | None) -> str:
    """The served model name for `model`, computed without touching the filesystem."""
    if model is None:
        from mmserve.tiny import default_model_dir

        return default_model_dir().name
    return Path(os.path.normpath(os.path.abspath(os.path.expanduser(model)))).name


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint directory on this node: `model`, or the embedded tiny model.

    The tiny model is built once per node into `$MMSERVE_CACHE` (default `~/.cache/mmserve`):
    replicas starting together on one node take a file lock, the first builds, the rest wait
    and reuse it.
    """
    if model is None:
        return str(_ensure_tiny_model_locked())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a Hugging Face checkpoint directory (no config.json) on node "
            f"{socket.gethostname()}: mount the model volume on every node that runs mmserve replicas"
        )
    return str(path.resolve())


def _ensure_tiny_model_locked() -> Path:
    from mmserve.tiny import default_model_dir, ensure_tiny_model

    out = default_model_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        return ensure_tiny_model(out_dir=out)


def secret(value: str | None, env_name: str | None, field: str) -> str | None:
    """`value`, or the value of environment variable `env_name` on this node (`field` names the
    argument in errors); the variable must be set and non-empty."""
    if env_name is None:
        return value
    resolved = os.environ.get(env_name)
    if not resolved:
        raise RuntimeError(
            f"{field}: environment variable {env_name} is not set on node {socket.gethostname()} "
            "(on Kubernetes: fill it from a Secret with env[].valueFrom.secretKeyRef)"
        )
    return resolved


def node_cores() -> int:
    """The cores this process may use: its CPU affinity (a cpuset), within its cgroup's CPU quota
    (a Kubernetes CPU limit), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "Q P"
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    return cores


def decode_threads(configured: int | None, replicas: int, workers: int) -> int:
    """FFmpeg threads for one video on a VideoDecoder replica: `configured`, else this node's cores
    divided among the deployment's `replicas` and each one's `workers` (at least 1): a worker's
    share of the node, which it uses only while it decodes."""
    threads = configured or max(1, node_cores() // max(replicas * workers, 1))
    logger.info("VideoDecoder replica: %d FFmpeg threads per video (%s)", threads, "decode_threads" if configured
                else f"{node_cores()} cores / {replicas} replicas / {workers} workers")
    return threads


def decode_segments(configured: int | None, replicas: int, threads: int) -> int:
    """Segments of one video decoded at once on a VideoDecoder replica (`video_decode.segment_workers`):
    `configured`, else this node's cores divided among the deployment's `replicas` (at least the
    video's `threads`): a lone video uses the replica's cores, and the workers' videos at once share
    them (on 2 cores two videos at once took no longer than with one segment each)."""
    segments = configured or max(threads, node_cores() // max(replicas, 1))
    logger.info("VideoDecoder replica: up to %d segments of a video at once (%s)", segments, "segment_workers"
                if configured else f"{node_cores()} cores / {replicas} replicas")
    return segments


def set_cpu_threads(configured: int | None, replicas: int, role: str, ranks: int = 1) -> int:
    """torch's intra-op threads for a replica that runs a model: `configured`, else this node's
    cores divided among the deployment's `replicas` (at least 1), and among each one's `ranks`
    (a tensor-parallel LLM replica's processes, which compute at once; each rank takes as many).
    Why every deployment gets all the cores: docs/operations.md, "CPU threads"."""
    import torch

    threads = configured or max(1, node_cores() // max(replicas * ranks, 1))
    torch.set_num_threads(threads)
    per_rank = f" / {ranks} ranks each" if ranks > 1 else ""
    logger.info("%s replica: %d torch threads%s (%s)", role, threads, " per rank" if ranks > 1 else "",
                "cpu_threads" if configured else f"{node_cores()} cores / {replicas} {role} replicas{per_rank}")
    return threads
