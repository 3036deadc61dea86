"""The architecture, read from the imports (every import statement, also those inside functions):
no import circle; the shared package imports no service; the runtimes import neither each other
nor Ray nor pydantic; the request core and its adapters load no Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mmserve", "deployments", "encoder_service", "llm_service", "protos")
SERVICES = ("deployments", "encoder_service", "llm_service")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = {name: {m for i in _imported(path) if (m := _project_module(i)) and m != name}
         for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert _cycles() == []


def test_the_shared_package_imports_no_service():
    bad = {m: sorted(d for d in deps if d.split(".")[0] in SERVICES)
           for m, deps in GRAPH.items() if m.split(".")[0] == "mmserve"}
    assert {m: d for m, d in bad.items() if d} == {}


@pytest.mark.parametrize("runtime", ["encoder_service", "llm_service"])
def test_runtimes_import_no_other_service_nor_ray_nor_pydantic(runtime):
    other = {"encoder_service": "llm_service", "llm_service": "encoder_service"}[runtime]
    forbidden = (other, "deployments", "ray", "pydantic")
    bad = {name: sorted(i for i in _imported(path) if i.split(".")[0] in forbidden)
           for name, path in MODULES.items() if name.split(".")[0] == runtime}
    assert {m: i for m, i in bad.items() if i} == {}


def test_the_request_core_and_its_adapters_load_no_ray():
    code = ("import sys, deployments.core.request_core, deployments.api.openai_api, deployments.api.grpc_api; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
