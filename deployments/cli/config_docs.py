"""docs/configuration.md's tables from `AppArgs` (deployments/config.py): a section per nested model,
its fields' type, default and description. The page's text above `MARK` is written by hand.

    python -m deployments.cli.config_docs   # rewrites docs/configuration.md below MARK

tests/unit/test_docs.py fails when the page and this output differ.
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

from pydantic import BaseModel

from deployments.config import AppArgs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MARK = "<!-- generated below by `python -m deployments.cli.config_docs` from deployments/config.py -->\n"
LIMITS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "pattern": "matching"}


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (`X`, `X | None`)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _type(field) -> str:
    names = " or ".join(f"[{m.__name__}](#{m.__name__.lower()})" for m in _models(field.annotation))
    choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
    kind = names or " or ".join(f"`{c}`" for c in choices) or getattr(field.annotation, "__name__", None) \
        or str(field.annotation).replace("typing.", "")
    limits = [f"{sign} `{getattr(m, key)}`" for m in field.metadata for key, sign in LIMITS.items() if hasattr(m, key)]
    return ", ".join([kind.replace(" | None", " or null"), *limits])


def _value(value) -> str:
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 30} GiB)" if value % (1 << 30) == 0 else f"`{value}` ({value >> 20} MiB)"
    return f"`{'null' if value is None else str(value).lower() if isinstance(value, bool) else value}`"


def _sections() -> dict[type[BaseModel], dict[str, BaseModel | None]]:
    """Every model under `AppArgs` (in the order fields name them) with the paths it is used at and its
    default instance at each (None: the field defaults to None)."""
    found: dict[type[BaseModel], dict[str, BaseModel | None]] = {AppArgs: {"": AppArgs()}}
    queue = [(AppArgs, "", AppArgs())]
    while queue:
        model, prefix, instance = queue.pop(0)
        for name, field in model.model_fields.items():
            value = getattr(instance, name, None)
            for nested in _models(field.annotation):
                sub = value if isinstance(value, nested) else None
                found.setdefault(nested, {})[prefix + name] = sub
                queue.append((nested, f"{prefix}{name}.", sub))
    return found


def render() -> str:
    out = [PAGE.read_text().split(MARK)[0] + MARK]
    for model, places in _sections().items():
        paths = ", ".join(f"`{p}`" for p in places if p)
        out += [f"\n## {model.__name__}\n", *([f"Under {paths}.\n"] if paths else []),
                inspect.cleandoc(model.__doc__ or "") + "\n", "| field | type | default | description |",
                "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            fallback = field.get_default(call_default_factory=True)
            by_value: dict[str, list[str]] = {}
            for path, instance in places.items():
                by_value.setdefault(_value(fallback if instance is None else getattr(instance, name)), []).append(path)
            default = next(iter(by_value)) if len(by_value) == 1 else "; ".join(
                f"{v} ({', '.join(f'`{p}`' for p in ps)})" for v, ps in by_value.items())
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | {_type(field).replace('|', chr(92) + '|')} | {default} | {description} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
