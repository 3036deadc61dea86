"""Affinity routing in a real Serve app with two encoder and two LLM replicas (float64): the greedy
tokens equal the single-replica app's, each repeated image is encoded once for the whole cluster
(its owner encodes it, then hits its cache), and requests sharing a prefix go where it went."""

from __future__ import annotations

import httpx
import pytest

from tests.support.media_factory import data_uri, image_bytes
from tests.support.serve_fixtures import _app_args

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


def test_affinity_keeps_tokens_and_encodes_each_image_once_for_the_cluster(serve_ports, serve_urls, tiny_models):
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.encoder import encoder_stats

    expected = _tokens(serve_urls["qwen2_vl"] + "/v1/chat/completions")  # one encoder, one LLM replica
    group = {"num_replicas": 2, "num_cpus": 0.1}
    args = _app_args(tiny_models["qwen2_vl"], APP, encoder=group, llm=group, routing={"policy": "affinity"})
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        got = _tokens(f"http://127.0.0.1:{serve_ports[0]}/{APP}/v1/chat/completions")
        routed = serve.get_deployment_handle("Router", app_name=APP).routing_stats.remote().result()
        stats = encoder_stats(serve.get_deployment_handle("Encoder", app_name=APP), num_replicas=2)
    finally:
        serve.delete(APP)
    assert got == expected
    # first sights at their owner (one at a time: never over the bound), repeats where they went
    assert routed["Encoder/owner"] == 3 and routed["Encoder/held"] == 6 and "Encoder/overflow" not in routed
    assert routed["LLM/no_prefix"] == 1 and routed["LLM/prefix_hit"] == 11  # all share the system prompt
    assert len(stats) == 2
    assert sum(s["cache_misses"] for s in stats.values()) == 3  # each image encoded once in the cluster
    assert sum(s["cache_hits"] for s in stats.values()) == 6
