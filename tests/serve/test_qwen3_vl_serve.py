"""Qwen3-VL through the Serve app == `transformers` monolithic `generate` (float64): the openai
client (streaming == non-streaming), the public gRPC API, and both embedding transports; an
item's DeepStack parts cross `object_store` (Ray) bit for bit."""

import pytest
import torch

from mmserve.rpc.vlm_client import VLMClient
from tests.support.cases import openai_chat
from tests.support.pipeline import runtimes, to_planner_messages
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args
from tests.serve.test_video_url_serve import decoder_stats
from tests.serve.test_grpc_serve import proto_messages
from tests.families.test_qwen3_vl import CASES, MAX_TOKENS

APPS = {"qwen3_vl": {}, "qwen3_vl_grpc": {"transport": "grpc", "video_decode": {"stream": False}}}

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def qwen3_apps(serve_ports, qwen3_dir):
    """{name: base URL}: one app per embedding transport on the session's Serve instance."""
    from ray import serve

    from deployments.serve.app import build_app

    for name, extra in APPS.items():
        serve.run(build_app(_app_args(qwen3_dir, name, **extra)), name=name, route_prefix=f"/{name}")
    try:
        yield {name: f"http://127.0.0.1:{serve_ports[0]}/{name}" for name in APPS}
    finally:
        for name in APPS:
            serve.delete(name)


def _chat(url, name, messages, stream):
    return openai_chat(url, name, messages, MAX_TOKENS, stream)


@pytest.mark.parametrize("case", ["one_image", "video", "image_and_video"])
def test_http_both_transports_and_grpc_equal_monolithic(qwen3_apps, qwen3_dir, serve_ports, case):
    messages = CASES[case]()
    expected = reference_generate(qwen3_dir, messages, MAX_TOKENS)
    text, tokens = _chat(qwen3_apps["qwen3_vl"], "qwen3_vl", messages, stream=False)
    assert tokens == expected
    assert _chat(qwen3_apps["qwen3_vl"], "qwen3_vl", messages, stream=True) == (text, tokens)
    assert _chat(qwen3_apps["qwen3_vl_grpc"], "qwen3_vl_grpc", messages, stream=False) == (text, tokens)
    if case != "image_and_video":  # the gRPC API carries a message's media before its text
        with VLMClient(f"127.0.0.1:{serve_ports[1]}", application="qwen3_vl") as c:
            unary = c.generate(proto_messages(messages), max_tokens=MAX_TOKENS)
            streamed = list(c.stream(proto_messages(messages), max_tokens=MAX_TOKENS))
        assert list(unary.token_ids) == expected and unary.text == text
        assert [t for r in streamed for t in r.token_ids] == expected


def test_deepstack_parts_cross_object_store_bit_identical(serve_ports, qwen3_dir):
    import ray

    planner, encoder, _ = runtimes(qwen3_dir)
    [emb] = encoder.encode(planner.plan(to_planner_messages(CASES["video"]())).media)
    assert len(emb.parts) > 1
    back = ray.get(ray.put(emb))
    assert back.key == emb.key and len(back.parts) == len(emb.parts)
    assert all(torch.equal(b.view(torch.int64), p.view(torch.int64)) for b, p in zip(back.parts, emb.parts))


def test_video_url_equals_monolithic_on_both_transports(qwen3_apps, qwen3_dir, serve_ports):
    """A video file (mp4 `video_url`), decoded and sampled on the server at Qwen3-VL's own rate,
    with the timestamps its processor writes from the sampled frames' numbers: streamed through the
    pipeline (object store app) and not (gRPC app), the same tokens."""
    pytest.importorskip("av")
    from mmserve.rpc.vlm_client import user
    from tests.support.media_factory import video_file
    from tests.serve.test_video_url_serve import QUESTION, reference_messages

    data = video_file(3.4, 10, 56, 84, seed=22)
    ref = reference_messages(data)
    expected = reference_generate(qwen3_dir, ref, MAX_TOKENS)
    for name in APPS:
        before = decoder_stats(name)
        assert _chat(qwen3_apps[name], name, ref, stream=False)[1] == expected, name
        assert decoder_stats(name)["streamed"] - before["streamed"] == (name == "qwen3_vl"), name
    with VLMClient(f"127.0.0.1:{serve_ports[1]}", application="qwen3_vl") as c:
        assert list(c.generate([user(QUESTION, video_files=[data])], max_tokens=MAX_TOKENS).token_ids) == expected
