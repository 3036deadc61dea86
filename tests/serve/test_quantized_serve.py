"""Quantized checkpoints served as published (float64): the tiny Qwen2-VL in Qwen's block-FP8 layout
and the tiny Qwen2.5-VL in AWQ int4, each through its Serve app over HTTP (unary and streamed) and
the public gRPC API (unary and streamed), give `transformers`' greedy tokens on the same checkpoint
dequantized (`tests/support/quantized_reference.py`); `GET /v1/models` names the format. The two
apps start together (`serve.run_many`). (Qwen3-VL's block FP8: its gRPC app in
test_family_serve.py; every format at the engine level: tests/families/test_fp8_block.py,
tests/families/test_quantized_formats.py.)"""

from __future__ import annotations

import httpx
import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.support.cases import CASE_TOKENS, family_cases, openai_chat, proto_messages
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args

pytestmark = pytest.mark.serve
APPS = {"qwen2_vl_fp8": ("qwen2_vl", "fp8-block"), "qwen2_5_vl_awq": ("qwen2_5_vl", "awq")}
CARDS = {"fp8-block": "fp8 (e4m3, 16x16 blocks)", "awq": "awq (int4, groups of 32, zero points)"}  # as read


@pytest.fixture(scope="module")
def quantized_urls(serve_ports, quantized_checkpoint) -> dict[str, str]:
    from ray import serve
    from ray.serve.api import RunTarget

    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready

    serve.run_many([RunTarget(build_app(_app_args(quantized_checkpoint(*spec)[0], name)), name=name,
                              route_prefix=f"/{name}") for name, spec in APPS.items()])
    try:
        for name in APPS:
            wait_until_ready(name)
        yield {name: f"http://127.0.0.1:{serve_ports[0]}/{name}" for name in APPS}
    finally:
        for name in APPS:
            serve.delete(name)


@pytest.mark.parametrize("name", list(APPS))
def test_a_quantized_checkpoint_serves_its_dequantized_tokens(quantized_urls, quantized_checkpoint, serve_ports,
                                                              name):
    family, quantization = APPS[name]
    reference_dir = quantized_checkpoint(family, quantization)[1]
    url, cases, max_tokens = quantized_urls[name], family_cases(family), CASE_TOKENS[family]
    [card] = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert card["quantization"] == CARDS[quantization]
    for case in ("text_only", "one_image"):
        expected = reference_generate(reference_dir, cases[case], max_tokens)
        text, tokens = openai_chat(url, name, cases[case], max_tokens, stream=False)
        assert tokens == expected, case
        assert openai_chat(url, name, cases[case], max_tokens, stream=True) == (text, tokens), case
    with VLMClient(f"127.0.0.1:{serve_ports[1]}", application=name) as c:
        unary = c.generate(proto_messages(cases["one_image"]), max_tokens=max_tokens)
        streamed = [t for r in c.stream(proto_messages(cases["one_image"]), max_tokens=max_tokens) for t in r.token_ids]
    assert list(unary.token_ids) == streamed == reference_generate(reference_dir, cases["one_image"], max_tokens)
