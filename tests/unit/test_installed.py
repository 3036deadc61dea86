"""`mmserve plan` as a new user runs it: from a wheel of this checkout, installed into a directory of
its own, run from another directory, the checkout not importable (seconds: no Ray, no model)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the working tree (a build leaves nothing in the checkout)."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "source"
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for package in re.findall(r'"(\w+)\*"', include):  # [tool.setuptools.packages.find]
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("mmserve-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    return tmp / "site"


def _mmserve(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RAY_ADDRESS"))}
    env["PYTHONPATH"] = str(site)  # ahead of the venv's editable finder, which maps to a checkout
    return subprocess.run([sys.executable, "-m", "deployments.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_plan_runs_from_the_installed_package_anywhere(installed, tmp_path):
    where = _mmserve(installed, tmp_path, "plan", "--help")
    assert where.returncode == 0 and "a100-qwen3-vl-4b" in where.stdout, where.stderr
    packages = ("mmserve", "deployments", "encoder_service", "llm_service", "protos")
    code = f"import {', '.join(packages)}; print(*({', '.join(f'{p}.__file__' for p in packages)}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    files = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "PYTHONPATH": str(installed)},
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(files) == len(packages) and all(Path(f).is_relative_to(installed) for f in files), files  # the wheel's

    # the bundled profile, a small cluster and short runs (a run lasts 10 TTFT SLOs at least)
    plan = _mmserve(installed, tmp_path, "plan", "--gpus", "4", "--cell", "4", "--requests", "200", "--ttft-p99", "2",
                    "--output-tokens", "16")
    assert plan.returncode == 0, plan.stderr[-3000:]
    result = json.loads(plan.stdout.strip().splitlines()[-1])
    assert result["profile"].startswith("hand-written") and [r["gpus"] for r in result["recommendations"]] == [4]

    runs = str(ROOT / "tests" / "data" / "plan_runs.json")
    validated = _mmserve(installed, tmp_path, "plan", "--validate", "--runs", runs)
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert "max_rel_error" in json.loads(validated.stdout.strip().splitlines()[-1])
