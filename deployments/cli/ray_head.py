"""The one start of a Ray node for every entry point: `mmserve serve` (flags and `--config`), the
benches' app (`bench_app`: benches, `mmserve plan --validate`, routing runs), `bench/transfer.py` and
the Serve tests' session.

The node's head runs in a process of its own, a child of the caller, which then connects to it as a
driver (`ray.init(address=...)`). On GPU hosts the caller's own `ray.init` timed out starting the
node five times of five ("The current node timed out during startup") while a head started by a thin
process came up (docs/gpu.md). The child is this file run as a script: it imports Ray and nothing of
mmserve, calls `ray.init` with what the caller asked for, writes where the node is, and sleeps until
SIGTERM (Ray's handler then stops every process of the node).

What the caller's own `ray.init` gave, the head still gets: the caller's environment (set before
the start: Ray's single-machine mode for loopback-only binding, Serve's ingress settings, the gRPC
message cap, the API key's variable, `RAY_AUTH_MODE`), Ray's token authentication (a new cluster's
default), custom resources, the dashboard on its host. Its processes stay in the caller's process
tree and process group (what `mmserve serve`'s listener checks and Ctrl-C see); SIGINT is blocked in
it as in Ray's own processes, so Ctrl-C reaches the caller alone, which drains and then stops it.

Stopping stops this head's processes only, by process id: never `ray stop`, which stops every Ray
on the machine. Each head keeps its logs in a directory of its own (`RayHead.logs`); a failed start
raises `RayStartFailed` with the lines of those logs that name the cause, and what to try.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HEAD_START_TIMEOUT_S = 180.0  # Ray's own waits (30 s for the raylet to register, 60 s for the node) and then some
HEAD_STOP_TIMEOUT_S = 30.0
RESULT_FILE = "head.json"  # where the child says where the node is (or why it failed)
HEAD_MARK_ENV = "MMSERVE_RAY_HEAD"  # in the environment of every process of a head: its directory
CAUSE_LINES_PER_FILE = 6
# lines of Ray's logs that name a cause: C++ logs at Error / Critical / Fatal level ("[date time,ms E pid tid]"),
# Python ones at ERROR and above, failed checks, timeouts, tracebacks
_CAUSE = re.compile(r"^\[[\d-]+ [\d:,]+ [ECF] \d+ \d+\]|\b(ERROR|CRITICAL|FATAL)\b|Check failed|[Tt]imed out|"
                    r"^Traceback|^\w+(Error|Exception): ")


class RayStartFailed(Exception):
    """The Ray head did not start; the message holds the cause lines from Ray's logs and what to try."""


@dataclass(frozen=True)
class HeadSpec:
    """What the head starts with: `ray.init`'s arguments (`num_gpus` None: Ray counts them)."""

    num_cpus: float
    num_gpus: float | None = None
    resources: dict[str, float] = field(default_factory=dict)
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"

    def init_kwargs(self, temp_dir: str) -> dict:
        gpus = {} if self.num_gpus is None else {"num_gpus": self.num_gpus}
        return {"num_cpus": self.num_cpus, "resources": dict(self.resources), "_temp_dir": temp_dir, **gpus,
                # None: Ray's default, the dashboard started and its failure only logged (we say it)
                "include_dashboard": None if self.dashboard else False, "dashboard_host": self.dashboard_host}


def cause_lines(logs: Path, only: str = "") -> list[str]:
    """The last lines of each of Ray's log files under `logs` (names starting with `only`) that name a
    cause, each prefixed with its file's name."""
    found = []
    files = sorted((p for p in logs.glob(f"{only}*") if p.is_file()), key=lambda p: p.stat().st_mtime) \
        if logs.is_dir() else []
    for path in files:
        lines = [line.rstrip() for line in path.read_text(errors="replace").splitlines() if _CAUSE.search(line)]
        found += [f"{path.name}: {line}" for line in lines[-CAUSE_LINES_PER_FILE:]]
    return found


def advice(lines: list[str], logs: Path, dashboard: bool) -> str:
    """What to try after a failed start, the likeliest first."""
    tries = []
    if any("Timed out waiting for file" in line for line in lines):  # the raylet's, for an agent's port file
        tries.append("Ray's agents were slow to start: the raylet waits a fixed 15 s for their port files, then "
                     "exits (ray#65983)")
    if dashboard:
        tries.append("--no-dashboard: the dashboard starts about ten processes that each import Ray (ray#65159)")
    tries += ["on a GPU host, persistence mode (`nvidia-smi -pm 1`): without it the agent's GPU probe can stall "
              "15-30 s (ray#63243)",
              "if Ray was installed with --no-compile, compile it once (`python3 -m compileall -q "
              "$(python3 -c 'import ray, os; print(os.path.dirname(ray.__file__))')`): every Ray process "
              "compiles it again otherwise",
              f"Ray's logs: {logs}"]
    return "what to try:\n" + "\n".join(f"- {t}" for t in tries)


class RayHead:
    """A Ray head in a child process (`start`), this process its driver; `stop` ends both."""

    def __init__(self, spec: HeadSpec):
        self.spec = spec
        self.dir = Path(tempfile.mkdtemp(prefix="mmserve-ray-"))
        self.proc: subprocess.Popen | None = None
        self.gcs_address: str | None = None
        self.dashboard_url: str | None = None

    @property
    def logs(self) -> Path:
        return self.dir / "session_latest" / "logs"

    def start(self, stopped=lambda: False, log_to_driver: bool = False, logging_level: str = "ERROR",
              timeout_s: float = HEAD_START_TIMEOUT_S) -> bool:
        """Starts the head and connects this process to it; False when `stopped()` turned true first
        (the head is then stopped). RayStartFailed (the head stopped) when it did not start."""
        import atexit

        from ray._private.authentication.authentication_token_setup import enable_token_auth_by_default

        from deployments.cli.ingress_modes import die_with_parent

        # what `ray.init` does for a new local cluster (RAY_AUTH_MODE unset: token, in this process's
        # environment, which the head inherits; the head creates the token if there is none)
        enable_token_auth_by_default()

        def child_setup() -> None:  # as Ray starts its own processes: Ctrl-C is the caller's
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            die_with_parent()

        result = self.dir / RESULT_FILE
        with open(self.dir / "head.out", "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, json.dumps(self.spec.init_kwargs(str(self.dir))), str(result)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=child_setup,
                env={**os.environ, HEAD_MARK_ENV: str(self.dir)})
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while not result.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            if stopped():
                self.stop()
                return False
            time.sleep(0.1)
        said = json.loads(result.read_text()) if result.exists() else {}
        if "gcs_address" not in said:
            why = said.get("error") or (f"it exited ({self.proc.returncode})" if self.proc.poll() is not None
                                        else f"not started within {timeout_s:g} s")
            raise RayStartFailed(self.failure(why))
        self.gcs_address, self.dashboard_url = said["gcs_address"], said["dashboard_url"]
        import ray

        try:
            ray.init(address=self.gcs_address, log_to_driver=log_to_driver, logging_level=logging_level)
        except SystemExit:  # SIGTERM while connecting: the handler ray.init sets exits
            self.stop()
            raise
        except Exception as e:  # noqa: BLE001  reported with Ray's logs
            raise RayStartFailed(self.failure(f"connecting to it failed: {e}")) from None
        return True

    def failure(self, why: str) -> str:
        """What a failed start says, read from Ray's logs before the head is stopped (which it then is)."""
        lines = cause_lines(self.logs)
        head_out = (self.dir / "head.out").read_text(errors="replace").strip().splitlines()[-3:]
        self.stop()
        shown = "\n".join(f"  {line}" for line in lines) or "  (none: see the logs below)"
        return (f"the Ray head did not start: {why}\n{self.dir / 'head.out'}: {' / '.join(head_out) or '(empty)'}\n"
                f"what Ray's logs say ({self.logs}):\n{shown}\n{advice(lines, self.logs, self.spec.dashboard)}")

    def dashboard_failure(self) -> str | None:
        """Why the dashboard asked for is not up (its log lines), or None."""
        if not self.spec.dashboard or self.dashboard_url:
            return None
        lines = cause_lines(self.logs, only="dashboard") or [f"(none: see {self.logs})"]
        return "the Ray dashboard did not start:\n" + "\n".join(f"  {line}" for line in lines)

    def processes(self) -> list:
        """The head's processes now: its process, its descendants, and any process its environment marks as
        this head's (one whose parent died, as an agent the raylet left behind when it gave up on it)."""
        import ray  # noqa: F401  (psutil: the copy Ray brings, importable once Ray is)
        import psutil

        found = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            found = {p.pid: p for p in (root, *root.children(recursive=True))}
        for process in psutil.process_iter():
            try:
                if process.pid not in found and process.environ().get(HEAD_MARK_ENV) == str(self.dir):
                    found[process.pid] = process
            except psutil.Error:  # gone, or another user's
                continue
        return list(found.values())

    def stop(self, timeout_s: float = HEAD_STOP_TIMEOUT_S) -> None:
        """Disconnects this process and ends the head's processes, by id (idempotent)."""
        import atexit

        import psutil
        import ray

        atexit.unregister(self.stop)
        if self.proc is None:
            return
        if ray.is_initialized():
            ray.shutdown()
        node = self.processes()
        if self.proc.poll() is None:
            self.proc.terminate()  # the child's Ray handler stops the node's processes, then it exits
        _, left = psutil.wait_procs(node, timeout=timeout_s)
        for process in left:  # what outlived it (a worker its raylet left behind)
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(left, timeout=5)
        self.proc.wait()
        self.proc = None


def start_head(spec: HeadSpec, stopped=lambda: False, log_to_driver: bool = False, logging_level: str = "ERROR",
               say=lambda line: print(line, file=sys.stderr, flush=True)) -> RayHead | None:
    """A started `RayHead` (None: `stopped()` turned true first). When the start with the dashboard
    fails, says why and starts once more without it; when the node starts but the dashboard does
    not, says why: either way the node serves without the dashboard (`dashboard_url` None)."""
    head = RayHead(spec)
    try:
        if not head.start(stopped, log_to_driver, logging_level):
            return None
    except RayStartFailed as e:
        if not spec.dashboard:
            raise
        say(f"warning: {e}\nstarting Ray again without the dashboard")
        head = RayHead(replace(spec, dashboard=False))
        if not head.start(stopped, log_to_driver, logging_level):
            return None
        say("warning: serving without the Ray dashboard (it did not start, above)")
        return head
    if (failed := head.dashboard_failure()) is not None:
        say(f"warning: {failed}\nserving without it")
    return head


def _run_head(init_kwargs: str, result: str) -> None:
    """The child: `ray.init` with `init_kwargs`, then where the node is (or why it failed) in `result`;
    then sleep until SIGTERM (Ray's driver handler exits, and its exit hook stops the node)."""
    import ray

    def say(what: dict) -> None:
        tmp = Path(result + ".tmp")
        tmp.write_text(json.dumps(what))
        tmp.replace(result)

    try:
        context = ray.init(**json.loads(init_kwargs), log_to_driver=False, logging_level="WARNING")
    except Exception as e:  # noqa: BLE001  the caller reports it with Ray's logs
        say({"error": f"{type(e).__name__}: {e}".strip()})
        sys.exit(1)
    say({"gcs_address": context.address_info["gcs_address"], "dashboard_url": context.dashboard_url or None})
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _run_head(*sys.argv[1:])
