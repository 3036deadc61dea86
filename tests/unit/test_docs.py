"""The documentation stays true to the tree: the README fits on a screen, every repository path the
docs name in backticks exists (so no page names a moved file), and docs/configuration.md is what
`python -m deployments.cli.config_docs` generates from `AppArgs`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "k8s" / "README.md",
                ROOT / "protos" / "README.md"])
ROOMS = ("mmserve/", "deployments/", "encoder_service/", "llm_service/", "protos/", "k8s/", "tests/", "bench/",
         "scripts/", "docs/")
# files the tools write, named by the docs but not kept in the tree
OUTPUTS = {"bench/results/cpu.jsonl"}


def test_the_readme_fits_on_a_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100
    assert [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 120] == []


def _named_paths(page: Path) -> set[str]:
    """Repository paths in the page's inline code spans (fenced blocks left out): each word of a span
    that starts with a top-level folder, without a placeholder (`<name>`, `*`) and trailing `:line`,
    `::test` or punctuation."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in span.split():
            word = word.split("::")[0].rstrip(".,;:)'\"")
            word = re.sub(r":\d+$", "", word)
            if word.startswith(ROOMS) and not re.search(r"[<>*{}$|]", word):
                found.add(word)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(page):
    missing = sorted(p for p in _named_paths(page)
                     if p not in OUTPUTS and not (ROOT / p).exists() and not (page.parent / p).exists())
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_resolves(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    assert sorted(t for t in links if "://" not in t and not (page.parent / t).exists()) == []


def test_the_module_map_names_every_module():
    """docs/structures.md: one line per module (package `__init__`s and generated code aside)."""
    listed = _named_paths(ROOT / "docs" / "structures.md")
    modules = [p.relative_to(ROOT) for room in ROOMS for p in (ROOT / room).rglob("*.py")
               if p.name != "__init__.py" and "_pb2" not in p.name and "data" not in p.parts]
    assert len(modules) > 100 and sorted(str(m) for m in modules if str(m) not in listed) == []


def test_the_path_check_sees_paths():
    readme = _named_paths(ROOT / "README.md")
    assert {"deployments/core/", "k8s/overlays/gpu", "deployments/serve_config.yaml"} <= readme


def test_configuration_page_is_current():
    """Regenerate with `python -m deployments.cli.config_docs`."""
    from deployments.cli.config_docs import render

    assert (ROOT / "docs" / "configuration.md").read_text() == render()
