"""LoRA adapters served (`lora_modules`): the session's qwen2_vl app serves `tiny_lora` as
`TINY_LORA`; a request naming it, over HTTP (unary and streamed) and gRPC, gets `peft`'s merged
model's greedy tokens while requests for the base model run beside it with the base's, and
`GET /v1/models` lists the adapter with the served model as its parent; the adapter reaches the
LLM replica as Serve's multiplexed model id."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.serve.test_serve_app import MAX_TOKENS, client, image_case
from tests.support.cases import chat_completion, proto_messages
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import TINY_LORA

pytestmark = pytest.mark.serve


def test_an_adapter_and_the_base_served_side_by_side_equal_peft_merged(serve_urls, grpc_target, tiny_models,
                                                                       tiny_lora):
    ref_messages, api_messages = image_case()
    model_dir = tiny_models["qwen2_vl"]
    expected = {TINY_LORA: reference_generate(model_dir, ref_messages, MAX_TOKENS, adapter=tiny_lora),
                "qwen2_vl": reference_generate(model_dir, ref_messages, MAX_TOKENS)}
    assert expected[TINY_LORA] != expected["qwen2_vl"]  # the adapter changes the answer
    c = client(serve_urls, "qwen2_vl")
    calls = [(model, stream) for model in (TINY_LORA, "qwen2_vl") for stream in (False, True)] * 2
    with ThreadPoolExecutor(len(calls)) as pool:  # together: adapter and base rows share steps
        answers = list(pool.map(lambda call: chat_completion(c, call[0], api_messages, MAX_TOKENS, call[1]), calls))
    assert [tokens for _, tokens in answers] == [expected[model] for model, _ in calls]
    # the router named the adapter as Serve's multiplexed model id: the replica's multiplexed loader ran
    from ray import serve

    assert serve.get_deployment_handle("LLM", app_name="qwen2_vl").stats.remote().result()[
        "multiplexed_adapters"] == [TINY_LORA]
    with VLMClient(grpc_target, application="qwen2_vl") as g:
        reply = g.generate(proto_messages(ref_messages), max_tokens=MAX_TOKENS, model=TINY_LORA)
        streamed = [t for r in g.stream(proto_messages(ref_messages), max_tokens=MAX_TOKENS, model=TINY_LORA)
                    for t in r.token_ids]
    assert list(reply.token_ids) == streamed == expected[TINY_LORA]


def test_models_lists_the_adapter_and_an_unknown_name_is_a_400(serve_urls, tiny_lora):
    url = serve_urls["qwen2_vl"]
    cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards][1:] == [(TINY_LORA, "qwen2_vl", tiny_lora)]
    body = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "model 'no-such-adapter' is not served here; use 'qwen2_vl', 'tiny-lora'" in response.text
