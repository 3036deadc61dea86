"""The one start of Ray (deployments/cli/ray_head.py) when it goes wrong, made to go wrong on CPU the
way it did on GPU hosts: a `sitecustomize` on the head's PYTHONPATH holds Ray's dashboard agent
before it writes its port files (the raylet gives up after 15 s, ray#65983, and Ray reports "The
current node timed out during startup"), or ends the dashboard at its start.

- `mmserve serve` then exits 1 with the lines of Ray's logs that name the cause and what to try,
  no stack trace, and leaves no process of that head behind;
- a dashboard that does not start is said, and the node serves without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from deployments.cli.ray_head import HEAD_MARK_ENV
from tests.support.serve_command import ROOT, launch
from tests.support.serve_fixtures import _free_port

pytestmark = pytest.mark.serve

HOLD_THE_AGENT = """import time
with open("/proc/self/cmdline", "rb") as f:
    if b"dashboard/agent.py" in f.read():
        time.sleep(600)  # never writes its port files
"""
END_THE_DASHBOARD = """import os
with open("/proc/self/cmdline", "rb") as f:
    if b"dashboard/dashboard.py" in f.read():
        os._exit(3)
"""


def _python_path(tmp_path: Path, sitecustomize: str) -> str:
    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    return f"{tmp_path}:{ROOT}"


def _processes_of(head_dir: str) -> list[psutil.Process]:
    """Processes of the head whose directory is `head_dir` (every process of a head carries it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(HEAD_MARK_ENV) == head_dir:
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_head_that_does_not_start_is_reported_with_the_log_lines_that_say_why(tmp_path):
    log = tmp_path / "serve.log"
    proc = launch(["--http-port", str(_free_port()), "--grpc-port", str(_free_port()), "--num-cpus", "1",
                   "--no-dashboard"], log, PYTHONPATH=_python_path(tmp_path, HOLD_THE_AGENT))
    try:
        assert proc.wait(timeout=400) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert "mmserve serve: the Ray head did not start: Exception: The current node timed out during startup" in output
    assert "raylet.err:" in output and "Timed out waiting for file" in output  # the cause, from Ray's logs
    assert "ray#65983" in output and "nvidia-smi -pm 1" in output and "Ray's logs: /" in output  # what to try
    assert not re.search(r"^Traceback", output, re.MULTILINE), output  # (Ray's own lines come prefixed)
    [head_dir] = re.findall(r"Ray's logs: (/\S+)/session_latest/logs", output)
    assert not _processes_of(head_dir)  # the held agent too


def test_when_only_the_dashboard_fails_the_node_starts_without_it_and_says_so(tmp_path):
    """(A plain process: the node is started and stopped as every entry point does.)"""
    script = ("import json, os, ray\n"
              "from deployments.cli.ray_head import HeadSpec, start_head\n"
              "head = start_head(HeadSpec(num_cpus=1, dashboard=True))\n"
              "print(json.dumps({'dashboard_url': head.dashboard_url, 'cpus': ray.cluster_resources()['CPU'],\n"
              "                  'dir': str(head.dir)}))\n"
              "head.stop()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**_clean_env(), "PYTHONPATH": _python_path(tmp_path, END_THE_DASHBOARD)})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["dashboard_url"] is None and said["cpus"] == 1
    assert "warning: the Ray dashboard did not start" in done.stderr and "serving without it" in done.stderr


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_ENABLE"))}
