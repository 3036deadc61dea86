"""Schemas and tools the structured-output and tool-call tests share: bounded extraction schemas
(an invoice, a chart) and two GUI-agent functions."""

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
