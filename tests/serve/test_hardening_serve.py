"""Bad input against the running app, over HTTP and gRPC: each case gets its status and a message
naming the problem, a good request succeeds after it, and no replica restarts. Request ids."""

import concurrent.futures

import grpc
import httpx
import pytest

from mmserve.rpc.vlm_client import VideoFrames, VLMClient, request, user
from protos.mmserve.v1 import vlm_pb2, vlm_pb2_grpc
from tests.support.media_factory import data_uri, image_bytes, png_claiming

pytestmark = pytest.mark.serve
APP = "qwen2_vl"
PNG = image_bytes(32, 32, 5)
HI = [{"role": "user", "content": "hi"}]


def _image_url(url: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}


# name: (body fields, HTTP status, needle in the message)
HTTP_CASES = {
    "local path (off by default)": ({"messages": [_image_url("/etc/passwd")]}, 400, "local file media are disabled"),
    "file URL": ({"messages": [_image_url("file:///etc/passwd")]}, 400, "local file media are disabled"),
    "ftp URL": ({"messages": [_image_url("ftp://example.com/a.png")]}, 400, "unsupported media URL scheme 'ftp'"),
    "gopher URL": ({"messages": [_image_url("gopher://example.com/1")]}, 400, "unsupported media URL scheme 'gopher'"),
    "http URL (off by default)": ({"messages": [_image_url("http://169.254.169.254/latest")]}, 400, "http(s) media URLs are disabled"),
    "truncated base64": ({"messages": [_image_url(data_uri(PNG)[:-3])]}, 400, "invalid base64"),
    "non-image bytes": ({"messages": [_image_url(data_uri(b"hello, world"))]}, 400, "not a recognised image format"),
    "PNG claiming 30000x30000": ({"messages": [_image_url(data_uri(png_claiming(30000, 30000)))]}, 400, "exceeds the limit"),
    "zero-byte image": ({"messages": [_image_url("data:image/png;base64,")]}, 400, "not a recognised image format"),
    "zero-frame video": (
        {"messages": [{"role": "user", "content": [{"type": "video", "video": []}]}]}, 400,
        "messages.0.content.0.video: List should have at least 1 item",
    ),
    "1000 images": (
        {"messages": [{"role": "user", "content": [_image_url(data_uri(PNG))["content"][0]] * 1000}]}, 400,
        "1000 media items; the limit is 4",
    ),
    "bad content part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
        "invalid request: messages.0.content.0.image_url.url: Field required",
    ),
    "seed 2**64": ({"messages": HI, "seed": 2**64}, 400, "seed must be in"),
    "temperature -1": ({"messages": HI, "temperature": -1}, 400, "temperature must be in"),
    "top_p 0": ({"messages": HI, "top_p": 0}, 400, "top_p must be in"),
    "top_k -5": ({"messages": HI, "top_k": -5}, 400, "top_k must be in"),
    "min_p 2": ({"messages": HI, "min_p": 2}, 400, "min_p must be in"),
    "presence_penalty 9": ({"messages": HI, "presence_penalty": 9}, 400, "presence_penalty must be in"),
    "max_tokens 0": ({"messages": HI, "max_tokens": 0}, 400, "max_tokens must be in"),
    "top_logprobs 99": ({"messages": HI, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs must be in"),
    "empty stop string": ({"messages": HI, "stop": [""]}, 400, "stop string"),
    # the tiny model's context is 4,096 tokens: text is capped at 16 characters a token before tokenizing
    "text over max_prompt_chars": ({"messages": [{"role": "user", "content": "ab " * 30000}]}, 413,
                                   "request text has 90000 characters; the limit is 65536"),
    "prompt over the context": ({"messages": [{"role": "user", "content": "hello " * 6000}]}, 400,
                                "tokens, media included; the model's context is 4096 tokens"),
}

def grpc_image(url: str) -> vlm_pb2.ChatMessage:
    return vlm_pb2.ChatMessage(role="user", content=[vlm_pb2.ContentPart(image_url=url), vlm_pb2.ContentPart(text="?")])


def grpc_bytes(data: bytes) -> vlm_pb2.ChatMessage:
    return user("?", images=[data])


# name: (request kwargs, needle); every case is INVALID_ARGUMENT
GRPC_CASES = {
    "local path (off by default)": ({"messages": [grpc_image("/etc/passwd")]}, "local file media are disabled"),
    "file URL": ({"messages": [grpc_image("file:///etc/passwd")]}, "local file media are disabled"),
    "ftp URL": ({"messages": [grpc_image("ftp://example.com/a.png")]}, "unsupported media URL scheme 'ftp'"),
    "truncated base64": ({"messages": [grpc_image(data_uri(PNG)[:-3])]}, "invalid base64"),
    "non-image bytes": ({"messages": [grpc_bytes(b"hello, world")]}, "not a recognised image format"),
    "PNG claiming 30000x30000": ({"messages": [grpc_bytes(png_claiming(30000, 30000))]}, "exceeds the limit"),
    "zero-byte image": ({"messages": [grpc_bytes(b"")]}, "not a recognised image format"),
    "zero-frame video": ({"messages": [user("?", videos=[VideoFrames((), 2.0)])]}, "video has no frames"),
    "1000 images": ({"messages": [user("?", images=[PNG] * 1000)]}, "1000 media items; the limit is 4"),
    "temperature -1": ({"messages": [user("hi")], "temperature": -1.0}, "temperature must be in"),
    "top_p 0": ({"messages": [user("hi")], "top_p": 0.0}, "top_p must be in"),
    "top_k -5": ({"messages": [user("hi")], "top_k": -5}, "top_k must be in"),
    "max_tokens 0": ({"messages": [user("hi")], "max_tokens": 0}, "max_tokens must be in"),
    "empty stop string": ({"messages": [user("hi")], "stop": [""]}, "stop string"),
    "text over max_prompt_chars": ({"messages": [user("ab " * 30000)]}, "request text has 90000 characters"),
    "prompt over the context": ({"messages": [user("hello " * 6000)]}, "the model's context is 4096 tokens"),
}


def _replicas() -> set[str]:
    """Names of the app's live replica actors (a restarted replica comes back under a new name)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#" in a["name"]}


def _http_ok(url: str) -> None:
    ok = httpx.post(url, json={"messages": HI, "max_tokens": 3}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def test_bad_http_requests_get_their_status_and_a_good_one_follows(serve_urls):
    url = serve_urls[APP] + "/v1/chat/completions"
    before = _replicas()
    assert any("#LLM#" in n for n in before) and any("#Encoder#" in n for n in before)
    for name, (body, status, needle) in HTTP_CASES.items():
        resp = httpx.post(url, json={"max_tokens": 4, **body}, timeout=120)
        assert resp.status_code == status, (name, resp.text)
        assert needle in resp.json()["error"]["message"], (name, resp.text)
        _http_ok(url)
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (100 << 20) + b'"}]}'
    resp = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=120)
    assert resp.status_code == 413 and "exceeds the limit of 67108864 bytes" in resp.json()["error"]["message"]
    _http_ok(url)
    assert _replicas() == before


def test_bad_grpc_requests_are_invalid_argument_and_a_good_one_follows(grpc_target):
    before = _replicas()
    channel = grpc.insecure_channel(grpc_target)
    stub = vlm_pb2_grpc.VLMServiceStub(channel)
    metadata = (("application", APP),)

    def call(req):
        return stub.Generate(req, metadata=metadata, timeout=120)

    try:
        for name, (kw, needle) in GRPC_CASES.items():
            with pytest.raises(grpc.RpcError) as e:
                call(request(request_id=f"bad-{len(name)}", **kw))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
            assert needle in e.value.details(), (name, e.value.details())
            assert call(request([user("hi")], max_tokens=3)).usage.completion_tokens >= 1
        with pytest.raises(grpc.RpcError) as e:
            call(request([user("?", images=[b"\0" * (100 << 20)])]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in e.value.details()
        assert call(request([user("hi")], max_tokens=3)).usage.completion_tokens >= 1
    finally:
        channel.close()
    assert _replicas() == before


def test_two_concurrent_requests_with_the_same_request_id_both_succeed(serve_urls, grpc_target):
    url = serve_urls[APP] + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "tell a story"}], "max_tokens": 48, "ignore_eos": True}

    def http_call(_):
        return httpx.post(url, json=body, headers={"x-request-id": "same-id"}, timeout=120)

    def grpc_call(_):
        with VLMClient(grpc_target, application=APP) as c:
            return c.generate([user("tell a story")], max_tokens=48, ignore_eos=True, request_id="same-id")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        http_results = list(pool.map(http_call, range(2)))
        grpc_results = list(pool.map(grpc_call, range(2)))
    for resp in http_results:
        assert resp.status_code == 200, resp.text
        # Serve's proxy echoes the client's id (once); the engine keyed the request by the router's own
        assert resp.headers.get_list("x-request-id") == ["same-id"]
        assert resp.json()["usage"]["completion_tokens"] == 48
    assert len({r.json()["id"] for r in http_results}) == 2  # keyed by the router's own ids
    for reply in grpc_results:
        assert reply.request_id == "same-id" and reply.usage.completion_tokens == 48
