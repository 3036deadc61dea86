"""The architecture, read from the imports (every import statement, also those inside functions):
no import circle (bench/ included); the shared package imports no service; the runtimes import
neither each other nor Ray, pydantic, `deployments` or the planner; the request core and its
adapters, and the LLM replica's core, load no Ray and sit below the Serve layer; no `sys.path` edits; rooms
of bounded size; the test helpers written once; the engine's bookkeeping apart from the tensors, its step in
one screen."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mmserve", "deployments", "encoder_service", "llm_service", "protos", "bench")
SERVICES = ("deployments", "encoder_service", "llm_service")
OFF_THE_REQUEST_PATH = ("mmserve.capacity", "mmserve.loadgen")
RAY_FREE = ("deployments.core", "deployments.api", "deployments.media")


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


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(sources: tuple[str, ...], targets: tuple[str, ...]) -> dict[str, list[str]]:
    found = {m: sorted(d for d in deps if _within(d, targets)) for m, deps in GRAPH.items() if _within(m, sources)}
    return {m: d for m, d in found.items() if d}


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
    assert _violations(("mmserve",), SERVICES) == {}


@pytest.mark.parametrize("runtime", ["encoder_service", "llm_service"])
def test_runtimes_import_no_other_service_nor_ray_nor_pydantic(runtime):
    other = {"encoder_service": "llm_service", "llm_service": "encoder_service"}[runtime]
    forbidden = (other, "deployments", "ray", "pydantic", *OFF_THE_REQUEST_PATH)
    bad = {name: sorted(i for i in _imported(path) if _within(i, forbidden))
           for name, path in MODULES.items() if _within(name, (runtime,))}
    assert {m: i for m, i in bad.items() if i} == {}


def test_the_request_path_imports_neither_the_planner_nor_the_load_generator():
    request_path = ("mmserve.inputs", "mmserve.request", "mmserve.routing", "mmserve.families", "mmserve.video", "mmserve.rpc",
                    "mmserve.kernels", "encoder_service", "llm_service", *RAY_FREE, "deployments.serve")
    assert _violations(request_path, OFF_THE_REQUEST_PATH) == {}


@pytest.mark.parametrize("lower, upper", [
    (("mmserve.inputs",), ("mmserve.families", "mmserve.request")),  # the inputs, below the families
    (("mmserve.families",), ("mmserve.request",)),  # the families, below the prompt plan
    (("deployments.config", "deployments.deployment_args", "deployments.replica_env"), ("deployments.serve",)),
])
def test_no_arrow_runs_back_up(lower, upper):
    """Rooms in layers, no arrow from a lower one to a higher one (an import inside a function
    too): the circles of packages the module graph does not see as one."""
    assert _violations(lower, upper) == {}


def test_the_request_core_sits_below_the_serve_layer_and_the_launcher():
    assert _violations(RAY_FREE, ("deployments.serve", "deployments.cli")) == {}


def test_the_settings_sit_below_the_request_core_and_the_launcher():
    """`deployments.config` validates with the media rules and makes Serve's options, but reads
    neither the request core nor its adapters nor the launcher, which all read it."""
    layers = ("deployments.core", "deployments.api", "deployments.cli")
    assert _violations(("deployments.config", "deployments.replica_env"), layers) == {}


def test_the_request_core_and_its_adapters_load_no_ray():
    """The router's core and its adapters, and the LLM replica's core (it runs a request with Ray
    unimportable: `test_llm_replica`)."""
    names = sorted(m for m in MODULES if _within(m, RAY_FREE))
    assert {"deployments.core.request_core", "deployments.core.llm_replica"} <= set(names)
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {names!r}]; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert len(names) > 10 and out.stdout.strip() == "[]"


def test_each_setting_is_declared_once():
    """A setting a runtime dataclass declares (`mmserve.settings.setting` with a description) is
    not declared again by the app's pydantic sections: the section holding it takes it from the
    dataclass (`runtime_settings`), and no other declares its name."""
    import dataclasses

    from pydantic import BaseModel

    from deployments import config, deployment_args
    from mmserve.settings import setting_name

    def settings(runtimes) -> set[str]:
        return {setting_name(f) for r in runtimes for f in dataclasses.fields(r) if "description" in f.metadata}

    models = {m for module in (config, deployment_args) for m in vars(module).values()
              if isinstance(m, type) and issubclass(m, BaseModel)}
    every = settings({r for m in models for r in getattr(m, "runtimes", ())})
    again = {f"{m.__name__}.{name}" for m in models for name in vars(m).get("__annotations__", {})
             if name in (settings(m.runtimes) if hasattr(m, "runtimes") else every)}
    assert len(every) >= 30 and again == set()


def _is_sys_path(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys"


def _edits_sys_path(path: Path) -> bool:
    """`sys.path.insert(...)` (any method call on it) or `sys.path = ...`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            return True
        if isinstance(node, ast.Assign) and any(_is_sys_path(t) for t in node.targets):
            return True
    return False


def test_no_sys_path_edits_outside_the_test_conftest():
    files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts]
    edits = sorted(str(p.relative_to(ROOT)) for p in files if _edits_sys_path(p))
    assert edits in ([], ["tests/conftest.py"])


@pytest.mark.parametrize("room, most", [("mmserve", 8), ("deployments", 6)])
def test_the_shared_package_and_the_serve_layer_keep_small_top_levels(room, most):
    assert len(list((ROOT / room).glob("*.py"))) <= most


def test_the_test_helpers_live_in_tests_support_only():
    helpers = {"_user", "_text", "_image", "CASES"}
    defined = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if "support" in path.relative_to(ROOT / "tests").parts:
            continue
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for name in set(names) & helpers:
                defined.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert defined == {}


def test_the_engine_bookkeeping_holds_ids_not_tensors():
    """The scheduler and what it schedules (sequences, KV block ids, state slot and snapshot ids)
    import nothing of the model on its device (`llm_service.model`: the runner, the pools)."""
    bookkeeping = ("llm_service.engine.scheduler", "llm_service.engine.block_manager", "llm_service.engine.sequence",
                   "llm_service.hybrid.state_slots", "llm_service.hybrid.state_snapshots")
    assert all(m in MODULES for m in bookkeeping) and _violations(bookkeeping, ("llm_service.model",)) == {}


def test_the_engine_step_reads_in_one_screen():
    """`LLMEngine.step()` stays schedule -> launch -> read -> postprocess: at most 20 lines of body."""
    tree = ast.parse((ROOT / "llm_service" / "engine" / "llm_engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    body = step.body[1:] if ast.get_docstring(step) else step.body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 20
