"""MiniCPM-V 4.6 (hybrid Gated-DeltaNet LM) through the Serve app == `transformers` monolithic
`generate` (float64): the openai client (streaming == non-streaming) over both embedding
transports, and the public gRPC API."""

import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.support.cases import openai_chat
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args
from tests.serve.test_grpc_serve import proto_messages
from tests.families.test_minicpmv import CASES, MAX_TOKENS

APPS = {"minicpmv4_6": {}, "minicpmv4_6_grpc": {"transport": "grpc", "video_decode": {"stream": False}}}

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def minicpmv_apps(serve_ports, minicpmv_dir):
    """{name: base URL}: one app per embedding transport on the session's Serve instance."""
    from ray import serve

    from deployments.serve.app import build_app

    for name, extra in APPS.items():
        serve.run(build_app(_app_args(minicpmv_dir, name, **extra)), name=name, route_prefix=f"/{name}")
    try:
        yield {name: f"http://127.0.0.1:{serve_ports[0]}/{name}" for name in APPS}
    finally:
        for name in APPS:
            serve.delete(name)


def _chat(url, name, messages, stream):
    return openai_chat(url, name, messages, MAX_TOKENS, stream)


@pytest.mark.parametrize("case", list(CASES))
def test_http_both_transports_equal_monolithic(minicpmv_apps, minicpmv_dir, case):
    messages = CASES[case]()
    expected = reference_generate(minicpmv_dir, messages, MAX_TOKENS)
    text, tokens = _chat(minicpmv_apps["minicpmv4_6"], "minicpmv4_6", messages, stream=False)
    assert tokens == expected
    assert _chat(minicpmv_apps["minicpmv4_6"], "minicpmv4_6", messages, stream=True) == (text, tokens)
    if case != "text_only":  # text goes to no encoder: nothing crosses a transport
        assert _chat(minicpmv_apps["minicpmv4_6_grpc"], "minicpmv4_6_grpc", messages, stream=False) == (text, tokens)


def test_grpc_api_equals_monolithic(minicpmv_apps, minicpmv_dir, serve_ports):
    messages = CASES["one_image"]()  # the gRPC API carries a message's media before its text, as here
    expected = reference_generate(minicpmv_dir, messages, MAX_TOKENS)
    with VLMClient(f"127.0.0.1:{serve_ports[1]}", application="minicpmv4_6_grpc") as c:
        unary = c.generate(proto_messages(messages), max_tokens=MAX_TOKENS)
        streamed = list(c.stream(proto_messages(messages), max_tokens=MAX_TOKENS))
    assert list(unary.token_ids) == expected
    assert [t for r in streamed for t in r.token_ids] == expected
    assert "".join(r.text for r in streamed) == unary.text


def test_video_url_equals_monolithic_on_both_transports(minicpmv_apps, minicpmv_dir):
    """A video file, sampled on the server by MiniCPM-V's own rule (1 frame a second): streamed
    through the pipeline (object store app) and not (gRPC app), the same tokens."""
    pytest.importorskip("av")
    from tests.support.media_factory import video_file
    from tests.serve.test_video_url_serve import decoder_stats, reference_messages

    messages = reference_messages(video_file(3.4, 10, 56, 84, seed=23))
    expected = reference_generate(minicpmv_dir, messages, MAX_TOKENS)
    for name in APPS:
        before = decoder_stats(name)
        assert _chat(minicpmv_apps[name], name, messages, stream=False)[1] == expected, name
        assert decoder_stats(name)["streamed"] - before["streamed"] == (name == "minicpmv4_6"), name
