"""gRPC edge without a running app: status codes, API key, protobuf -> request conversion."""

import asyncio
import contextlib

import grpc
import pytest
from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions

from deployments import grpc_api
from deployments.config import LimitArgs
from deployments.grpc_ingress import GrpcIngress
from mmserve.client import VideoFrames, request, user
from mmserve.errors import InvalidRequest
from mmserve.media import MediaKind


@pytest.mark.parametrize("error, code", [
    (InvalidRequest("bad image"), grpc.StatusCode.INVALID_ARGUMENT),
    (serve_exceptions.BackPressureError(num_queued_requests=9, max_queued_requests=8),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (serve_exceptions.DeploymentUnavailableError(deployment_id="LLM"), grpc.StatusCode.UNAVAILABLE),
    (ray_exceptions.ActorDiedError(), grpc.StatusCode.UNAVAILABLE),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (grpc_api.Unauthenticated("no key"), grpc.StatusCode.UNAUTHENTICATED),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_status_codes(error, code):
    assert grpc_api.status_for(error)[0] == code


def test_internal_errors_do_not_leak_messages():
    assert grpc_api.status_for(RuntimeError("secret path /etc/x"))[1] == "internal error: RuntimeError"


def test_conversion_to_messages_and_options():
    req = request([user("what?", images=[b"img"], videos=[VideoFrames((b"f1", b"f2"), 1.0)])],
                  max_tokens=5, temperature=0.0, stop=["x"])
    [message] = asyncio.run(grpc_api.messages(req, LimitArgs()))
    image, video, text = message.parts
    assert (image.kind, image.frames) == (MediaKind.IMAGE, (b"img",))
    assert (video.kind, video.frames, video.fps) == (MediaKind.VIDEO, (b"f1", b"f2"), 1.0)
    assert text == "what?"
    opts = grpc_api.options(req)
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.stop) == (5, 0.0, None, ("x",))


def test_request_over_the_size_limit_is_invalid():
    req = request([user("x", images=[b"\0" * 5000])])
    with pytest.raises(InvalidRequest, match="exceeds the limit of 4096"):
        grpc_api.check_request(req, LimitArgs(max_request_bytes=4096), "m")


class _Settings:
    api_key = "k3y"
    limits = LimitArgs()
    served_model_name = "m"


class _Context:
    def __init__(self, metadata):
        self.metadata, self.code, self.details, self.trailing = metadata, None, None, []

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, md):
        self.trailing = md


class _Router(GrpcIngress):
    settings = _Settings()
    submitted = 0

    def admitted(self):  # the Router's admission control is not under test here
        return contextlib.nullcontext()

    async def submit(self, messages, opts, request_id):
        self.submitted += 1
        raise InvalidRequest("stop here")

    def _reject(self, e, request_id):
        return 400, str(e)


@pytest.mark.parametrize("metadata, code", [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer k3y"),), grpc.StatusCode.INVALID_ARGUMENT),  # got through to submit
])
def test_api_key_is_required_in_metadata(metadata, code):
    router, ctx = _Router(), _Context(metadata)
    reply = asyncio.run(router.Generate(request([user("hi")], request_id="r1"), ctx))
    assert ctx.code == code and reply.request_id == "r1"
    assert ("x-request-id", "r1") in ctx.trailing
    assert router.submitted == (code == grpc.StatusCode.INVALID_ARGUMENT)
