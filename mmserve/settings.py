"""Settings declared once, in the runtime dataclass that uses them, without pydantic.

`setting(default, description, ge=1)` is a dataclass field whose metadata holds its description
and bounds. The app's pydantic models (`deployments.config`) make a field of every setting that
has a description (under `name` where the app config calls it otherwise), validated with those
bounds, and docs/configuration.md shows it; `check_fields` checks the same bounds (and `Literal`
choices) where the dataclass is made without pydantic (tests, benches, the standalone encoder).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any

BOUNDS = ("ge", "gt", "le", "lt")


def setting(default: Any, description: str = "", *, name: str | None = None, **bounds: Any) -> Any:
    """A dataclass field with its `description` (a setting of the app: one without it is internal),
    `name` (the app config's, default the field's) and `bounds` (pydantic's ge, gt, le, lt)."""
    metadata = {**bounds, **({"description": description} if description else {}), **({"name": name} if name else {})}
    return dataclasses.field(default=default, metadata=metadata)


def setting_name(f: dataclasses.Field) -> str:
    return f.metadata.get("name", f.name)


type_hints = functools.cache(typing.get_type_hints)


def check_fields(obj: Any, error: type[Exception] = ValueError) -> None:
    """`error` naming the first field of dataclass `obj` outside its bounds or its `Literal` choices
    (None passes: a default to resolve)."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, label = getattr(obj, f.name), setting_name(f)
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        if value is None or isinstance(value, bool) or not (choices or BOUNDS & f.metadata.keys()):
            continue
        if choices and value not in choices:
            raise error(f"{label} must be one of {', '.join(map(str, choices))}; got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{label} must be a finite number, got {value}")
        ge, gt, le, lt = (f.metadata.get(key) for key in BOUNDS)
        if ((ge is not None and value < ge) or (gt is not None and value <= gt)
                or (le is not None and value > le) or (lt is not None and value >= lt)):
            low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else "(-inf"
            high = f"{le}]" if le is not None else f"{lt})" if lt is not None else "inf)"
            raise error(f"{label} must be in {low}, {high}, got {value}")
