"""gRPC edge without a running app: status codes, API key, protobuf -> request conversion."""

import asyncio

import grpc
import pytest
from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions

from deployments.api import grpc_api
from deployments.api.grpc_api import GrpcAdapter
from deployments.config import LimitArgs
from deployments.core.failures import classify
from mmserve.errors import InvalidRequest, Unauthenticated
from mmserve.inputs.media import MediaKind
from mmserve.rpc.vlm_client import VideoFrames, request, user
from tests.support.core_fakes import FakeLLM, make_core


@pytest.mark.parametrize("error, code", [
    (InvalidRequest("bad image"), grpc.StatusCode.INVALID_ARGUMENT),
    (serve_exceptions.BackPressureError(num_queued_requests=9, max_queued_requests=8),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (serve_exceptions.DeploymentUnavailableError(deployment_id="LLM"), grpc.StatusCode.UNAVAILABLE),
    (ray_exceptions.ActorDiedError(), grpc.StatusCode.UNAVAILABLE),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unauthenticated("no key"), grpc.StatusCode.UNAUTHENTICATED),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_status_codes(error, code):
    assert classify(error).grpc_code == code


def test_internal_errors_do_not_leak_messages():
    assert classify(RuntimeError("secret path /etc/x")).message == "internal error: RuntimeError"


def test_conversion_to_messages_and_options():
    req = request([user("what?", images=[b"img"], videos=[VideoFrames((b"f1", b"f2"), 1.0)])],
                  max_tokens=5, temperature=0.0, stop=["x"])
    [message] = grpc_api.chat_request(req).messages
    image, video, text = message.parts
    assert (image.kind, image.frames) == (MediaKind.IMAGE, (b"img",))
    assert (video.kind, video.frames, video.fps) == (MediaKind.VIDEO, (b"f1", b"f2"), 1.0)
    assert text == "what?"
    opts = grpc_api.options(req)
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.stop) == (5, 0.0, None, ("x",))


class _Context:
    def __init__(self, metadata=()):
        self.metadata, self.code, self.details, self.trailing = metadata, None, None, []

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return "ipv4:127.0.0.1:50000"

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, md):
        self.trailing = md


def test_request_over_the_size_limit_is_invalid(tiny_models):
    req = request([user("x", images=[b"\0" * 5000])])
    adapter, ctx = GrpcAdapter(make_core(tiny_models["qwen2_vl"], limits=LimitArgs(max_request_bytes=4096))), _Context()
    asyncio.run(adapter.generate(req, ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit of 4096" in ctx.details


@pytest.mark.parametrize("metadata, code", [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer k3y"),), None),  # got through: answered
])
def test_api_key_is_required_in_metadata(metadata, code, tiny_models):
    llm = FakeLLM()
    adapter, ctx = GrpcAdapter(make_core(tiny_models["qwen2_vl"], llm, api_key="k3y")), _Context(metadata)
    reply = asyncio.run(adapter.generate(request([user("hi")], request_id="r1", max_tokens=2), ctx))
    assert ctx.code == code and reply.request_id == "r1"
    assert ("x-request-id", "r1") in ctx.trailing
    assert len(llm.calls) == (code is None)
