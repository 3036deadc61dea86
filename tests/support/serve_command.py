"""`mmserve serve` as a user starts it: a subprocess with a Ray of its own (the caller's Ray address,
auth and ingress settings left out of its environment), its output in a log file, in a session of
its own; a small Serve config for `--config`; what the processes it started listen on."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
READY = "mmserve ready"


def launch(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`mmserve serve ARGS` from this checkout, `env` added to a clean copy of this environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_SERVE_ENABLE"))}
    clean.update({"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **env})
    return subprocess.Popen([sys.executable, "-m", "deployments.cli.main", "serve", *args], cwd=ROOT, env=clean,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def serve_config(model: str, http_port: int, grpc_port: int, **args) -> dict:
    """deployments/serve_config.yaml on loopback at these ports, its application on `model` in float64
    with one small replica per deployment; `args` go to the application's args."""
    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["grpc_options"]["port"] = grpc_port
    config["applications"][0]["args"].update({
        "model": model, "dtype": "float64", "router": {"num_replicas": 1, "num_cpus": 0.1},
        "encoder": {"num_replicas": 1, "num_cpus": 0.2}, "llm": {"num_replicas": 1, "num_cpus": 0.2}, **args})
    return config


def wait_ready_or_exit(proc: subprocess.Popen, log: Path, timeout_s: float) -> int | None:
    """The command's exit status if it exits, None once it says it is ready; AssertionError (with its
    output) if neither happens within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while READY not in log.read_text():
        if proc.poll() is not None:
            return proc.returncode
        assert time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.5)
    return None


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the command's session (Serve runs HAProxy in a process group of its own)."""
    from bench.ingress import kill_session

    kill_session(proc.pid)
    proc.wait()


def tree(pid: int) -> list[psutil.Process]:
    """The command's process and every process of its embedded Ray cluster."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


class Listener(NamedTuple):
    process: str  # its name, e.g. "ray::ServeReplica:mmserve:Router", "raylet", "haproxy"
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.removeprefix("::ffff:").split("%")[0]).is_loopback

    def __str__(self) -> str:
        return f"{self.process} on {self.ip}:{self.port}"


def listeners(pid: int) -> list[Listener]:
    """Every listening TCP socket of the command's process tree."""
    found = []
    for process in tree(pid):
        try:
            found += [Listener(process.name(), c.laddr.ip, c.laddr.port) for c in process.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return sorted(set(found), key=lambda s: (s.port, s.ip, s.process))
