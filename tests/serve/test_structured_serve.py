"""`response_format` served end to end: with one and two images, over HTTP (streamed and not) and
gRPC, the greedy tokens equal `transformers`' generate under the same library's mask and every
output validates against its schema, the fixed extraction schemas' and generated bounded ones' (both
embedding transports, greedy and sampled, n = 3); the official `openai` client's
`chat.completions.parse` fills a pydantic model with bounds; a bad schema, or one over the compile
deadline, is a 400 (INVALID_ARGUMENT) naming it and the next request succeeds."""

from __future__ import annotations

import itertools
import json
import string
import uuid

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from deployments.core.generation import MAX_SCHEMA_CHARS
from mmserve.rpc.vlm_client import VLMClient, user
from tests.support.cases import chat_completion, image
from tests.support.media_factory import data_uri
from tests.support.reference import reference_constrained
from tests.support.schemas import CHART, INVOICE, features, seeded_schemas

pytestmark = pytest.mark.serve
MAX_TOKENS = 300
SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}


def _client(serve_urls, family) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_urls[family] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _case(seeds: tuple[int, ...], question: str):
    images = [image(56 + 14 * i, 70, seed) for i, seed in enumerate(seeds)]
    ref = [{"role": "user", "content": [*images, {"type": "text", "text": question}]}]
    api = [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_uri(i["bytes"])}}
                                         for i in images), {"type": "text", "text": question}]}]
    return ref, api


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _secured_client(secured_url) -> openai.OpenAI:
    from tests.support.serve_fixtures import TEST_API_KEY

    return openai.OpenAI(base_url=secured_url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("seeds, schema", [((21,), INVOICE), ((22, 23), CHART)], ids=["one_image", "two_images"])
def test_served_json_equals_the_masked_monolithic_model_over_http_and_grpc(serve_urls, grpc_target, family,
                                                                          tiny_models, seeds, schema):
    ref, api = _case(seeds, "Extract the fields as JSON.")
    expected = reference_constrained(tiny_models[family], ref, MAX_TOKENS, schema)
    c = _client(serve_urls, family)
    for stream in (False, True):
        text, tokens = chat_completion(c, family, api, MAX_TOKENS, stream, response_format=_format(schema))
        assert tokens == expected, stream
        jsonschema.validate(json.loads(text), schema)
    with VLMClient(grpc_target, application=family) as g:
        messages = [user("Extract the fields as JSON.", images=[i["bytes"] for i in ref[0]["content"][:-1]])]
        unary = g.generate(messages, max_tokens=MAX_TOKENS, json_schema=schema)
        streamed = list(g.stream(messages, max_tokens=MAX_TOKENS, json_schema=schema))
    assert list(unary.token_ids) == expected == [t for r in streamed for t in r.token_ids]
    assert unary.finish_reason == "stop"
    jsonschema.validate(json.loads(unary.text), schema)


def test_sampled_outputs_are_valid_too(serve_urls):
    _, api = _case((24,), "Extract the invoice.")
    c = _client(serve_urls, "qwen2_vl")
    for seed in range(3):
        resp = c.chat.completions.create(model="qwen2_vl", messages=api, max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=seed, response_format=_format(INVOICE))
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), INVOICE)


class Receipt(BaseModel):
    shop: str = Field(max_length=10)
    items: list[str] = Field(max_length=2)
    total: int = Field(ge=0, le=999)


def test_the_openai_clients_parse_fills_a_pydantic_model(serve_urls):
    _, api = _case((25,), "Read the receipt.")
    c = _client(serve_urls, "qwen2_vl")
    resp = c.chat.completions.parse(model="qwen2_vl", messages=api, max_tokens=MAX_TOKENS, response_format=Receipt)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Receipt) and resp.choices[0].finish_reason == "stop"
    assert len(parsed.shop) <= 10 and len(parsed.items) <= 2 and 0 <= parsed.total <= 999


@pytest.mark.parametrize("response_format, needle", [
    (_format({"type": "objectx"}), "Invalid type: objectx"),
    ({"type": "json_schema"}, "needs its json_schema"),
    ({"type": "xml"}, "response_format"),
])
def test_a_bad_schema_is_a_400_naming_it_and_the_next_request_succeeds(serve_urls, response_format, needle):
    url = serve_urls["qwen2_vl"] + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    bad = httpx.post(url, json={**body, "response_format": response_format}, timeout=60)
    assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text
    ok = httpx.post(url, json={**body, "response_format": _format(CHART)}, timeout=60)
    assert ok.status_code == 200


def test_logprobs_of_a_constrained_answer_are_json_numbers(serve_urls):
    """Under a grammar the top logprobs hold tokens the mask forbids: they read -9999.0, as vLLM's
    (-inf made the unstreamed answer a 500 and the streamed chunks no JSON), streamed or not."""
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:200]}"))

    url = serve_urls["qwen2_vl"] + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Read the chart."}], "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 3, "response_format": _format(CHART)}
    resp = httpx.post(url, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    content = strict(resp.text)["choices"][0]["logprobs"]["content"]
    assert any(top["logprob"] == -9999.0 for entry in content for top in entry["top_logprobs"])
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        chunks = [strict(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def _llm_stats(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("LLM", app_name=app).stats.remote().result()


def test_n_choices_share_the_prompts_blocks_and_each_follows_the_schema(serve_urls, tiny_models):
    """n = 3, greedy: every choice is the masked reference (prompt blocks computed once, the other
    two choices find them cached); usage sums the choices."""
    from deployments.config import AppArgs

    ref, api = _case((26,), "Extract the invoice.")
    expected = reference_constrained(tiny_models["qwen2_vl"], ref, MAX_TOKENS, INVOICE)
    before = _llm_stats("qwen2_vl")["num_cached_tokens"]
    resp = _client(serve_urls, "qwen2_vl").chat.completions.create(
        model="qwen2_vl", messages=api, max_tokens=MAX_TOKENS, n=3, response_format=_format(INVOICE),
        extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.model_extra["token_ids"] == expected and c.finish_reason == "stop" for c in resp.choices), (
        expected, [(c.model_extra["token_ids"], c.finish_reason) for c in resp.choices])
    assert resp.usage.completion_tokens == 3 * len(expected)
    block = AppArgs().engine.block_size
    full_blocks = (resp.usage.prompt_tokens - 1) // block * block
    assert _llm_stats("qwen2_vl")["num_cached_tokens"] - before >= 2 * full_blocks


def test_n_sampled_choices_stream_with_their_index_and_are_reproducible(serve_urls):
    _, api = _case((27,), "Extract the invoice.")
    c = _client(serve_urls, "qwen2_vl")
    kw = dict(model="qwen2_vl", messages=api, max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=5,
              response_format=_format(INVOICE))
    whole = c.chat.completions.create(**kw)
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {ch.index: ch.message.content for ch in whole.choices}  # each choice its own seed, reproducible
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), INVOICE)
    assert len(set(texts.values())) > 1  # seeds differ by choice


def test_over_the_grpc_transport_the_json_is_the_same(secured_url, tiny_models):
    """The secured app's embeddings travel over gRPC (and the router awaits them): same tokens."""
    ref, api = _case((28,), "Extract the invoice.")
    expected = reference_constrained(tiny_models["qwen2_vl"], ref, MAX_TOKENS, INVOICE)
    c = _secured_client(secured_url)
    for stream in (False, True):
        text, tokens = chat_completion(c, "secured", api, MAX_TOKENS, stream, response_format=_format(INVOICE))
        assert tokens == expected
        jsonschema.validate(json.loads(text), INVOICE)


def test_n_choices_over_grpc_unary_and_streamed(grpc_target, tiny_models):
    ref, _ = _case((29,), "Extract the fields as JSON.")
    expected = reference_constrained(tiny_models["qwen2_vl"], ref, MAX_TOKENS, CHART)
    messages = [user("Extract the fields as JSON.", images=[ref[0]["content"][0]["bytes"]])]
    with VLMClient(grpc_target, application="qwen2_vl") as g:
        unary = g.generate(messages, max_tokens=MAX_TOKENS, json_schema=CHART, n=3)
        streamed = list(g.stream(messages, max_tokens=MAX_TOKENS, json_schema=CHART, n=3))
    assert [c.index for c in unary.choices] == [0, 1, 2]
    assert all(list(c.token_ids) == expected and c.finish_reason == "stop" for c in unary.choices)
    assert list(unary.token_ids) == expected and unary.usage.completion_tokens == 3 * len(expected)
    for i in range(3):
        assert [t for r in streamed if r.index == i for t in r.token_ids] == expected
        assert [r.finish_reason for r in streamed if r.index == i and r.finish_reason] == ["stop"]
    assert streamed[-1].usage.completion_tokens == 3 * len(expected)


# bounded schemas of the hypothesis strategy's builder (tests/support/schemas.py), fixed by the seed:
# the first two go with one image, the last two with two; each pair holds every kind `features` names
GENERATED = seeded_schemas(4, seed=44)
KINDS = {"array", "enum", "string", "integer", "boolean", "nested_object", "required", "optional"}


def _sampling(greedy: bool, seed: int) -> dict:
    return {} if greedy else {"temperature": 1.0, "top_p": 0.95, "seed": seed}


def _http_choices(c: openai.OpenAI, model: str, api, schema: dict, stream: bool, **sampling) -> list[tuple]:
    """[(text, finish reason)] of the n = 3 choices of one chat completion, streamed or not."""
    kw = dict(model=model, messages=api, max_tokens=MAX_TOKENS, n=3, response_format=_format(schema), **sampling)
    if not stream:
        return [(ch.message.content, ch.finish_reason)
                for ch in sorted(c.chat.completions.create(**kw).choices, key=lambda ch: ch.index)]
    texts, finishes = {i: "" for i in range(3)}, {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    return [(texts[i], finishes.get(i)) for i in range(3)]


def _grpc_choices(g: VLMClient, messages, schema: dict, stream: bool, **sampling) -> list[tuple]:
    kw = dict(max_tokens=MAX_TOKENS, json_schema=schema, n=3, **sampling)
    if not stream:
        return [(ch.text, ch.finish_reason) for ch in sorted(g.generate(messages, **kw).choices,
                                                             key=lambda ch: ch.index)]
    responses = list(g.stream(messages, **kw))
    return [("".join(r.text for r in responses if r.index == i),
             "/".join(r.finish_reason for r in responses if r.index == i and r.finish_reason)) for i in range(3)]


@pytest.mark.parametrize("images", [1, 2], ids=["one_image", "two_images"])
def test_generated_bounded_schemas_are_valid_over_http_grpc_and_both_transports(serve_urls, grpc_target,
                                                                                secured_url, images):
    """Two generated schemas per case: over HTTP on both embedding transports (the object store's app
    and the secured app's gRPC), streamed and not, and over the gRPC API, unary and streamed; n = 3,
    greedy where the other schema is sampled. Every choice validates and ends with `stop`; greedy
    choices are one text."""
    schemas = GENERATED[2 * images - 2:2 * images]
    assert set().union(*map(features, schemas)) >= KINDS
    ref, api = _case(tuple(40 + 2 * images + i for i in range(images)), "Fill in the form.")
    messages = [user("Fill in the form.", images=[p["bytes"] for p in ref[0]["content"][:-1]])]
    clients = {"qwen2_vl": _client(serve_urls, "qwen2_vl"), "secured": _secured_client(secured_url)}
    with VLMClient(grpc_target, application="qwen2_vl") as g:
        for k, schema in enumerate(schemas):
            for stream in (False, True):
                greedy = stream == bool(k)
                sampling = _sampling(greedy, 50 + 10 * images + k)
                runs = {f"{app} http stream={stream}": _http_choices(c, app, api, schema, stream, **sampling)
                        for app, c in clients.items()}
                runs[f"grpc stream={stream}"] = _grpc_choices(g, messages, schema, stream, **sampling)
                for where, choices in runs.items():
                    where = (where, "greedy" if greedy else "sampled", schema)
                    assert len(choices) == 3 and all(f == "stop" for _, f in choices), (where, choices)
                    for text, _ in choices:
                        jsonschema.validate(json.loads(text), schema)
                    assert not greedy or len({t for t, _ in choices}) == 1, (where, choices)


def _slow_to_compile(tag: str) -> dict:
    """An object of as many optional properties (`true`) as the 64 KiB schema limit holds (~5,000):
    llguidance's compile grows with the square of an object's optional properties (1.3-1.5 s on 2
    loaded CPU cores). `tag` makes its text new (neither cached nor compiling)."""
    names = (n for k in (1, 2, 3) for n in map("".join, itertools.product(string.ascii_lowercase, repeat=k)))
    props, room = {}, MAX_SCHEMA_CHARS - 200 - len(tag)
    for name in names:
        room -= len(name) + 10  # '"name": true, '
        if room < 0:
            break
        props[name] = True
    return {"title": tag, "type": "object", "properties": props, "additionalProperties": False}


def test_a_schema_over_the_compile_deadline_is_a_400_and_the_next_request_succeeds(secured_url, grpc_target):
    """The secured app's compile deadline is `SECURED_COMPILE_TIMEOUT_S`: a schema compiling longer is
    refused naming the deadline (HTTP 400, gRPC INVALID_ARGUMENT; its compile runs on), and a good
    request right after succeeds."""
    from tests.support.serve_fixtures import SECURED_COMPILE_TIMEOUT_S, TEST_API_KEY

    needle = f"took longer than {SECURED_COMPILE_TIMEOUT_S:g} s to compile"
    url = secured_url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {TEST_API_KEY}"}
    body = {"messages": [{"role": "user", "content": "Is it ok?"}], "max_tokens": MAX_TOKENS}
    slow = _slow_to_compile(f"http {uuid.uuid4()}")
    assert len(json.dumps(slow)) <= MAX_SCHEMA_CHARS
    bad = httpx.post(url, json={**body, "response_format": _format(slow)}, headers=headers, timeout=60)
    assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text
    ok = httpx.post(url, json={**body, "response_format": _format(SHORT)}, headers=headers, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop", ok.text
    jsonschema.validate(json.loads(ok.json()["choices"][0]["message"]["content"]), SHORT)
    with VLMClient(grpc_target, api_key=TEST_API_KEY, application="secured") as g:
        messages = [user("Is it ok?")]
        with pytest.raises(grpc.RpcError) as refused:
            g.generate(messages, max_tokens=MAX_TOKENS, json_schema=_slow_to_compile(f"grpc {uuid.uuid4()}"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in refused.value.details()
        answer = g.generate(messages, max_tokens=MAX_TOKENS, json_schema={**SHORT, "title": "grpc"})
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text), SHORT)
