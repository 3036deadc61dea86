"""Tool calls in Qwen's format: the tools described to the model, its calls parsed from the text it
wrote, and the grammar that forces a valid call (`tool_choice` required or a named function).

A call is `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, the layout Qwen's chat
templates render an assistant's `tool_calls` in (so a call the model made renders back as it was
written). `<tool_call>` is an added token in Qwen3-VL's tokenizer and plain text in the others;
`ToolFormat` says which. A family whose template has no tools section gets the tools described in a
system message in the same words as Qwen's (`fallback_system_text`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from mmserve.errors import InvalidRequest

START, END = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # a forced message holds at most this many calls (a weak model could repeat forever)
_CALL_RE = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: `parameters` is its arguments' JSON Schema (an object)."""

    name: str
    description: str = ""
    parameters: dict | None = None

    def __post_init__(self):
        if not NAME_RE.match(self.name):
            raise InvalidRequest(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.parameters is not None and self.parameters.get("type", "object") != "object":
            raise InvalidRequest(f"tool {self.name}: parameters must be a JSON Schema of type object")

    @property
    def schema(self) -> dict:
        return self.parameters or {"type": "object", "properties": {}}

    def as_openai(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: list[ToolSpec]) -> None:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} functions; the limit is {MAX_TOOLS}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique")


@dataclass(frozen=True)
class ToolFormat:
    """How the call markers are tokenized: an added token's id, or None for plain text."""

    start_id: int | None = None
    end_id: int | None = None

    @classmethod
    def of(cls, tokenizer) -> ToolFormat:
        added = tokenizer.get_added_vocab()
        return cls(added.get(START), added.get(END))

    def _marker(self, text: str, token_id: int | None) -> str:
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def grammar(self, tools: list[ToolSpec], parallel: bool = True) -> str:
        """Lark (llguidance's dialect) for one call, or up to `MAX_PARALLEL_CALLS` separated by
        newlines with `parallel`, to any of `tools`: the name among theirs, the arguments valid against the
        chosen one's schema (compact JSON, bounds honoured)."""
        if not tools:
            raise InvalidRequest("tool_choice needs at least one tool")
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        lines = [f"start: call{more}",
                 f"call: {self._marker(START, self.start_id)} \"\\n\" body \"\\n\" {self._marker(END, self.end_id)}",
                 "body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            head = json.dumps('{"name": "' + tool.name + '", "arguments": ')
            schema = {**tool.schema, "x-guidance": {"whitespace_flexible": False}}
            lines.append(f"fn_{i}: {head} args_{i} \"}}\"")
            lines.append(f"args_{i}: %json {json.dumps(schema)}")
        return "\n".join(lines) + "\n"


def parse_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's text: every `<tool_call>` block holding a JSON object with a
    known `name` and object `arguments` is a call; anything else (text, a malformed block) stays
    content, None when nothing but calls."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL_RE.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue  # malformed: stays in the content
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def fallback_system_text(tools: list[ToolSpec]) -> str:
    """The tools described as Qwen's templates describe them, for a template without tools."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def render_call(call: ToolCall) -> str:
    """A call as Qwen's templates render it in an assistant turn."""
    return f'{START}\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n{END}'


class ToolText:
    """One choice's streamed text when the request has tools: text is sent as content until a
    `<tool_call>` begins (a tail that may be its start is held back); from there it is held, and
    parsed into calls at the choice's end (what is not a call is sent as content then)."""

    def __init__(self, tools):
        self.tools, self.held, self.calling = list(tools), "", False

    def add(self, text: str) -> str:
        """What of the text so far may go out as content now."""
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(START)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            return out
        keep = next((k for k in range(min(len(START) - 1, len(self.held)), 0, -1) if START.startswith(self.held[-k:])),
                    0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, calls)."""
        content, calls = parse_calls(self.held, self.tools)
        return (content or "", calls) if calls else (self.held, [])
