"""Affinity routing in a real Serve app with two encoder and two LLM replicas (float64): the greedy
tokens equal the single-replica app's, each repeated image is encoded once for the whole cluster
(its owner encodes it, then hits its cache), and requests sharing a prefix go where it went; requests under a LoRA adapter go to the replica
that holds it (Serve's model multiplexing)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.media_factory import data_uri, image_bytes
from tests.support.serve_fixtures import TINY_LORA, _app_args

pytestmark = pytest.mark.serve
APP = "routing"
IMAGES = [data_uri(image_bytes(56 + 8 * i, 48, seed=40 + i)) for i in range(3)]


def _body(image: int | None, question: str) -> dict:
    content = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": IMAGES[image]}})
    messages = [{"role": "system", "content": "You describe images for people who cannot see them."},
                {"role": "user", "content": content}]
    return {"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}


# each image three times, interleaved, and text-only requests: 9 image items, 3 of them first sights
BODIES = [_body(i % 3 if i < 9 else None, f"question {i % 4}") for i in range(12)]


def _tokens(url: str) -> list[list[int]]:
    out = []
    for body in BODIES:
        resp = httpx.post(url, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out.append(resp.json()["choices"][0]["token_ids"])
    return out


def _adapter_replicas(url: str) -> list[list[str]]:
    """Six requests under the adapter, one after another, none sharing a first KV block with another
    (each its own system prompt: no prefix affinity); then each LLM replica's multiplexed adapters."""
    import time

    from ray import serve

    for i in range(6):
        body = {**_body(None, "question"), "model": TINY_LORA}
        body["messages"][0]["content"] = f"{i} {body['messages'][0]['content']}"
        resp = httpx.post(url, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        time.sleep(1.0 if i == 0 else 0.1)  # the first one's replica reports the adapter to the routers
    handle, seen = serve.get_deployment_handle("LLM", app_name=APP), {}
    for _ in range(50):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats["multiplexed_adapters"]
        if len(seen) == 2:
            break
    return sorted(seen.values())


def test_affinity_keeps_tokens_and_encodes_each_image_once_for_the_cluster(serve_ports, serve_urls, tiny_models,
                                                                           tiny_lora):
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.encoder import encoder_stats

    expected = _tokens(serve_urls["qwen2_vl"] + "/v1/chat/completions")  # one encoder, one LLM replica
    group = {"num_replicas": 2, "num_cpus": 0.1}
    args = _app_args(tiny_models["qwen2_vl"], APP, encoder=group, llm=group, routing={"policy": "affinity"},
                     lora_modules={TINY_LORA: tiny_lora})
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        url = f"http://127.0.0.1:{serve_ports[0]}/{APP}/v1/chat/completions"
        got = _tokens(url)
        routed = serve.get_deployment_handle("Router", app_name=APP).routing_stats.remote().result()
        stats = encoder_stats(serve.get_deployment_handle("Encoder", app_name=APP), num_replicas=2)
        # Serve's model multiplexing under the affinity router: every request under the adapter went to
        # the replica that loaded it first (by load alone, 6 in a row on one of two replicas: 1 in 32)
        assert _adapter_replicas(url) == [[], [TINY_LORA]]
    finally:
        serve.delete(APP)
    assert got == expected
    # first sights at their owner (one at a time: never over the bound), repeats where they went
    assert routed["Encoder/owner"] == 3 and routed["Encoder/held"] == 6 and "Encoder/overflow" not in routed
    assert routed["LLM/no_prefix"] == 1 and routed["LLM/prefix_hit"] == 11  # all share the system prompt
    assert len(stats) == 2
    assert sum(s["cache_misses"] for s in stats.values()) == 3  # each image encoded once in the cluster
    assert sum(s["cache_hits"] for s in stats.values()) == 6
