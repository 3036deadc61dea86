"""Tool calls served over HTTP with the `openai` client, an image in the request: `required` and a
named function always give calls whose arguments validate (greedy and sampled), streamed pieces
join to the unstreamed calls, and a whole agent turn (user with an image -> assistant tool call ->
tool result -> an answer under a json_schema) is served; bad tool requests are 400s. Over gRPC:
forced calls validate, greedy and sampled (two seeds), unary and streamed alike; a tool_choice naming
an unknown function is INVALID_ARGUMENT."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.media_factory import data_uri, image_bytes
from tests.support.schemas import CLICK, TOOLS, TYPE

pytestmark = pytest.mark.serve
MAX_TOKENS = 600
OPENAI_TOOLS = [t.as_openai() for t in TOOLS]


def _client(serve_urls) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_urls["qwen2_vl"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(seed: int) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image_bytes(64, 96, seed))}},
        {"type": "text", "text": "Click the OK button on this screen."}]}]


def _check_calls(calls, tools) -> None:
    assert calls
    for call in calls:
        spec = next(t for t in tools if t.name == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec.schema)
        assert call.id.startswith("call_") and call.type == "function"


def _streamed(c, **kw):
    """(content, [(id, name, arguments)], finish reason) of a streamed completion; the arguments
    come in several pieces (those they were generated in, sent when the call closes)."""
    content, calls, finish, pieces = "", {}, None, 0
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] = (piece.function.name if piece.function and piece.function.name else call["name"])
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
                pieces += bool(piece.function and piece.function.arguments)
            finish = choice.finish_reason or finish
    assert pieces > len(calls), "arguments in the pieces they were generated in"
    return content, [(v["id"], v["name"], v["arguments"]) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice, tools", [
    ("required", TOOLS), ({"type": "function", "function": {"name": "type_text"}}, [TYPE])])
def test_forced_calls_validate_and_stream_in_pieces_that_join_to_the_whole(serve_urls, tool_choice, tools):
    c = _client(serve_urls)
    kw = dict(model="qwen2_vl", messages=_messages(40), max_tokens=MAX_TOKENS, tools=OPENAI_TOOLS,
              tool_choice=tool_choice, temperature=0)
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, tools)
    if tools == [TYPE]:  # the named function only
        assert all(t.function.name == "type_text" for t in choice.message.tool_calls)
    content, streamed, finish = _streamed(c, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in streamed] == [(t.function.name, t.function.arguments)
                                                for t in choice.message.tool_calls]
    for seed in range(2):  # sampled
        resp = c.chat.completions.create(**{**kw, "temperature": 1.0, "seed": seed})
        _check_calls(resp.choices[0].message.tool_calls, tools)


def test_parallel_tool_calls_false_makes_one_call(serve_urls):
    resp = _client(serve_urls).chat.completions.create(
        model="qwen2_vl", messages=_messages(41), max_tokens=MAX_TOKENS, tools=OPENAI_TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=3)
    assert len(resp.choices[0].message.tool_calls) == 1


def test_an_agent_turn_with_a_tool_result_then_a_json_answer(serve_urls):
    c = _client(serve_urls)
    first = c.chat.completions.create(model="qwen2_vl", messages=_messages(42), max_tokens=MAX_TOKENS,
                                      tools=OPENAI_TOOLS, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    schema = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
              "additionalProperties": False}
    messages = _messages(42) + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "clicked"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image_bytes(64, 96, 43))}},
                                     {"type": "text", "text": "Is the dialog gone?"}]},
    ]
    answer = c.chat.completions.create(
        model="qwen2_vl", messages=messages, max_tokens=MAX_TOKENS, tools=OPENAI_TOOLS, tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "done", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


@pytest.mark.parametrize("body, needle", [
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "scroll"}}},
     "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tool name"),
    ({"tools": OPENAI_TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "user", "content": None}]}, "needs content"),
    ({"tools": [*OPENAI_TOOLS, {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools[2].function.parameters (function 'bad') is not a valid JSON Schema"),
    ({"tools": OPENAI_TOOLS, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "clicked"}]},
     "tool_call_id 'call_2' matches no tool call"),
])
def test_bad_tool_requests_are_400s_naming_the_problem(serve_urls, body, needle):
    url = serve_urls["qwen2_vl"] + "/v1/chat/completions"
    bad = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body},
                     timeout=60)
    assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text


def test_auto_parses_what_the_model_wrote(serve_urls):
    """With random weights the model rarely calls by itself: whatever it wrote is content or calls,
    and a call is only reported when it parses (checked on recorded outputs in the unit tests)."""
    resp = _client(serve_urls).chat.completions.create(
        model="qwen2_vl", messages=_messages(44), max_tokens=32, tools=OPENAI_TOOLS, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.message.content is not None) or choice.message.tool_calls
    if choice.message.tool_calls:
        _check_calls(choice.message.tool_calls, TOOLS)
    assert CLICK.name in json.dumps(OPENAI_TOOLS)


GRPC_TOOLS = [{"name": t.name, "description": t.description, "parameters": t.schema} for t in TOOLS]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}],
                         ids=["default", "sampled_seed1", "sampled_seed2"])
@pytest.mark.parametrize("tool_choice", ["required", "type_text"])  # any function; the named one
def test_over_grpc_forced_calls_validate_unary_and_streamed(grpc_target, tool_choice, sampling):
    """Greedy (the tiny model's default) and sampled with a seed (reproducible: the streamed calls
    are the unary ones)."""
    from mmserve.rpc.vlm_client import VLMClient, user

    messages = [user("Click the OK button on this screen.", images=[image_bytes(64, 96, 45)])]
    kw = dict(max_tokens=MAX_TOKENS, tools=GRPC_TOOLS, tool_choice=tool_choice, **sampling)
    with VLMClient(grpc_target, application="qwen2_vl") as g:
        unary = g.generate(messages, **kw)
        streamed = list(g.stream(messages, **kw))
    assert unary.finish_reason == "tool_calls" and unary.text == "" and unary.tool_calls
    if tool_choice != "required":
        assert {c.name for c in unary.tool_calls} == {tool_choice}
    for call in unary.tool_calls:
        spec = next(t for t in TOOLS if t.name == call.name)
        jsonschema.validate(json.loads(call.arguments), spec.schema)
    last = streamed[-1]
    assert last.finish_reason == "tool_calls" and "".join(r.text for r in streamed) == ""
    assert [(c.name, c.arguments) for c in last.tool_calls] == [(c.name, c.arguments) for c in unary.tool_calls]


def test_over_grpc_a_tool_choice_naming_an_unknown_function_is_invalid_argument(grpc_target):
    import grpc

    from mmserve.rpc.vlm_client import VLMClient, user

    messages = [user("Scroll down.", images=[image_bytes(64, 96, 46)])]
    kw = dict(max_tokens=8, tools=GRPC_TOOLS, tool_choice="scroll")
    with VLMClient(grpc_target, application="qwen2_vl") as g:
        for call in (lambda: g.generate(messages, **kw), lambda: list(g.stream(messages, **kw))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tool_choice names 'scroll', which is not among the tools" in e.value.details()
