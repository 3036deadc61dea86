"""LoRA adapters served (`lora_modules`): each session app (qwen2_vl, qwen2_5_vl) serves its family's
two `tiny_loras` (the second on the vision tower too: the Encoder applies it, keyed apart from the
base's embeddings); requests naming either, over HTTP (unary and streamed) and gRPC, get `peft`'s
merged model's greedy tokens while requests for the other adapter and the base model run beside
them (one batch); `GET /v1/models` lists the adapters with the served model as their parent; an
adapter reaches the LLM replica as Serve's multiplexed model id."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.conftest import FAMILIES, TINY_ADAPTERS
from tests.serve.test_serve_app import MAX_TOKENS, client, image_case
from tests.support.cases import chat_completion, proto_messages
from tests.support.reference import reference_generate

pytestmark = pytest.mark.serve


@pytest.mark.parametrize("family", FAMILIES)
def test_two_adapters_and_the_base_served_in_one_batch_equal_peft_merged(serve_urls, grpc_target, tiny_models,
                                                                         tiny_loras, family):
    from ray import serve

    ref_messages, api_messages = image_case()
    model_dir, adapters = tiny_models[family], tiny_loras[family]
    expected = {name: reference_generate(model_dir, ref_messages, MAX_TOKENS, adapter=path)
                for name, path in adapters.items()}
    expected[family] = reference_generate(model_dir, ref_messages, MAX_TOKENS)
    assert len(set(map(tuple, expected.values()))) == 3  # each adapter changes the answer
    c = client(serve_urls, family)
    calls = [(model, stream) for model in expected for stream in (False, True)]
    with ThreadPoolExecutor(len(calls)) as pool:  # together: the adapters' and the base's rows share steps
        answers = list(pool.map(lambda call: chat_completion(c, call[0], api_messages, MAX_TOKENS, call[1]), calls))
    assert [tokens for _, tokens in answers] == [expected[model] for model, _ in calls]
    with VLMClient(grpc_target, application=family) as g:
        for name in adapters:
            reply = g.generate(proto_messages(ref_messages), max_tokens=MAX_TOKENS, model=name)
            streamed = [t for r in g.stream(proto_messages(ref_messages), max_tokens=MAX_TOKENS, model=name)
                        for t in r.token_ids]
            assert list(reply.token_ids) == streamed == expected[name], name
    # the router named each adapter as Serve's multiplexed model id: the replica's multiplexed loader ran
    stats = serve.get_deployment_handle("LLM", app_name=family).stats.remote().result()
    assert stats["multiplexed_adapters"] == sorted(adapters)
    # and the tower's adapter (only it) as the Encoder calls' multiplexed model id
    stats = serve.get_deployment_handle("Encoder", app_name=family).stats.remote().result()
    assert stats["multiplexed_adapters"] == ["tiny-lora-b"]


def test_models_lists_the_adapters_and_an_unknown_name_is_a_400(serve_urls, tiny_loras):
    url = serve_urls["qwen2_vl"]
    cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards][1:] == [
        (name, "qwen2_vl", path) for name, path in tiny_loras["qwen2_vl"].items()]
    body = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    names = ", ".join(repr(n) for n in ("qwen2_vl", *TINY_ADAPTERS))
    assert f"model 'no-such-adapter' is not served here; use {names}" in response.text
