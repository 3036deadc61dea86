"""The CLI path as a new user takes it (`scripts/gpu-check cli` on a GPU host; any host):

1. `python3 -m deployments.cli.main serve --model DIR --dtype DTYPE`, no other flag (the API key in
   MMSERVE_API_KEY, as docs/security.md says to give it), ready within `--deadline-s`;
2. the README's curl, its block as written (the key's header added): the first answer's latency;
3. `chat` with an image over HTTP, and over gRPC;
4. the gRPC services listed by reflection alone (no .proto at hand, no key);
5. the Ray dashboard's Serve API (Ray's token) lists the app with its deployments, the Encoder and
   LLM replicas on GPU shares where this host has GPUs;
6. SIGTERM drains and exits 0, and no process of the command is left.

    python bench/cli.py [--model DIR] [--dtype bfloat16] [--deadline-s 600] [--free-ports]

`--free-ports` (tests on a shared host) adds `--http-port` / `--grpc-port` on free ports. Last line:
one JSON object: `readme_ready_s`, `readme_first_answer_ms`, `readme_passed` (every check passed),
`checks` (each check: true, or why it failed); bench/gpu_report.py --from-log puts them in the record.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = "mmserve ready"
PROMPT = "What is in this image?"
README_CURL = re.compile(r"```bash\n(IMG=.*?curl -s localhost:8000.*?)```", re.S)


class Failed(Exception):
    """A check that did not pass; the message says why."""


def readme_curl(port: int) -> str:
    """The README's curl block, as written, on `port`."""
    if (found := README_CURL.search((ROOT / "README.md").read_text())) is None:
        raise Failed("README.md has no curl block for localhost:8000")
    return found.group(1).replace("localhost:8000", f"localhost:{port}")


def run_readme_curl(port: int, key: str) -> float:
    """Runs the README's curl with the key's header (a `curl` function in front of the command);
    the seconds it took. Failed unless it answered a completion."""
    wrapper = 'curl() { command curl -H "Authorization: Bearer $MMSERVE_API_KEY" "$@"; }\n'
    began = time.perf_counter()
    done = subprocess.run(["bash", "-c", wrapper + readme_curl(port)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MMSERVE_API_KEY": key})
    seconds = time.perf_counter() - began
    try:
        answer = json.loads(done.stdout)
        text = answer["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise Failed(f"no completion: {done.stdout[-300:] or done.stderr[-300:]}") from None
    if not isinstance(text, str) or answer["usage"]["completion_tokens"] < 1:
        raise Failed(f"an empty completion: {done.stdout[-300:]}")
    return seconds


def chat(image: Path, key: str, *where: str) -> None:
    """`mmserve chat` with the image (`where`: --url URL or --grpc HOST:PORT); Failed unless it streamed text."""
    done = subprocess.run([sys.executable, "-m", "deployments.cli.main", "chat", PROMPT, "--image", str(image),
                           f"--api-key={key}", "--max-tokens", "8", *where], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 or not done.stdout.strip():
        raise Failed(f"exit {done.returncode}: {(done.stderr or done.stdout)[-300:]}")


def reflection_services(target: str) -> set[str]:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [answer] = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    return {s.name for s in answer.list_services_response.service}


def dashboard_serve_app(url: str, gpus: bool) -> dict:
    """The app as the dashboard's Serve API lists it (Ray's token); Failed unless its deployments are
    there (and the Encoder and LLM on GPU shares when `gpus`). Returns {deployment: num_gpus}."""
    import httpx

    from deployments.cli.local_serve import token_location

    token = os.environ.get("RAY_AUTH_TOKEN") or Path(token_location()).read_text().strip()
    reply = httpx.get(f"{url}/api/serve/applications/", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    if reply.status_code != 200:
        raise Failed(f"{url}/api/serve/applications/ answered {reply.status_code}")
    app = reply.json().get("applications", {}).get("mmserve")
    if app is None or app.get("status") != "RUNNING":
        raise Failed(f"application mmserve not RUNNING there: {app and app.get('status')}")
    deployments = {name: d.get("deployment_config", {}).get("ray_actor_options", {}).get("num_gpus", 0)
                   for name, d in app.get("deployments", {}).items()}
    if not {"Router", "Encoder", "LLM"} <= set(deployments):
        raise Failed(f"deployments listed: {sorted(deployments)}")
    if gpus and not (deployments["Encoder"] > 0 and deployments["LLM"] > 0):
        raise Failed(f"the Encoder and LLM are not on GPU shares: {deployments}")
    return deployments


def session_processes(session: int) -> list:
    """The processes of the command's session (it and all it started, Ray's workers included)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "name"]):
        with suppress(ProcessLookupError, PermissionError):
            if os.getsid(process.pid) == session:
                found.append(process)
    return found


def red_png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 30, 30)).save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--deadline-s", type=float, default=600.0, help="from the command to 'mmserve ready'")
    p.add_argument("--free-ports", action="store_true", help="HTTP and gRPC on free ports (not 8000 / 9000)")
    p.add_argument("--log", type=Path, default=None, help="the command's output (default: a temporary file)")
    ns = p.parse_args(argv)

    from deployments.cli.gpu_shares import visible_gpu_memory
    from deployments.cli.ingress_modes import free_loopback_port

    work = Path(tempfile.mkdtemp(prefix="mmserve-cli-"))
    log = ns.log or work / "serve.log"
    key = secrets.token_urlsafe(24)
    http_port, grpc_port = (free_loopback_port(), free_loopback_port()) if ns.free_ports else (8000, 9000)
    argv_serve = ["serve", *(["--model", ns.model] if ns.model else []), "--dtype", ns.dtype,
                  *(["--http-port", str(http_port), "--grpc-port", str(grpc_port)] if ns.free_ports else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_ENABLE"))}
    env.update(MMSERVE_API_KEY=key, RAY_USAGE_STATS_ENABLED="0")
    checks: dict[str, bool | str] = {}
    result = {"readme_ready_s": None, "readme_first_answer_ms": None, "gpu_shares": None}

    def check(name: str, fn):
        try:
            out = fn()
            checks[name] = True
            return out
        except Failed as e:
            checks[name] = str(e)
        except Exception as e:  # noqa: BLE001  a check that broke is a check that failed
            checks[name] = f"{type(e).__name__}: {e}"

    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.main", *argv_serve], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    print(f"python3 -m deployments.cli.main {' '.join(argv_serve)}  (output: {log})", file=sys.stderr, flush=True)

    def ready() -> float:
        while READY not in log.read_text():
            if proc.poll() is not None:
                raise Failed(f"exited {proc.returncode} before ready: {log.read_text()[-400:]}")
            if time.perf_counter() - began > ns.deadline_s:
                raise Failed(f"not ready within {ns.deadline_s:g} s: {log.read_text()[-400:]}")
            time.sleep(0.5)
        return time.perf_counter() - began

    try:
        if (ready_s := check("ready", ready)) is not None:
            result["readme_ready_s"] = round(ready_s, 1)
            first = check("readme_curl", lambda: run_readme_curl(http_port, key))
            result["readme_first_answer_ms"] = None if first is None else round(first * 1000)
            image = red_png(work / "red.png")
            check("chat_http", lambda: chat(image, key, "--url", f"http://127.0.0.1:{http_port}"))
            check("chat_grpc", lambda: chat(image, key, "--grpc", f"127.0.0.1:{grpc_port}"))

            def reflection() -> None:
                if not {"mmserve.v1.VLMService", "grpc.health.v1.Health"} <= (found := reflection_services(
                        f"127.0.0.1:{grpc_port}")):
                    raise Failed(f"reflection lists {sorted(found)}")

            check("grpc_reflection", reflection)

            def dashboard() -> dict:
                if not (urls := re.findall(r"Ray dashboard: (http://\S+) ", log.read_text())):
                    raise Failed("no 'Ray dashboard:' line")
                return dashboard_serve_app(urls[0], gpus=bool(visible_gpu_memory()))

            result["gpu_shares"] = check("dashboard_serve_api", dashboard)
    finally:
        def drained() -> None:
            if proc.poll() is not None:
                raise Failed(f"it had exited ({proc.returncode})")
            os.kill(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=180)
            output = log.read_text()
            if code != 0 or "shutting down" not in output or re.search(r"^Traceback", output, re.M):
                raise Failed(f"exit {code}: {output[-400:]}")
            deadline = time.monotonic() + 30
            while left := session_processes(proc.pid):
                if time.monotonic() > deadline:
                    raise Failed("left behind: " + ", ".join(f"{p.pid} {p.info['name']}" for p in left[:5]))
                time.sleep(0.5)

        check("sigterm_drains_and_leaves_nothing", drained)
        for process in session_processes(proc.pid):  # what a failed check left running
            process.kill()
        if proc.poll() is None:
            proc.wait()
    result["readme_passed"] = all(v is True for v in checks.values())
    result["checks"] = checks
    for name, outcome in checks.items():
        print(f"{name:>34}: {'ok' if outcome is True else outcome}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["readme_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
