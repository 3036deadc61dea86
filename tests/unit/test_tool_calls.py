"""Tool calls in Qwen's formats (`mmserve.request.tools`): the parsers on recorded outputs (a call,
two calls, text around them, malformed blocks kept as text), of the JSON form and of Qwen3.5's XML
form, and the grammar of `tool_choice` required / a named function driving the engine: with an
image in the prompt, random weights, greedy and sampled, every output parses to calls whose
arguments validate, for a tokenizer where `<tool_call>` is an added token (Qwen3-VL) and one where
it is text (Qwen2-VL), and in the XML form (Qwen3.5); streamed text answers as the whole text does
(every cut of it included); and, for every family, a whole agent turn in the engine (an image, a
forced call, its result, an answer under a json_schema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.core.generation import Delta, Generation
from llm_service.sampling import Grammar
from mmserve.errors import InvalidRequest
from mmserve.request.tool_stream import ToolText
from mmserve.request.tools import (JSON_FORMAT, ToolCall, ToolFormat, ToolSpec, answer,
                                   fallback_system_text, parse_calls, parse_xml_calls, render_call, render_xml_call,
                                   xml_value)
from mmserve.tiny import FAMILIES
from tests.support.cases import image, text, user
from tests.support.engine_support import Collector, make_engine, plan_request, run_until_done
from tests.support.schemas import TOOLS, TYPE



@pytest.mark.parametrize("output, content, calls", [
    ('<tool_call>\n{"name": "click", "arguments": {"x": 10, "y": 20}}\n</tool_call>', None,
     [("click", {"x": 10, "y": 20})]),
    ('I will click.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "type_text", "arguments": {"text": "hi"}}\n</tool_call>', "I will click.",
     [("click", {"x": 1, "y": 2}), ("type_text", {"text": "hi"})]),
    ('<tool_call>\n{"name": "click", "arguments": "{\\"x\\": 3, \\"y\\": 4}"}\n</tool_call>', None,
     [("click", {"x": 3, "y": 4})]),  # arguments written as a JSON string
    ('<tool_call>\n{"name": "click", "arguments": {"x": 1,\n</tool_call>', None, []),  # malformed: text
    ('<tool_call>\n{"name": "scroll", "arguments": {}}\n</tool_call>', None, []),  # no such tool: text
    ("Just an answer.", None, []),
])
def test_the_parser_finds_calls_and_keeps_the_rest_as_text(output, content, calls):
    got_content, got = parse_calls(output, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else output)
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)
    for call in got:  # a call renders back as Qwen's template writes it
        assert parse_calls(render_call(call), TOOLS)[1][0].arguments == call.arguments


def test_tools_are_checked_and_described_for_templates_without_them():
    with pytest.raises(InvalidRequest, match="tool name"):
        ToolSpec("no spaces allowed")
    with pytest.raises(InvalidRequest, match="type object"):
        ToolSpec("f", parameters={"type": "string"})
    described = fallback_system_text(TOOLS)
    assert '"name": "click"' in described and "<tool_call>" in described and described.startswith("# Tools")


def _run(model_dir, grammar: str, sampled: dict, n: int = 3):
    engine = make_engine(model_dir)
    collector = Collector()
    for i in range(n):
        collector.add(engine, plan_request(model_dir, user(image(56, 70, 30 + i), text("Click the OK button.")),
                                           f"r{i}", 800, grammar=Grammar("lark", grammar),
                                           **({**sampled, "seed": i} if sampled else {})))
    run_until_done(engine, collector)
    return [(collector.tokens(f"r{i}"), collector.finish_reason(f"r{i}")) for i in range(n)]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "qwen3_5"])
@pytest.mark.parametrize("sampled", [{}, {"temperature": 1.0, "top_p": 0.95}], ids=["greedy", "sampled"])
def test_required_and_named_choices_always_give_valid_calls(tiny_checkpoint, family, sampled):
    from transformers import AutoTokenizer

    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = RequestPlanner(model_dir, tokenizer).tool_format  # the family's form
    assert (fmt.start_id is not None) == (family != "qwen2_vl") and fmt.xml == (family == "qwen3_5")
    # Qwen3.5's form: a string written as it is (bounded), a nullable one, an enum without a type, JSON values
    tools = [*TOOLS, SEARCH] if fmt.xml else TOOLS
    for tools, parallel in ((tools, True), ([TYPE], False)):  # required (parallel calls); a named function
        for tokens, reason in _run(model_dir, fmt.grammar(tools, parallel), sampled):
            assert reason == "stop"
            content, calls = fmt.parse(tokenizer.decode(tokens), tools)
            assert calls and content is None
            assert parallel or len(calls) == 1
            for call in calls:
                spec = next(t for t in tools if t.name == call.name)
                jsonschema.validate(json.loads(call.arguments), spec.schema)


SEARCH = ToolSpec("search", "Search the page", {
    "type": "object", "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 10, "pattern": "^[a-z ]+$"},
        "scope": {"type": ["string", "null"], "maxLength": 5}, "limit": {"type": "integer", "minimum": 1, "maximum": 9},
        "where": {"$ref": "#/$defs/box"}},
    "required": ["query", "scope", "where"], "additionalProperties": False,
    "$defs": {"box": {"type": "object", "properties": {"w": {"type": "number"}}, "required": ["w"],
                      "additionalProperties": False}}})


def _conversation_messages(mapping: bool = False):
    """user -> assistant tool call -> tool result, as the planner takes them and as HF's template does
    (with `mapping`, the call's arguments as the mapping Qwen3.5's template takes)."""
    from mmserve.request.prompt import Message

    call = ToolCall("call_1", "click", '{"x":5,"y":7}')
    ours = [Message("system", ("You operate a computer.",)), Message("user", ("Click OK.",)),
            Message("assistant", (), (call,)), Message("tool", ("clicked",), tool_call_id="call_1"),
            Message("user", ("Now type hello.",))]
    theirs = [{"role": "system", "content": "You operate a computer."}, {"role": "user", "content": "Click OK."},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "click", "arguments": {"x": 5, "y": 7} if mapping
                                                    else '{"x":5,"y":7}'}}]},
              {"role": "tool", "content": "clicked", "tool_call_id": "call_1"},
              {"role": "user", "content": "Now type hello."}]
    return ours, theirs


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_a_tool_conversation_renders_as_transformers_renders_it_where_the_template_has_tools(tiny_checkpoint,
                                                                                             family):
    from transformers import AutoTokenizer

    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours, theirs = _conversation_messages(mapping=family.startswith("qwen3_5"))
    plan = RequestPlanner(model_dir, tokenizer).plan(ours, tuple(TOOLS))
    text = tokenizer.apply_chat_template(theirs, tools=[t.as_openai() for t in TOOLS], tokenize=False,
                                         add_generation_prompt=True)
    assert plan.token_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert "<tools>" in text and "<tool_response>" in text
    if family.startswith("qwen3_5"):  # the call as the XML form writes it
        assert "<function=click>\n<parameter=x>\n5\n</parameter>\n<parameter=y>\n7\n</parameter>\n</function>" in text


def test_without_a_tools_section_the_tools_and_calls_are_written_as_qwen_writes_them(tiny_checkpoint):
    from transformers import AutoTokenizer

    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint("qwen2_vl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours, _ = _conversation_messages()
    text = tokenizer.decode(RequestPlanner(model_dir, tokenizer).plan(ours, tuple(TOOLS)).token_ids)
    assert text.index("You operate a computer.") < text.index("# Tools") < text.index("Click OK.")
    assert '<tool_call>\n{"name": "click", "arguments": {"x":5,"y":7}}\n</tool_call>' in text
    assert "<tool_response>\nclicked\n</tool_response>" in text


def test_special_token_strings_in_tools_are_refused(tiny_checkpoint):
    from transformers import AutoTokenizer

    from mmserve.request.prompt import Message
    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint("qwen3_vl")
    planner = RequestPlanner(model_dir, AutoTokenizer.from_pretrained(model_dir))
    sneaky = ToolSpec("f", "ends the turn <|im_end|>")
    with pytest.raises(InvalidRequest, match="special token strings"):
        planner.plan([Message("user", ("hi",))], (sneaky,))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_template_takes_a_tool_conversation(tiny_checkpoint, family):
    """Rendered by the template's tools section or in Qwen's words: the calls, the tool result and
    the tools' names are in the prompt, an image in the user's turn, for every family of the registry
    (`mmserve.tiny.FAMILIES`)."""
    import dataclasses

    from transformers import AutoTokenizer

    from mmserve.inputs.media import MediaItem, MediaKind
    from mmserve.request.prompt_plan import RequestPlanner
    from mmserve.tiny import _MODEL_TYPES
    from tests.support.media_factory import image_bytes

    model_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours, _ = _conversation_messages()
    ours[1] = dataclasses.replace(ours[1], parts=(MediaItem(MediaKind.IMAGE, (image_bytes(56, 70, 3),)),
                                                  *ours[1].parts))
    planner = RequestPlanner(model_dir, tokenizer)
    plan = planner.plan(ours, tuple(TOOLS))
    text = tokenizer.decode(plan.token_ids)
    assert "type_text" in text and "clicked" in text and '"click"' in text and len(plan.ranges) == 1
    assert ("<function=click>" in text) == (_MODEL_TYPES[family] in ("qwen3_5", "qwen3_5_moe"))


ANSWER = {"type": "object", "properties": {"done": {"type": "boolean"},
                                          "next": {"enum": ["click", "type_text", "stop"]}},
          "required": ["done", "next"], "additionalProperties": False}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_an_agent_turn_with_a_tool_result_then_a_json_answer(tiny_checkpoint, family):
    """The whole exchange in the engine, for every family of the registry, the tools described in
    each turn (as the app plans a request whose `tool_choice` is not none): the user with an image
    -> the assistant's call (`required`, one call: the family's grammar) -> the tool's result and a
    user turn with another image -> an answer under a json_schema, which validates."""
    from transformers import AutoTokenizer

    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = RequestPlanner(model_dir, tokenizer).tool_format
    ask = user(image(56, 70, 60), text("Click the OK button."))
    engine, collector = make_engine(model_dir), Collector()
    collector.add(engine, plan_request(model_dir, ask, "call", 300, tools=TOOLS,
                                       grammar=Grammar("lark", fmt.grammar(TOOLS, parallel=False))))
    run_until_done(engine, collector)
    assert collector.finish_reason("call") == "stop"
    content, calls = fmt.parse(tokenizer.decode(collector.tokens("call")), TOOLS)
    assert content is None and len(calls) == 1
    conversation = [*ask, {"role": "assistant", "content": [], "tool_calls": calls},
                    {"role": "tool", "content": [text("clicked")], "tool_call_id": calls[0].id},
                    *user(image(42, 56, 61), text("Is the dialog gone?"))]
    request = plan_request(model_dir, conversation, "answer", 120, tools=TOOLS,
                           grammar=Grammar("json_schema", json.dumps(ANSWER)))
    prompt = tokenizer.decode(request.prompt_token_ids)
    assert "clicked" in prompt and calls[0].name in prompt and "type_text" in prompt and len(request.media) == 2
    collector.add(engine, request)
    run_until_done(engine, collector)
    assert collector.finish_reason("answer") == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(collector.tokens("answer"), skip_special_tokens=True)), ANSWER)


def _streamed(output: str, step: int, parallel: bool = True, fmt: ToolFormat = JSON_FORMAT):
    """(events, calls) of `output` streamed through `ToolText` `step` characters at a time."""
    text, events = ToolText(TOOLS, parallel, fmt), []
    for i in range(0, len(output), step):
        events += text.add(output[i:i + step])
    more, calls = text.end()
    return events + more, calls


def _assert_streamed_as_unstreamed(output: str, step: int, parallel: bool = True, fmt: ToolFormat = JSON_FORMAT):
    """The streamed answer is the unstreamed one (`answer` on the same text): the same calls (one
    call event per call, its arguments joined from its pieces) and the same content (exactly when
    there are no calls; with calls the unstreamed content is stripped)."""
    events, calls = _streamed(output, step, parallel, fmt)
    content, parsed, _ = answer(output, "length", TOOLS, parallel, fmt)
    streamed_content = "".join(e[1] for e in events if e[0] == "content")
    heads = [(e[1], e[2].name) for e in events if e[0] == "call"]
    joined: dict[int, str] = {}
    for e in events:
        if e[0] == "arguments":
            joined[e[1]] = joined.get(e[1], "") + e[2]
    assert heads == [(i, c.name) for i, c in enumerate(parsed)], output
    assert [joined.get(i) for i in range(len(parsed))] == [c.arguments for c in parsed] == [c.arguments
                                                                                          for c in calls]
    assert set(joined) == set(range(len(parsed)))
    if parsed:
        assert streamed_content.strip() == (content or ""), output
    else:
        assert streamed_content == content == output
    return events


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_calls_send_their_arguments_in_the_pieces_generated_and_join_to_the_parsed_ones(step):
    output = ('Sure.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2, "button": "left"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "type_text", "arguments": {"text": "a}\\"b"}}\n</tool_call>')
    events = _assert_streamed_as_unstreamed(output, step)
    content, parsed = parse_calls(output, TOOLS)
    assert "".join(e[1] for e in events if e[0] == "content") == content == "Sure."
    assert [(e[1], e[2].name) for e in events if e[0] == "call"] == [(0, "click"), (1, "type_text")]
    assert json.loads(parsed[1].arguments) == {"text": 'a}"b'}
    if step < 10:
        assert sum(e[0] == "arguments" for e in events) > 2  # in pieces
    for i, e in enumerate(events):  # each call: its id and name first, then its arguments
        if e[0] == "call":
            assert e[2].id.startswith("call_") and events[i + 1][:2] == ("arguments", e[1])


MALFORMED = [
    '<tool_call>\n{"name": "click", "arguments": {"x": 1\n</tool_call>',  # arguments never closed
    '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n',  # no </tool_call>: cut off
    '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}',
    '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y"',  # cut off by max_tokens
    'I will click.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}',
    '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}, "extra": }\n</tool_call>\nDone.',
    '<tool_call>\n{"name": "type_text", "arguments": {"text": "</tool_call>"}}\n</tool_call>',  # closed in a string
]


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("output", MALFORMED)
def test_a_malformed_streamed_call_is_content(output, step):
    """A block that never becomes a call (malformed, or never closed: cut off by `max_tokens`) sends
    no event of a call, and its text once, as content: the content the unstreamed answer has."""
    events, calls = _streamed(output, step)
    assert not calls and [e for e in events if e[0] != "content"] == []
    assert "".join(e[1] for e in events) == answer(output, "length", TOOLS)[0] == output


@pytest.mark.parametrize("step", [1, 5])
def test_a_malformed_call_then_a_call_streams_as_unstreamed(step):
    bad = '<tool_call>\n{"name": "click", "arguments": {"x": 1\n</tool_call>'
    good = '<tool_call>\n{"name": "type_text", "arguments": {"text": "hi"}}\n</tool_call>'
    for output in (bad + "\n" + good, "A " + good + " \n " + bad + " B", good + "\n\n" + bad, bad + good + "\n "):
        events = _assert_streamed_as_unstreamed(output, step)
        assert [e[2].name for e in events if e[0] == "call"] == ["type_text"]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("step", [1, 6])
def test_every_cut_of_a_streamed_answer_agrees_with_the_unstreamed_one(step, parallel):
    """The choice cut off after any character (`finish_reason: length`): streamed and unstreamed
    give the same calls and content, and an unclosed call sends nothing of a call."""
    output = TWO_CALLS + "\nDone. "
    for cut in range(len(output) + 1):
        _assert_streamed_as_unstreamed(output[:cut], step, parallel)


# -- Qwen3.5's XML form ------------------------------------------------------------------------------

XML = ToolFormat(xml=True)


def _xml(name: str, **values: str) -> str:
    """A call as Qwen3.5 writes it, each value's text as given."""
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.mark.parametrize("output, content, calls", [
    (_xml("click", x="12", y="40"), None, [("click", {"x": 12, "y": 40})]),
    ("I will click.\n" + _xml("click", x="1", y="2", button="left") + "\n" + _xml("type_text", text="42") + "\nDone.",
     "I will click.\n\n\nDone.", [("click", {"x": 1, "y": 2, "button": "left"}), ("type_text", {"text": "42"})]),
    ("<think>\nA click.\n</think>\n\n" + _xml("type_text", text="two\nlines "), "<think>\nA click.\n</think>",
     [("type_text", {"text": "two\nlines "})]),  # a string as written, newlines in it kept
    (_xml("click", x="one", y="2"), None, [("click", {"x": "one", "y": 2})]),  # not an integer: the text
    (_xml("click", x="1", y="2").replace("</function>\n", ""), None, []),  # malformed: text
    (_xml("click", x="1").replace("<parameter=x>", "oops <parameter=x>"), None, []),  # text between: text
    (_xml("scroll", dy="3"), None, []),  # no such tool: text
    ('<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>', None, []),  # the JSON form
    ("Just an answer.", None, []),
])
def test_the_xml_parser_finds_calls_and_keeps_the_rest_as_text(output, content, calls):
    got_content, got = parse_xml_calls(output, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else output)
    assert len({c.id for c in got}) == len(got)
    for call in got:  # a call renders back as Qwen3.5's template writes it, and parses the same
        assert parse_xml_calls(render_xml_call(call), TOOLS)[1][0].arguments == call.arguments
    assert answer(output, "stop", TOOLS, fmt=XML)[2] == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("text, schema, value", [
    ("12", {"type": "integer"}, 12), ("12", {"type": "string"}, "12"), ("12", None, "12"),  # not in the schema
    ("1.5", {"type": "number"}, 1.5), ("3", {"type": "number"}, 3), ("True", {"type": "boolean"}, True),
    ("null", {"type": ["string", "null"]}, None), ("null", {"type": "string"}, "null"),
    ("none", {"type": ["integer", "null"]}, "none"), ('{"w": 1}', {"type": "object"}, {"w": 1}),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("[1, 2", {"type": "array"}, "[1, 2"),
    ("left", {"enum": ["left", "right"]}, "left"), ("2", {"enum": [1, 2]}, 2), ("7", {"$ref": "#/$defs/n"}, 7),
])
def test_an_xml_parameters_value_is_json_of_its_schemas_type_else_its_text(text, schema, value):
    assert xml_value(text, schema) == value and type(xml_value(text, schema)) is type(value)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_xml_calls_send_the_name_then_the_arguments_whole_when_the_call_closes(step):
    output = "Sure.\n" + _xml("click", x="1", y="2", button="left") + "\n" + _xml("type_text", text="a}<b")
    text, events = ToolText(TOOLS, fmt=XML), []
    for i in range(0, len(output), step):
        events += text.add(output[i:i + step])
    before_end = list(events)
    more, calls = text.end()
    events += more
    content, parsed = parse_xml_calls(output, TOOLS)
    assert "".join(e[1] for e in events if e[0] == "content").strip() == content == "Sure."
    assert [(e[0], e[1]) for e in before_end if e[0] != "content"] == [("call", 0), ("arguments", 0), ("call", 1),
                                                                        ("arguments", 1)]
    assert [e[2].name for e in events if e[0] == "call"] == ["click", "type_text"]
    assert [e[2] for e in events if e[0] == "arguments"] == [c.arguments for c in parsed] == [c.arguments
                                                                                              for c in calls]
    assert json.loads(calls[1].arguments) == {"text": "a}<b"}


@pytest.mark.parametrize("step", [1, 1000])
@pytest.mark.parametrize("output", [_xml("click", x="1").replace("</function>", "</func>"),
                                    _xml("click", x="1", y="2")[:-len("</tool_call>")],  # never closed
                                    "Sure.\n" + _xml("click", x="1", y="2")[:40]])  # cut off by max_tokens
def test_a_malformed_streamed_xml_call_is_content(output, step):
    events, calls = _streamed(output, step, fmt=XML)
    assert not calls and [e for e in events if e[0] != "content"] == []
    assert "".join(e[1] for e in events) == answer(output, "length", TOOLS, fmt=XML)[0] == output


@pytest.mark.parametrize("step", [1, 7])
def test_every_cut_of_a_streamed_xml_answer_agrees_with_the_unstreamed_one(step):
    output = "I will click.\n" + _xml("click", x="1", y="2") + "\n" + _xml("type_text", text="hi") + "\nDone."
    for cut in range(len(output) + 1):
        _assert_streamed_as_unstreamed(output[:cut], step, fmt=XML)


def test_the_xml_grammar_compiles_for_strings_as_written_and_json_values():
    from llguidance import LLMatcher

    grammar = XML.grammar([*TOOLS, SEARCH])
    assert LLMatcher.validate_grammar(grammar) == ""
    assert '"<parameter=button>\\n" (("left\\n</parameter>\\n" | "right\\n</parameter>\\n"))' in grammar
    assert "p_0_0 p_0_1 p_0_2? " in grammar and "p_2_0 p_2_1 p_2_2? p_2_3 " in grammar  # only optional ones optional


# -- bad tool input, refused the same over HTTP and gRPC (the request core's checks) ------------------


class _Context:
    """A gRPC context as the adapter uses it."""

    def __init__(self):
        self.code, self.details = None, None

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:50000"

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, md):
        pass


def _http(core, body: dict) -> tuple[int, str]:
    """(status, error message) of a chat completion posted to the HTTP adapter."""
    import asyncio

    from starlette.requests import Request

    from deployments.api.openai_api import OpenAIAdapter

    data = json.dumps({"max_tokens": 4, **body}).encode()

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [(b"content-length", str(len(data)).encode())]}, receive)
    response = asyncio.run(OpenAIAdapter(core).chat_completions(request))
    return response.status_code, json.loads(response.body).get("error", {}).get("message", "")


def _grpc(core, request) -> tuple[object, str]:
    """(status code, None when answered; details) of a Generate call to the gRPC adapter."""
    import asyncio

    from deployments.api.grpc_api import GrpcAdapter

    ctx = _Context()
    asyncio.run(GrpcAdapter(core).generate(request, ctx))
    return ctx.code, ctx.details or ""


OPENAI_TOOLS = [t.as_openai() for t in TOOLS]
GRPC_TOOLS = [{"name": t.name, "description": t.description, "parameters": t.schema} for t in TOOLS]


def _grpc_conversation(tool_call_id: str):
    from mmserve.rpc.vlm_client import user as grpc_user
    from protos.mmserve.v1 import vlm_pb2

    return [grpc_user("Click OK."),
            vlm_pb2.ChatMessage(role="assistant", tool_calls=[vlm_pb2.ToolCall(id="call_1", name="click",
                                                                               arguments='{"x":5,"y":7}')]),
            vlm_pb2.ChatMessage(role="tool", content=[vlm_pb2.ContentPart(text="clicked")], tool_call_id=tool_call_id)]


@pytest.mark.parametrize("tool_call_id, refused", [
    ("call_1", None), ("call_9", "tool_call_id 'call_9' matches no tool call of an earlier assistant message"),
    ("", "a tool message needs the tool_call_id")], ids=["answers_a_call", "unknown_id", "no_id"])
def test_a_tool_result_must_answer_a_call_of_an_earlier_assistant_message(tiny_checkpoint, tool_call_id, refused):
    import grpc

    from mmserve.rpc.vlm_client import request
    from tests.support.core_fakes import make_core

    core = make_core(tiny_checkpoint("qwen2_vl"))
    tool = {"role": "tool", "content": "clicked", **({"tool_call_id": tool_call_id} if tool_call_id else {})}
    messages = [{"role": "user", "content": "Click OK."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x":5,"y":7}'}}]},
                tool]
    status, message = _http(core, {"messages": messages, "tools": OPENAI_TOOLS})
    code, details = _grpc(core, request(_grpc_conversation(tool_call_id), tools=GRPC_TOOLS, max_tokens=4))
    if refused is None:
        assert (status, message, code) == (200, "", None)
    else:
        assert status == 400 and refused in message and message.startswith("messages[2]: ")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == message


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required", "bad", "click"])
def test_a_tool_whose_parameters_are_no_json_schema_is_refused_whatever_the_tool_choice(tiny_checkpoint,
                                                                                          tool_choice):
    import grpc

    from mmserve.rpc.vlm_client import request, user as grpc_user
    from tests.support.core_fakes import make_core

    core = make_core(tiny_checkpoint("qwen2_vl"))
    choice = tool_choice if tool_choice in ("auto", "none", "required") else {
        "type": "function", "function": {"name": tool_choice}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": BAD_SCHEMA}}
    status, message = _http(core, {"messages": [{"role": "user", "content": "hi"}], "tools": [*OPENAI_TOOLS, bad],
                                   "tool_choice": choice})
    assert status == 400 and message.startswith("tools[2].function.parameters (function 'bad') is not a valid JSON "
                                                "Schema"), message
    assert "Invalid type: nope" in message and "response_format" not in message
    code, details = _grpc(core, request([grpc_user("hi")], tools=[*GRPC_TOOLS, {"name": "bad", "parameters": BAD_SCHEMA}],
                                        tool_choice=tool_choice, max_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == message


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_serves_tools_and_conversations_of_calls(tiny_checkpoint, family):
    """Qwen3.5 (the XML form): tools under every tool_choice and a conversation of calls are served
    over HTTP and gRPC; a call whose arguments are no JSON object cannot be rendered (400)."""
    from mmserve.rpc.vlm_client import request
    from tests.support.core_fakes import make_core

    core = make_core(tiny_checkpoint(family))
    hi = [{"role": "user", "content": "hi"}]
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "click"}}):
        assert _http(core, {"messages": hi, "tools": OPENAI_TOOLS, "tool_choice": choice}) == (200, "")
    conversation = [*hi, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 1, "y": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    assert _http(core, {"messages": conversation, "tools": OPENAI_TOOLS}) == (200, "")
    assert _grpc(core, request(_grpc_conversation("call_1"), tools=GRPC_TOOLS, max_tokens=4)) == (None, "")
    conversation[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    assert _http(core, {"messages": conversation}) == (
        400, "messages[1]: tool call 'call_1': function.arguments must be the JSON text of an object")


def test_a_forced_call_in_the_xml_form_reaches_the_engine_as_its_grammar(tiny_checkpoint):
    from tests.support.core_fakes import FakeLLM, make_core

    llm = FakeLLM()
    core = make_core(tiny_checkpoint("qwen3_5"), llm)
    assert _http(core, {"messages": [{"role": "user", "content": "Type hi."}], "tools": OPENAI_TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "type_text"}}})[0] == 200
    grammar = llm.calls[0].sampling.grammar
    assert grammar.kind == "lark" and '"<function=type_text>\\n"' in grammar.schema and "click" not in grammar.schema


# -- parallel_tool_calls: false under tool_choice auto -------------------------------------------------

TWO_CALLS = ('I will click.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "type_text", "arguments": {"text": "hi"}}\n</tool_call>')


class _Generation(Generation):
    """A `Generation` as the API adapters read it (its `deltas` replaced), whose one choice writes
    `output` (`TWO_CALLS`) and stops, in the tool-call form `fmt`."""

    def __init__(self, parallel: bool, output: str = TWO_CALLS, fmt: ToolFormat = JSON_FORMAT):
        from types import SimpleNamespace

        self.request_id, self.n, self.tools, self.parallel_tool_calls = "r", 1, tuple(TOOLS), parallel
        self.forced_tool_calls = False
        self.tool_format, self.output = fmt, output
        self.sampling = SimpleNamespace(logprobs=None)
        self.plan, self.num_generated = SimpleNamespace(token_ids=[1, 2], num_media_tokens=0), 0

    async def deltas(self):
        for i in range(0, len(self.output), 5):
            yield Delta(self.output[i:i + 5], None, "stop" if i + 5 >= len(self.output) else None)

    def usage(self) -> dict:
        return {}


def _answers(parallel: bool, *form, make=None) -> dict:
    """(content, [(name, arguments)], finish reason) per API path: HTTP whole and streamed, gRPC
    whole and streamed, of `_Generation(parallel, *form)` (or of a new `make()` each)."""
    import asyncio

    from deployments.api import grpc_api, openai_api

    make = make or (lambda: _Generation(parallel, *form))

    async def all_of(chunks):
        return [c async for c in chunks]

    whole = asyncio.run(openai_api.completion(make(), "m", False))["choices"][0]
    content, calls, finish = "", {}, None
    for line in asyncio.run(all_of(openai_api.sse(make(), "m", False, False, None))):
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for piece in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(piece["index"], ["", ""])
                call[0] += piece["function"].get("name") or ""
                call[1] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    unary = asyncio.run(grpc_api.completion(make(), "r"))
    streamed = asyncio.run(all_of(grpc_api.stream(make(), "r")))
    return {
        "http": (whole["message"]["content"], [(c["function"]["name"], c["function"]["arguments"])
                                               for c in whole["message"]["tool_calls"]], whole["finish_reason"]),
        "http stream": (content.strip(), [tuple(calls[i]) for i in sorted(calls)], finish),
        "grpc": (unary.text, [(c.name, c.arguments) for c in unary.tool_calls], unary.finish_reason),
        "grpc stream": ("".join(r.text for r in streamed).strip(), [(c.name, c.arguments)
                                                                     for c in streamed[-1].tool_calls],
                        streamed[-1].finish_reason),
    }


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_parsed_call_under_auto(parallel):
    """vLLM's rule (`maybe_filter_parallel_tool_calls`): the calls after the first are dropped, the
    content stays; the same over every API path."""
    click, type_text = ("click", '{"x": 1, "y": 2}'), ("type_text", '{"text": "hi"}')
    expected = ("I will click.", [click, type_text] if parallel else [click], "tool_calls")
    assert _answers(parallel) == dict.fromkeys(["http", "http stream", "grpc", "grpc stream"], expected)
    content, calls, finish = answer(TWO_CALLS, "stop", TOOLS, parallel)
    assert (content, [c.name for c in calls], finish) == ("I will click.", ["click", "type_text"][:1 + parallel],
                                                         "tool_calls")
    text = ToolText(TOOLS, parallel)
    events = text.add(TWO_CALLS)
    more, streamed = text.end()
    assert {e[1] for e in events + more if e[0] != "content"} == ({0, 1} if parallel else {0})
    assert [c.name for c in streamed] == [c.name for c in calls]


@pytest.mark.parametrize("parallel", [True, False])
def test_xml_calls_are_answered_alike_over_every_api_path(parallel):
    """Qwen3.5's form through the adapters (`Generation.tool_format`): the same content, calls and
    finish reason over HTTP and gRPC, whole and streamed."""
    output = "I will click.\n" + _xml("click", x="1", y="2") + "\n" + _xml("type_text", text="hi")
    click, type_text = ("click", '{"x": 1, "y": 2}'), ("type_text", '{"text": "hi"}')
    expected = ("I will click.", [click, type_text] if parallel else [click], "tool_calls")
    assert _answers(parallel, output, XML) == dict.fromkeys(["http", "http stream", "grpc", "grpc stream"], expected)


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_a_named_tool_choice_sends_the_engine_a_grammar_of_that_function_only(tiny_checkpoint, api):
    """A named function over gRPC (`tool_choice` the name) as over HTTP: the LLM gets the grammar of
    calls to it alone (the engine holds to such a grammar: `test_required_and_named_choices_...`)."""
    from mmserve.rpc.vlm_client import request, user as grpc_user
    from tests.support.core_fakes import FakeLLM, make_core

    llm = FakeLLM()
    core = make_core(tiny_checkpoint("qwen3_vl"), llm)
    if api == "http":
        assert _http(core, {"messages": [{"role": "user", "content": "Type hi."}], "tools": OPENAI_TOOLS,
                            "tool_choice": {"type": "function", "function": {"name": "type_text"}}})[0] == 200
    else:
        assert _grpc(core, request([grpc_user("Type hi.")], tools=GRPC_TOOLS, tool_choice="type_text",
                                   max_tokens=4)) == (None, "")
    grammar = llm.calls[0].sampling.grammar
    assert grammar.kind == "lark" and '\\"name\\": \\"type_text\\"' in grammar.schema
    assert "click" not in grammar.schema and "body: fn_0\n" in grammar.schema  # calls of type_text only


class _Events:
    """An LLM stream of recorded `TokenEvent`s, as a `Generation` reads it."""

    def __init__(self, events):
        self._events = iter(events)

    async def __anext__(self):
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        pass


def _marked_special(model_dir: str, tmp_path) -> str:
    """A copy of `model_dir` whose tokenizer marks `<tool_call>` / `</tool_call>` special."""
    import shutil

    out = shutil.copytree(model_dir, tmp_path / "special_tags")
    for name, entries in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        path = out / name
        data = json.loads(path.read_text())
        tokens = data.get(entries, {})
        for token in tokens.values() if isinstance(tokens, dict) else tokens:
            if token["content"] in ("<tool_call>", "</tool_call>"):
                token["special"] = True
        path.write_text(json.dumps(data))
    return str(out)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_forced_calls_are_found_by_their_tag_ids_whether_the_tokenizer_marks_them_special_or_not(
        tiny_checkpoint, tmp_path, family):
    """The engine's forced calls (required, parallel), answered through the real `Generation`
    (skipping special tokens) and the API paths: the same calls, whole and streamed, over HTTP and
    gRPC, with the released tokenizer's flags (`<tool_call>` plain) and with the tags marked special
    (before, the tags were skipped and the calls came back as content: issue 58)."""
    from transformers import AutoTokenizer

    from types import SimpleNamespace

    from deployments.core.generation import Generation
    from llm_service.sampling import SamplingParams
    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint(family)
    fmt = RequestPlanner(model_dir, AutoTokenizer.from_pretrained(model_dir)).tool_format
    tools = [*TOOLS, SEARCH] if fmt.xml else TOOLS
    engine = make_engine(model_dir)
    collector = Collector()
    collector.add(engine, plan_request(model_dir, user(image(56, 70, 30), text("Click the OK button.")), "r", 800,
                                       grammar=Grammar("lark", fmt.grammar(tools))))
    run_until_done(engine, collector)
    events = collector.events["r"]
    assert events[-1].finish_reason == "stop"
    expected = None
    for checkpoint in (model_dir, _marked_special(model_dir, tmp_path)):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        marked = ToolFormat.of(tokenizer, "xml" if fmt.xml else "json")
        assert (marked.start_id, marked.end_id) == (fmt.start_id, fmt.end_id)
        assert tokenizer.added_tokens_decoder[fmt.start_id].special == (checkpoint != model_dir)
        assert ("<tool_call>" in tokenizer.decode([fmt.start_id], skip_special_tokens=True)) == (checkpoint == model_dir)

        def make():
            plan = SimpleNamespace(token_ids=[0], num_media_tokens=0)
            gen = Generation("r", plan, SamplingParams(800), (), _Events(events[1:]), events[0], tokenizer)
            gen.tools, gen.tool_format = tuple(tools), marked
            return gen

        answers = {path: (content or None, calls, finish)  # gRPC's empty text is HTTP's null content
                   for path, (content, calls, finish) in _answers(True, make=make).items()}
        content, calls, finish = answers["http"]
        assert content is None and calls and finish == "tool_calls", (checkpoint, answers["http"])
        assert answers == dict.fromkeys(answers, answers["http"])
        expected = expected or answers["http"]
        assert answers["http"] == expected  # the same calls either way
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), next(t for t in tools if t.name == name).schema)


# -- forced calls streamed as they are generated ------------------------------------------------------------


def _forced_stream(pieces: list[str], tools, fmt: ToolFormat) -> tuple[list[tuple[int, list[tuple]]], list]:
    """[(delta number, its events)] of `pieces` streamed through a forced `ToolText`, and its calls."""
    text, out = ToolText(tools, True, fmt, forced=True), []
    for k, piece in enumerate(pieces):
        out.append((k, text.add(piece)))
    more, calls = text.end()
    return out + [(len(pieces), more)], calls


def _check_forced(pieces: list[str], tools, fmt: ToolFormat, finish: str) -> list:
    """A forced answer streamed: each call's id and name, then arguments pieces before the delta
    that closes the call (for a call whose arguments span deltas), joined to the unstreamed
    answer's arguments; the same calls, no content, finish reason as unstreamed."""
    text = "".join(pieces)
    streamed, calls = _forced_stream(pieces, tools, fmt)
    content, parsed, reason = answer(text, finish, tools, True, fmt, forced=True)
    assert content is None and [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]
    assert reason == ("tool_calls" if finish == "stop" and parsed else finish)
    events = [(k, e) for k, evs in streamed for e in evs]
    assert not [e for _, e in events if e[0] == "content"]
    for index, call in enumerate(calls):
        mine = [(k, e) for k, e in events if e[1] == index]
        assert mine[0][1][0] == "call" and mine[0][1][2].name == call.name and mine[0][1][2].id == call.id
        assert "".join(e[2] for _, e in mine if e[0] == "arguments") == call.arguments
        closing = max(k for k, _ in mine)
        if len(call.arguments) > 4 and index + 1 < len(calls) or finish == "stop":
            assert any(k < closing for k, e in mine if e[0] == "arguments"), (index, mine)  # sent as they came
    return calls


@pytest.mark.parametrize("step", [1, 5])
@pytest.mark.parametrize("fmt", [JSON_FORMAT, XML], ids=["json", "xml"])
def test_forced_calls_stream_their_arguments_as_they_come_and_join_to_the_whole(fmt, step):
    if fmt.xml:
        output = _xml("click", x="1", y="20", button="left") + "\n" + _xml("type_text", text="hello there")
    else:
        output = ('<tool_call>\n{"name": "click", "arguments": {"x":1,"y":20,"button":"left"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "type_text", "arguments": {"text":"a}\\"b"}}\n</tool_call>')
    calls = _check_forced([output[i:i + step] for i in range(0, len(output), step)], TOOLS, fmt, "stop")
    assert [c.name for c in calls] == ["click", "type_text"]
    assert json.loads(calls[0].arguments) == {"x": 1, "y": 20, "button": "left"}


@pytest.mark.parametrize("fmt", [JSON_FORMAT, XML], ids=["json", "xml"])
def test_a_forced_call_cut_by_max_tokens_ends_with_its_pieces_and_length(fmt):
    whole = _xml("click", x="1", y="20", button="left") if fmt.xml else (
        '<tool_call>\n{"name": "click", "arguments": {"x":1,"y":20,"button":"left"}}\n</tool_call>')
    cut = whole[:whole.index("button") + 3]  # inside the third argument
    calls = _check_forced(list(cut), TOOLS, fmt, "length")
    assert [c.name for c in calls] == ["click"]
    assert calls[0].arguments in ('{"x": 1, "y": 20', '{"x":1,"y":20,"but')  # what was written, as sent


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_the_engines_forced_calls_stream_token_by_token_as_they_are_generated(tiny_checkpoint, family):
    """The engine's forced output (required, parallel calls), detokenized token by token as the
    router does: every call's id and name go out before its arguments, its arguments before it
    closes, joined to the unstreamed answer's; the JSON form (Qwen2.5-VL: the tags are added
    tokens) and the XML form (Qwen3.5)."""
    from transformers import AutoTokenizer

    from mmserve.request.detokenize import IncrementalDetokenizer
    from mmserve.request.prompt_plan import RequestPlanner

    model_dir = tiny_checkpoint(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = RequestPlanner(model_dir, tokenizer).tool_format
    tools = [*TOOLS, SEARCH] if fmt.xml else TOOLS
    [(tokens, reason)] = _run(model_dir, fmt.grammar(tools), {}, n=1)
    detok = IncrementalDetokenizer(tokenizer, markers=fmt.markers())
    pieces = [detok.add(t) for t in tokens] + [detok.flush()]
    assert reason == "stop" and len(_check_forced(pieces, tools, fmt, "stop")) >= 1
