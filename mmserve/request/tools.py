"""Tool calls in Qwen's formats: the tools described to the model, its calls parsed from the text it
wrote, and the grammar that forces a valid call (`tool_choice` required or a named function).

A call is `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>` (the JSON form, as Qwen's
templates render an assistant's `tool_calls`), or in Qwen3.5's XML form (`XML`, Qwen3-Coder's layout):
`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`; the
family says which (`RouterFace.tool_call_format`). `<tool_call>` may be an added token (`ToolFormat`
says which; its ids always reach the text: `ToolFormat.markers`). A family whose template has no
tools section gets them in a system message in Qwen's words (`fallback_system_text`). docs/api.md#tool-calls.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mmserve.errors import InvalidRequest, grammar_engine_problem

START, END = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # a forced message holds at most this many calls (a weak model could repeat forever)
JSON, XML = "json", "xml"  # the call forms (`RouterFace.tool_call_format`)
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

    @functools.cached_property
    def schema_text(self) -> str:
        """`schema` as JSON text (what is checked, and counted against `max_prompt_chars`)."""
        return json.dumps(self.schema, ensure_ascii=False)

    @property
    def num_chars(self) -> int:
        """Characters of its definition: name, description and schema (`max_prompt_chars`)."""
        return len(self.name) + len(self.description) + len(self.schema_text)

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


def check_tools(tools: Sequence[ToolSpec], at: Callable[[str], None] = lambda what: None) -> None:
    """The request's tools, whatever its `tool_choice`: at most `MAX_TOOLS`, names unique, each
    one's `parameters` a valid JSON Schema (as llguidance compiles `response_format`'s). Costly for
    large schemas: the Router runs it off its event loop (`deployments.core.request_checks`), `at`
    told which tool is being checked."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} functions; the limit is {MAX_TOOLS}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique")
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function.parameters (function {tool.name!r})"
        at(where)
        if tool.parameters is not None and (problem := _schema_problem(tool.schema_text)):
            raise InvalidRequest(f"{where} is not a valid JSON Schema: {problem}")


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    """What llguidance finds wrong with a JSON Schema's text (None: it compiles), in a sentence: the
    same translation `response_format` goes through (`llm_service.grammar`), no tokenizer needed."""
    from llguidance import LLMatcher

    try:
        problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema, defaults={
            "whitespace_flexible": False}))
    except ValueError as e:
        problem = str(e)
    return grammar_engine_problem(problem) if problem else None


def check_call_arguments(messages: Sequence, fmt: ToolFormat) -> None:
    """In the XML form (whose template takes a call's `arguments` as a mapping) every assistant
    call's `arguments` is the JSON text of an object (InvalidRequest naming the message otherwise)."""
    if not fmt.xml:
        return
    for i, m in enumerate(messages):
        for call in m.tool_calls:
            if not isinstance(_json_or_none(call.arguments), dict):
                raise InvalidRequest(f"messages[{i}]: tool call {call.id!r}: function.arguments must be the JSON "
                                     "text of an object")


def check_tool_results(messages: Sequence) -> None:
    """Every `role: "tool"` message answers a call of an earlier assistant message: its
    `tool_call_id` is one of theirs (InvalidRequest naming it otherwise)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            called.update(c.id for c in m.tool_calls)
        elif m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers")
            if m.tool_call_id not in called:
                raise InvalidRequest(f"messages[{i}]: tool_call_id {m.tool_call_id!r} matches no tool call of an "
                                     "earlier assistant message")


@dataclass(frozen=True)
class ToolFormat:
    """A family's call form (`xml`: Qwen3.5's, else the JSON one) and how the call markers are
    tokenized: an added token's id, or None for plain text."""

    start_id: int | None = None
    end_id: int | None = None
    xml: bool = False

    @classmethod
    def of(cls, tokenizer, form: str = JSON) -> ToolFormat:
        if form not in (JSON, XML):
            raise ValueError(f"unknown tool call form {form!r}")
        added = tokenizer.get_added_vocab()
        return cls(added.get(START), added.get(END), form == XML)

    def markers(self) -> dict[int, str]:
        """The call tags that are added tokens, by id: the text they always decode to, special or
        not (`IncrementalDetokenizer`), so that calls are found by the ids the model generated."""
        return {i: t for i, t in ((self.start_id, START), (self.end_id, END)) if i is not None}

    def _marker(self, text: str, token_id: int | None) -> str:
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def grammar(self, tools: list[ToolSpec], parallel: bool = True) -> str:
        """Lark (llguidance's dialect) for one call, or up to `MAX_PARALLEL_CALLS` separated by
        newlines with `parallel`, to any of `tools`: the name among theirs, the arguments valid against the
        chosen one's schema (compact JSON, bounds honoured; in the XML form see `_xml_function`)."""
        if not tools:
            raise InvalidRequest("tool_choice needs at least one tool")
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        lines = [f"start: call{more}",
                 f"call: {self._marker(START, self.start_id)} \"\\n\" body \"\\n\" {self._marker(END, self.end_id)}",
                 "body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            if self.xml:
                lines += _xml_function(i, tool)
                continue
            head = json.dumps('{"name": "' + tool.name + '", "arguments": ')
            lines += [f"fn_{i}: {head} args_{i} \"}}\"", f"args_{i}: %json {_json_schema(tool.schema, {})}"]
        return "\n".join(lines) + "\n"

    def parse(self, text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a model's text in this form (`parse_calls`, `parse_xml_calls`)."""
        return (parse_xml_calls if self.xml else parse_calls)(text, tools)

    def render(self, call: ToolCall) -> str:
        return render_xml_call(call) if self.xml else render_call(call)

    def head(self, block: str) -> tuple[str, int] | None:
        """(function name, where its arguments begin) of a call block whose head is written
        (`block` from its `<tool_call>` on), None before."""
        match = (_XML_HEAD_RE if self.xml else _HEAD_RE).match(block)
        return None if match is None else (match.group(1), match.end())

    def arguments_so_far(self, block: str, tool: ToolSpec) -> str:
        """The arguments' JSON text a call block (its head written, maybe not closed) holds for sure:
        in the JSON form the object as written so far; in the XML form the parameters closed so far
        as the JSON `_xml_call` makes (no closing brace until `</function>`). Each is a prefix of the
        whole call's `arguments`."""
        _, begin = self.head(block)
        if not self.xml:
            whole, inside = _raw_object(block[begin:])
            return whole if whole is not None else block[begin:begin + inside]
        properties, at, pairs = tool.schema.get("properties") or {}, begin, []
        while parameter := _XML_PARAMETER_RE.match(block, at + len(block[at:]) - len(block[at:].lstrip())):
            at = parameter.end()
            raw = parameter.group(2).removeprefix("\n").removesuffix("\n")  # the form's newlines around it
            key, value = parameter.group(1), xml_value(raw, properties.get(parameter.group(1)))
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        closed = block[at:].lstrip().startswith("</function>")
        return "{" + ", ".join(pairs) + "}" if closed else ("{" + ", ".join(pairs) if pairs else "")

    def open_call(self, text: str, tools: list[ToolSpec]) -> tuple[str, str] | None:
        """(name, arguments so far) of a call block left open at the end of `text` (cut off), its
        head written and naming one of `tools`; None otherwise."""
        at = text.rfind(START)
        if at < 0 or text.find(END, at) >= 0 or (head := self.head(text[at:])) is None:
            return None
        tool = next((t for t in tools if t.name == head[0]), None)
        return None if tool is None else (tool.name, self.arguments_so_far(text[at:], tool))


JSON_FORMAT = ToolFormat()


def parse_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's text: every `<tool_call>` block holding a JSON object with a
    known `name` and object `arguments` is a call; anything else (text, a malformed block) stays
    content, None when nothing but calls."""
    names = {t.name for t in tools}
    return _split_calls(text, _CALL_RE, lambda body: _call(body, names))


def _split_calls(text: str, block: re.Pattern, read) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): each match of `block` that `read` (its first group -> a call or None)
    makes a call is cut out of the text; the rest is content, None when nothing but calls."""
    calls, kept, pos = [], [], 0
    for match in block.finditer(text):
        if (call := read(match.group(1))) is None:
            continue  # malformed: stays in the content
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    return ("".join(kept).strip() or None) if calls else text, calls


def answer(text: str, finish: str | None, tools, parallel: bool = True, fmt: ToolFormat = JSON_FORMAT,
           forced: bool = False) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, calls, finish reason) of a whole choice: with `tools`, its calls parsed out and the
    reason `tool_calls` when it made any and stopped by itself. Without `parallel` only the first call
    is kept; `forced`: a last call cut off by `max_tokens` is a call too (docs/api.md#tool-calls)."""
    if not tools:
        return text, [], finish
    cut = fmt.open_call(text, list(tools)) if forced else None
    body = text[:text.rfind(START)] if cut else text
    content, calls = fmt.parse(body, list(tools))
    if cut:
        content = content if calls else body.strip() or None
        calls.append(ToolCall(new_call_id(), *cut))
    calls = calls if parallel else calls[:1]
    return content, calls, finish_with(finish, calls)


def finish_with(finish: str | None, calls) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(body: str, names: set[str]) -> ToolCall | None:
    value = _json_or_none(body)
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    head = _HEAD_RE.match(START + body)
    if head and isinstance(value.get("arguments"), dict):  # the model's own text of them, as streamed
        raw, _ = _raw_object(body[head.end() - len(START):])
        if raw is not None:
            return ToolCall(new_call_id(), value["name"], raw)
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


# a call's text up to its arguments, in the order Qwen writes it
_HEAD_RE = re.compile(re.escape(START) + r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


def _raw_object(text: str) -> tuple[str | None, int]:
    """(the JSON object `text` starts with, as written; None while it is not closed yet), and how
    many characters of `text` are surely inside it."""
    if not text.startswith("{"):
        return None, 0
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[:i + 1], i + 1
    return None, len(text)


# -- the XML form (Qwen3.5, Qwen3-Coder) ----------------------------------------------------------------

_XML_BLOCK_RE = re.compile(re.escape(START) + r"\n?(.*?)\n?" + re.escape(END), re.DOTALL)
_XML_FUNCTION_RE = re.compile(r"\s*<function=([A-Za-z0-9_-]{1,64})>\s*(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)
_XML_HEAD_RE = re.compile(re.escape(START) + r"\s*<function=([A-Za-z0-9_-]{1,64})>")
# what a parameter's text written as it is may not hold (the parser would end the value or the call there)
_XML_MARKERS = ("</parameter>", "<parameter=", "</function>", "<function=", START, END)


def parse_xml_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's text in the XML form: a `<tool_call>` block holding one
    `<function=NAME>` of a known tool, closed, with nothing but `<parameter=KEY>` blocks in it, is a
    call; anything else (text, a malformed block) stays content, None when nothing but calls."""
    by_name = {t.name: t for t in tools}
    return _split_calls(text, _XML_BLOCK_RE, lambda body: _xml_call(body, by_name))


def _xml_call(body: str, by_name: dict[str, ToolSpec]) -> ToolCall | None:
    if (function := _XML_FUNCTION_RE.fullmatch(body)) is None or function.group(1) not in by_name:
        return None
    tool, inner, at = by_name[function.group(1)], function.group(2), 0
    properties = tool.schema.get("properties") or {}
    arguments: dict = {}
    for parameter in _XML_PARAMETER_RE.finditer(inner):
        if parameter.start() != at or parameter.group(1) in arguments:
            return None  # text between parameters, or a key twice
        at = parameter.end()
        raw = parameter.group(2).removeprefix("\n").removesuffix("\n")  # the form's newlines around the value
        arguments[parameter.group(1)] = xml_value(raw, properties.get(parameter.group(1)))
    return ToolCall(new_call_id(), tool.name, json.dumps(arguments, ensure_ascii=False)) if at == len(inner) else None


def _json_types(schema: dict) -> set[str] | None:
    """The JSON types a parameter's schema allows: its `type`, else its enum's or const's; None: any."""
    if isinstance(kind := schema.get("type"), str):
        return {kind}
    if isinstance(kind, list):
        return set(kind)
    values = _enum_values(schema)
    return None if values is None else {_type_of(v) for v in values}


def _enum_values(schema: dict) -> list | None:
    """The values a schema's `enum` or `const` allows (None: no such keyword)."""
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return [schema["const"]] if "const" in schema else None


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", str: "string", list: "array", dict: "object"}


def _type_of(value) -> str:  # of a value JSON decodes to
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return _JSON_TYPES[type(value)]


def xml_value(raw: str, schema: dict | None):
    """A parameter's value from its text, as Qwen3-Coder's published parser reads it: a parameter
    the schema does not list, or one of type string, is the text as written (a nullable one's `null`
    is None); any other is the JSON value the text decodes to when that is of an allowed type (an
    integer is a number too; `True`/`False` in any case are booleans), else the text as written."""
    if not isinstance(schema, dict):
        return raw
    types = _json_types(schema)
    if types is not None and raw.lower() == "null" and ("null" in types or "string" not in types):
        return None
    if types is not None and types <= {"string", "null"}:
        return raw
    if types is not None and "boolean" in types and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    kind = _type_of(value)
    return value if types is None or kind in types or (kind == "integer" and "number" in types) else raw


def render_xml_call(call: ToolCall) -> str:
    """A call as Qwen3.5's template renders it in an assistant turn (`arguments` a JSON object)."""
    parameters = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                         for key, value in json.loads(call.arguments).items())
    return f"{START}\n<function={call.name}>\n{parameters}</function>\n{END}"


def _xml_function(i: int, tool: ToolSpec) -> list[str]:
    """Lark rules `fn_<i>` of a call to `tool` in the XML form, the template's layout, each value as
    the parser reads it back (`xml_value`; the rules: docs/api.md#tool-calls)."""
    schema = tool.schema
    properties = dict(schema.get("properties") or {})
    for name in schema.get("required") or ():
        properties.setdefault(name, {})
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # for the properties' $refs
    required = set(schema.get("required") or ())
    lines, parts = [], []
    for j, (name, sub) in enumerate(properties.items()):
        if not re.fullmatch(r"[^<>\n]{1,256}", name):
            if name in required:
                raise InvalidRequest(f"tool {tool.name}: parameter {name!r} cannot be written in this model's "
                                     "call format")
            continue
        rule = f"p_{i}_{j}"
        parts.append(rule if name in required else f"{rule}?")
        value, terminals = _xml_value_rule(sub if isinstance(sub, dict) else {}, shared, f"STR_{i}_{j}")
        lines += [f"{rule}: {json.dumps(f'<parameter={name}>' + chr(10))} {value}", *terminals]
    head = json.dumps(f"<function={tool.name}>\n")
    return [f"fn_{i}: {' '.join([head, *parts])} \"</function>\"", *lines]


_CLOSE = json.dumps("\n</parameter>\n")


def _xml_value_rule(schema: dict, shared: dict, terminal: str) -> tuple[str, list[str]]:
    """The Lark of one parameter's value and its closing `\\n</parameter>\\n`, and the terminal
    rules it needs."""
    types = _json_types(schema)
    if types is None or "string" not in types:
        return f"%json {_json_schema(schema, shared)} {_CLOSE}", []
    raw, terminals = _raw_string(schema, terminal)
    alternatives = [raw]
    if "null" in types:
        alternatives.append(json.dumps("null\n</parameter>\n"))
    if others := sorted(types - {"string", "null"}):
        alternatives.append(f"%json {_json_schema({**schema, 'type': others}, shared)} {_CLOSE}")
    return "(" + " | ".join(alternatives) + ")", terminals


def _json_schema(schema: dict, shared: dict) -> str:
    return json.dumps({**shared, **schema, "x-guidance": {"whitespace_flexible": False}})


_RAW_CLOSE = r"\n<\/parameter>\n"
_NO_MARKER = "~/(?s:.*(" + "|".join(re.escape(m).replace("/", r"\/") for m in _XML_MARKERS) + ").*)" + _RAW_CLOSE + "/"


def _raw_string(schema: dict, terminal: str) -> tuple[str, list[str]]:
    """A string value written as it is, with its closing, as one lexeme (so the value ends where
    its closing does): its enum's words, or a terminal of the regexes intersected (llguidance's
    `&` and `~`): the length bounds, the pattern, no marker of the form, not `null`."""
    if (values := _enum_values(schema)) is not None:
        words = [v for v in values if isinstance(v, str) and not any(m in v for m in _XML_MARKERS)
                 and v.lower() != "null"]
        if not words:
            raise InvalidRequest("a string enum of a tool parameter has no value this model's call format can write")
        return "(" + " | ".join(json.dumps(w + "\n</parameter>\n") for w in words) + ")", []
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    terms = [f"/(?s:.{{{low},{'' if high is None else int(high)}}}){_RAW_CLOSE}/", _NO_MARKER,
             f"~/(?i:null){_RAW_CLOSE}/"]
    if isinstance(pattern := schema.get("pattern"), str):  # unanchored, as JSON Schema's
        head = "" if pattern.startswith("^") else "(?s:.*)"
        tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
        body = pattern[1 if not head else 0:len(pattern) - (0 if tail else 1)].replace("/", r"\/")
        terms.append(f"/{head}(?:{body}){tail}{_RAW_CLOSE}/")
    return terminal, [f"{terminal}: {' & '.join(terms)}"]

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
