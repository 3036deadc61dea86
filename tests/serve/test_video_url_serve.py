"""`video_url` through the running app: a video file sent over HTTP (`video_url`, a data: URI) and
gRPC (`video_file` bytes, `video_url`) gives `transformers`' greedy tokens for the frames and
metadata its own loader takes from the file; every bad file gets 400 / INVALID_ARGUMENT naming
the problem, a good request follows each, and no replica restarts. (Qwen3-VL, MiniCPM-V: tests/serve/test_family_serve.py.)"""

import grpc
import httpx
import openai
import pytest

from mmserve.rpc.vlm_client import VLMClient, request, user
from protos.mmserve.v1 import vlm_pb2, vlm_pb2_grpc
from tests.serve.test_hardening_serve import APP, _http_ok, _replicas
from tests.serve.test_serve_app import MAX_TOKENS, chat, client
from tests.support.cases import api_messages
from tests.support.media_factory import data_uri, video_file
from tests.support.reference import reference_generate
from tests.unit.test_video_url import _bad_files

pytestmark = pytest.mark.serve
pytest.importorskip("av")  # the `video` extra: scripts/setup installs it

QUESTION = "What happens in this video?"


def video_url_messages(data: bytes) -> list[dict]:
    return api_messages(reference_messages(data))


def reference_messages(data: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_file", "bytes": data}, {"type": "text", "text": QUESTION}]}]


def decoder_stats(app: str) -> dict:
    """The app's VideoDecoder counters (one replica)."""
    from ray import serve

    return serve.get_deployment_handle("VideoDecoder", app_name=app).stats.remote().result()


@pytest.fixture(scope="module")
def unstreamed_url(serve_ports, tiny_models):
    """A Qwen2.5-VL app that decodes a video whole, then encodes it, then prefills (`stream: false`)."""
    from ray import serve

    from deployments.serve.app import build_app
    from tests.support.serve_fixtures import _app_args

    name = "qwen2_5_vl_unstreamed"
    serve.run(build_app(_app_args(tiny_models["qwen2_5_vl"], name, video_decode={"stream": False})), name=name,
              route_prefix=f"/{name}")
    try:
        yield f"http://127.0.0.1:{serve_ports[0]}/{name}"
    finally:
        serve.delete(name)


def test_video_url_equals_monolithic_over_http_and_grpc(serve_urls, grpc_target, family, tiny_models):
    data = video_file(3.4, 10, 56, 84, seed=21)  # 34 frames at 10 fps: the model samples 6
    expected = reference_generate(tiny_models[family], reference_messages(data), MAX_TOKENS)
    c = client(serve_urls, family)
    before = decoder_stats(family)
    text, tokens = chat(c, video_url_messages(data))
    assert tokens == expected
    assert decoder_stats(family)["streamed"] == before["streamed"] + 1  # streamed through the pipeline
    assert chat(c, video_url_messages(data), stream=True) == (text, tokens)
    with VLMClient(grpc_target, application=family) as g:
        as_file = g.generate([user(QUESTION, video_files=[data])], max_tokens=MAX_TOKENS)
        as_url = vlm_pb2.ChatMessage(role="user", content=[
            vlm_pb2.ContentPart(video_url=data_uri(data, "video/mp4")), vlm_pb2.ContentPart(text=QUESTION)])
        streamed = list(g.stream([as_url], max_tokens=MAX_TOKENS))
    assert list(as_file.token_ids) == expected and as_file.text == text
    assert [t for r in streamed for t in r.token_ids] == expected


def test_bad_video_files_get_400_naming_the_problem_and_a_good_request_follows(serve_urls, grpc_target):
    url = serve_urls[APP] + "/v1/chat/completions"
    good = video_url_messages(video_file(3, 10, 32, 32, seed=7))
    before = _replicas()
    assert any("#VideoDecoder#" in n for n in before)
    channel = grpc.insecure_channel(grpc_target)
    stub = vlm_pb2_grpc.VLMServiceStub(channel)
    try:
        for name, (data, needle) in _bad_files().items():
            resp = httpx.post(url, json={"messages": video_url_messages(data), "max_tokens": 3}, timeout=120)
            assert resp.status_code == 400, (name, resp.text)
            assert _matches(needle, resp.json()["error"]["message"]), (name, resp.text)
            ok = httpx.post(url, json={"messages": good, "max_tokens": 3}, timeout=120)
            assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 6 * 4, (name, ok.text)
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(request([user("?", video_files=[data])], max_tokens=3),
                              metadata=(("application", APP),), timeout=120)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
            assert _matches(needle, e.value.details()), (name, e.value.details())
        _http_ok(url)
    finally:
        channel.close()
    assert _replicas() == before


def _matches(pattern: str, message: str) -> bool:
    import re

    return re.search(pattern, message) is not None


def test_streaming_off_gives_the_same_tokens(unstreamed_url, tiny_models):
    data = video_file(3.4, 10, 56, 84, seed=21)
    expected = reference_generate(tiny_models["qwen2_5_vl"], reference_messages(data), MAX_TOKENS)
    name = "qwen2_5_vl_unstreamed"
    before = decoder_stats(name)
    c = openai.OpenAI(base_url=unstreamed_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = c.chat.completions.create(model=name, messages=video_url_messages(data), max_tokens=MAX_TOKENS,
                                     extra_body={"return_token_ids": True})
    assert resp.choices[0].model_extra["token_ids"] == expected
    after = decoder_stats(name)
    assert after["decoded"] == before["decoded"] + 1 and after["streamed"] == before["streamed"]


@pytest.fixture(scope="module")
def min_frames_url(serve_ports, tiny_models):
    """A Qwen2.5-VL app that streams only videos sampling to 8 frames or more (`stream_min_frames`)."""
    from ray import serve

    from deployments.serve.app import build_app
    from tests.support.serve_fixtures import _app_args

    name = "qwen2_5_vl_min_frames"
    args = _app_args(tiny_models["qwen2_5_vl"], name, video_decode={"stream_group_frames": 2, "stream_min_frames": 8})
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    try:
        yield f"http://127.0.0.1:{serve_ports[0]}/{name}"
    finally:
        serve.delete(name)


def test_only_a_video_of_stream_min_frames_streams_and_tokens_are_the_same(min_frames_url, tiny_models):
    name = "qwen2_5_vl_min_frames"
    c = openai.OpenAI(base_url=min_frames_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # 34 frames at 10 fps sample to 6 (decoded whole), 42 to 8 (streamed; the tests' max_frames_per_video)
    for data, streams in ((video_file(3.4, 10, 56, 84, seed=21), False), (video_file(4.2, 10, 56, 84, seed=22), True)):
        expected = reference_generate(tiny_models["qwen2_5_vl"], reference_messages(data), MAX_TOKENS)
        before = decoder_stats(name)
        resp = c.chat.completions.create(model=name, messages=video_url_messages(data), max_tokens=MAX_TOKENS,
                                         extra_body={"return_token_ids": True})
        assert resp.choices[0].model_extra["token_ids"] == expected
        assert decoder_stats(name)["streamed"] == before["streamed"] + streams


def test_a_client_gone_mid_stream_leaves_no_blocks_and_no_busy_decoder(serve_urls):
    """A streamed video request whose client goes away while the LLM replica holds it waiting for
    frame groups: the replica frees the request's blocks, the decoder's worker is released, and
    the next request is served."""
    import asyncio
    import time

    from ray import serve

    url = serve_urls[APP] + "/v1/chat/completions"
    data = video_file(4, 30, 800, 800, seed=24)  # 120 frames of 800x800 to decode for 8 sampled ones
    body = {"messages": video_url_messages(data), "max_tokens": 3}
    llm = serve.get_deployment_handle("LLM", app_name=APP)

    def in_flight() -> bool:  # in the engine, prefilled up to a frame group that is not in yet
        return llm.stats.remote().result()["num_waiting_media"] > 0

    async def leave_mid_stream() -> bool:
        async with httpx.AsyncClient(timeout=60) as client:
            request = asyncio.ensure_future(client.post(url, json=body))
            while not request.done():
                if await asyncio.to_thread(in_flight):
                    request.cancel()
                    return True
            return False

    assert asyncio.run(leave_mid_stream()), "the request ended before it was seen mid-stream"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats, video = llm.stats.remote().result(), decoder_stats(APP)
        if stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0 and video["running"] == 0:
            break
        time.sleep(0.2)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0, stats
    assert video["running"] == 0, video
    _http_ok(url)
