"""Colocated mode (`colocated: true`): LLM replicas that encode in-process give the same greedy
tokens as the disaggregated app (float64, tiny Qwen2-VL)."""

from __future__ import annotations

import pytest

from tests.support.cases import openai_chat
from tests.support.media_factory import image_bytes


def test_colocated_args_refuse_a_remote_encoder():
    from pydantic import ValidationError

    from deployments.config import AppArgs

    assert AppArgs(colocated=True).colocated
    with pytest.raises(ValidationError, match="colocated"):
        AppArgs(colocated=True, transport="grpc")


@pytest.mark.serve
def test_colocated_app_gives_the_disaggregated_greedy_tokens(serve_ports, serve_urls, tiny_models):
    """Against the session's (disaggregated) qwen2_vl app, on the same checkpoint."""
    from ray import serve

    from deployments.serve.app import build_app
    from tests.support.serve_fixtures import _app_args

    text = [{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}]
    image = [{"role": "user", "content": [{"type": "image", "bytes": image_bytes(56, 84, seed=5)},
                                          {"type": "text", "text": "what is this?"}]}]
    calls = ((text, False), (image, True), (image, False))
    app = "colocated"
    serve.run(build_app(_app_args(tiny_models["qwen2_vl"], app, colocated=True)), name=app, route_prefix=f"/{app}")
    try:
        assert "Encoder" not in serve.status().applications[app].deployments
        url = f"http://127.0.0.1:{serve_ports[0]}/{app}"
        colocated = [openai_chat(url, app, messages, 12, stream) for messages, stream in calls]
    finally:
        serve.delete(app)
    disaggregated = [openai_chat(serve_urls["qwen2_vl"], "qwen2_vl", messages, 12, stream) for messages, stream in calls]
    assert all(tokens for _, tokens in disaggregated)
    assert colocated == disaggregated
