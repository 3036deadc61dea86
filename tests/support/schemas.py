"""Schemas and tools the structured-output and tool-call tests share: bounded extraction schemas
(an invoice, a chart), generated bounded schemas (`BOUNDED`: a hypothesis strategy; `seeded_schemas`:
a fixed list the same builder makes from a seed, for the served tests) and two GUI-agent functions."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import strategies as st

from mmserve.request.tools import ToolSpec

INVOICE = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 12},
        "total_cents": {"type": "integer", "minimum": 0, "maximum": 100000},
        "currency": {"enum": ["EUR", "USD", "CHF"]},
        "paid": {"type": "boolean"},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["vendor", "total_cents", "currency", "paid", "items"],
    "additionalProperties": False,
}
CHART = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 10},
                   "values": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                              "maxItems": 4}},
    "required": ["title", "values"], "additionalProperties": False,
}

CLICK = ToolSpec("click", "Click at a point of the screen", {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 1920},
                                     "y": {"type": "integer", "minimum": 0, "maximum": 1080},
                                     "button": {"enum": ["left", "right"]}},
    "required": ["x", "y"], "additionalProperties": False})
TYPE = ToolSpec("type_text", "Type text", {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"],
    "additionalProperties": False})
TOOLS = [CLICK, TYPE]


def _bounded(choose: Callable[[int, int], int], leaves: int = 8) -> dict:
    """An object schema whose every value is bounded: strings with `maxLength`, integers with
    `minimum`/`maximum`, enums, booleans, nested objects (`required` a subset of their properties,
    `additionalProperties: false`) and arrays with `maxItems`, nested at most 3 deep; past `leaves`
    values only scalars. `choose(lo, hi)` makes each choice (an int in [lo, hi]): hypothesis' draws
    (`BOUNDED`, which shrinks towards strings and small bounds) or a seeded `random.Random`."""
    left = [leaves]

    def word(alphabet: str, lo: int, hi: int) -> str:
        return "".join(alphabet[choose(0, len(alphabet) - 1)] for _ in range(choose(lo, hi)))

    def value(depth: int) -> dict:
        left[0] -= 1
        kind = choose(0, 5 if depth < 3 and left[0] > 0 else 3)
        if kind == 0:
            return {"type": "string", "maxLength": choose(0, 8)}
        if kind == 1:
            low = choose(-1000, 1000)
            return {"type": "integer", "minimum": low, "maximum": low + choose(0, 5000)}
        if kind == 2:
            return {"enum": list(dict.fromkeys(word("abcxyz", 1, 4) for _ in range(choose(1, 4))))}
        if kind == 3:
            return {"type": "boolean"}
        if kind == 4:
            return obj(depth + 1)
        return {"type": "array", "items": value(depth + 1), "maxItems": choose(0, 3)}

    def obj(depth: int) -> dict:
        keys = list(dict.fromkeys(word("abcdefgh", 1, 5) for _ in range(choose(1, 4))))
        properties = {k: value(depth) for k in keys}
        required = [k for k in keys if choose(0, 1)]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    return obj(0)


def max_output_tokens(schema: dict) -> int:
    """An upper bound on the tokens of any compact JSON document of a `_bounded` schema (at least
    one byte a token; a string character at most 6 bytes: `\\u001f`), its stop token included."""
    def size(s: dict) -> int:
        if "enum" in s:
            return max(len(v) for v in s["enum"]) + 2
        kind = s["type"]
        if kind == "string":
            return 2 + 6 * s["maxLength"]
        if kind == "integer":
            return max(len(str(s["minimum"])), len(str(s["maximum"])))
        if kind == "boolean":
            return 5
        if kind == "array":
            return 2 + s["maxItems"] * (size(s["items"]) + 1)
        return 2 + sum(len(k) + 4 + size(v) for k, v in s["properties"].items())

    return size(schema) + 1


def features(schema: dict, nested: bool = False) -> set[str]:
    """The kinds a `_bounded` schema holds: its value types, `nested_object`, `required`, `optional`."""
    if "enum" in schema:
        return {"enum"}
    kind = schema["type"]
    if kind == "array":
        return {"array" if schema["maxItems"] else "empty_array"} | features(schema["items"], True)
    if kind != "object":
        return {kind}
    out = {"nested_object"} if nested else set()
    out |= {"required"} if schema["required"] else set()
    out |= {"optional"} if len(schema["required"]) < len(schema["properties"]) else set()
    return out.union(*(features(v, True) for v in schema["properties"].values()))


FITS = 300  # `BOUNDED` and `seeded_schemas` schemas' documents take at most this many tokens, stop token included
BOUNDED = st.composite(lambda draw: _bounded(lambda lo, hi: draw(st.integers(lo, hi))))().filter(
    lambda s: max_output_tokens(s) <= FITS)


def seeded_schemas(n: int, seed: int) -> list[dict]:
    """`n` schemas of `BOUNDED`'s builder (and bound), the same for the same seed."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        if max_output_tokens(schema := _bounded(rng.randint)) <= FITS:
            out.append(schema)
    return out


def symbol_overflow_tools() -> list[ToolSpec]:
    """64 functions of 300 required integer parameters each (~700 KB): every schema alone is valid,
    but the grammar forcing a call to any of them overflows llguidance's symbol table (a `u16`),
    which its compile reports as a panic (`grammar.symbols.len() < u16::MAX ...`, a backtrace)."""
    properties = {f"p{i}": {"type": "integer"} for i in range(300)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return [ToolSpec(f"t{j}", "", schema) for j in range(64)]
