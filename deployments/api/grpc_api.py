"""The public gRPC API (`mmserve.v1.VLMService`, `grpc.health.v1`) as a thin adapter of the
request core: protobuf to a `ChatRequest`, a `Generation` to responses, failures to status codes.

Ray Serve's gRPC proxy (port 9000 by default) deserializes each request with the generated code
and calls the method of the application's ingress deployment that has the RPC's name, passing
the protobuf request and a `RayServegRPCContext` as `grpc_context`; `router.Router`'s methods
of those names call `GrpcAdapter` (`router.grpc_options` registers the services). The proxy
picks the application by the "application" metadata (optional while only one runs).

Errors: the status code and details are set on `grpc_context` and an empty response (carrying
only `request_id`) is returned, so that the trailing metadata with the request id reaches the
client too: the proxy drops trailing metadata of a method that raises. A stream that fails
therefore ends with one such empty response, then the error status.

Message size: the proxy accepts requests up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (env var read
by the proxy, default 2 GiB - 1); the app then rejects requests larger than
`limits.max_request_bytes` (64 MiB by default) with INVALID_ARGUMENT. Clients need no option
to send large images (gRPC clients do not cap what they send).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from deployments.core.generation import Generation, GenerationOptions, client_request_id, response_format
from deployments.core.request_core import ChatRequest, RequestCore, new_request_id
from mmserve.errors import InvalidRequest
from mmserve.video.container import VideoSampling
from mmserve.inputs.media import MediaKind, MediaSource
from mmserve.request.prompt_plan import Message
from mmserve.request.tools import ToolCall, ToolSpec, finish_with, new_call_id
from protos.mmserve.v1 import vlm_pb2

logger = logging.getLogger("ray.serve")
REQUEST_ID_KEY = "x-request-id"
VLM_SERVICE = vlm_pb2.DESCRIPTOR.services_by_name["VLMService"].full_name

def options(request: vlm_pb2.GenerateRequest) -> GenerationOptions:
    """The sampling options: each `SamplingParams` field passes to the `GenerationOptions` field
    of its name (unset optional fields: the model's default); InvalidRequest when out of range."""
    s = request.sampling
    given = {f.name: tuple(getattr(s, f.name)) if f.is_repeated else getattr(s, f.name) for f in s.DESCRIPTOR.fields
             if not f.has_presence or s.HasField(f.name)}
    fmt = request.response_format
    return GenerationOptions(**given, response_format=response_format(fmt.type, fmt.json_schema))


def chat_request(request: vlm_pb2.GenerateRequest) -> ChatRequest:
    def part(i: int, j: int, p: vlm_pb2.ContentPart) -> str | MediaSource:
        kind = p.WhichOneof("part")
        if kind == "text":
            return p.text
        if kind in ("image", "image_url"):
            return MediaSource(MediaKind.IMAGE, (getattr(p, kind),))
        if kind == "video":
            return MediaSource(MediaKind.VIDEO, tuple(p.video.frames), fps=p.video.fps or 2.0)
        if kind in ("video_file", "video_url"):
            return MediaSource(MediaKind.VIDEO, (getattr(p, kind),), container=True)
        raise InvalidRequest(f"messages[{i}].content[{j}]: empty content part")

    def message(i: int, m: vlm_pb2.ChatMessage) -> Message:
        calls = tuple(ToolCall(c.id or new_call_id(), c.name, c.arguments or "{}") for c in m.tool_calls)
        if not m.content and not (m.role == "assistant" and calls):
            raise InvalidRequest(f"messages[{i}]: a {m.role} message needs content (only an assistant's tool calls "
                                 "may stand alone)")
        return Message(m.role, tuple(part(i, j, p) for j, p in enumerate(m.content)), calls, m.tool_call_id or None)

    tools = tuple(ToolSpec(t.name, t.description, _parameters(t)) for t in request.tools)
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    sampling = None
    if request.HasField("mm_processor_kwargs"):
        k = request.mm_processor_kwargs
        sampling = VideoSampling(k.fps if k.HasField("fps") else None,
                                 k.num_frames if k.HasField("num_frames") else None)
    return ChatRequest(tuple(message(i, m) for i, m in enumerate(request.messages)), options(request),
                       request.model or None, tools, choice, parallel, sampling)


def peer_host(peer: str) -> str:
    """The client's address of a gRPC peer ("ipv4:10.0.0.7:50312" -> "10.0.0.7", "ipv6:[::1]:50312" -> "[::1]"):
    its connections are one client (`admission.Admission`'s fairness)."""
    kind, _, address = peer.partition(":")
    return address.rpartition(":")[0] if kind in ("ipv4", "ipv6") else peer


def _parameters(tool: vlm_pb2.Tool) -> dict | None:
    if not tool.parameters:
        return None
    try:
        value = json.loads(tool.parameters)
    except ValueError:
        raise InvalidRequest(f"tool {tool.name}: parameters is not JSON") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"tool {tool.name}: parameters must be a JSON Schema object")
    return value


def _calls(calls) -> list[vlm_pb2.ToolCall]:
    return [vlm_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def usage(gen: Generation) -> vlm_pb2.Usage:
    """The usage message; with `return_stage_times`, `stage_ms` as HTTP's usage.stage_ms."""
    prompt = len(gen.plan.token_ids)
    return vlm_pb2.Usage(
        prompt_tokens=prompt, image_tokens=gen.plan.num_media_tokens,
        completion_tokens=gen.num_generated, total_tokens=prompt + gen.num_generated,
        stage_ms=gen.usage().get("stage_ms", {}),
    )


async def completion(gen: Generation, request_id: str) -> vlm_pb2.GenerateResponse:
    """The whole answer; `request_id` is the id shown to the client (its own, when it sent one).
    With n > 1, every choice in `choices` and choice 0's in the fields."""
    choices = []
    for i, (text, finish, deltas) in enumerate(await gen.choices()):
        content, calls, reason = gen.answer(text, finish or "")
        choices.append(vlm_pb2.GenerateResponse(request_id=request_id, text=content or "", finish_reason=reason,
                                                token_ids=[d.token_id for d in deltas if d.token_id is not None],
                                                tool_calls=_calls(calls), index=i))
    response = vlm_pb2.GenerateResponse()
    response.CopyFrom(choices[0])
    response.usage.CopyFrom(usage(gen))
    if gen.n > 1:
        response.choices.extend(choices)
    return response


async def stream(gen: Generation, request_id: str) -> AsyncIterator[vlm_pb2.GenerateResponse]:
    """One response per delta; the last carries finish_reason and usage (and the tool calls, with
    tools: the content goes out as it comes, a `<tool_call>` block held until it closes: `ToolText`).
    With n > 1 each carries its choice's index, each choice's last its finish_reason, and a last
    response the usage."""
    async for delta, events, calls in gen.tool_deltas():
        content, finish = delta.text, finish_with(delta.finish_reason or "", calls)
        if events is not None:
            content = "".join(e[1] for e in events if e[0] == "content")
        response = vlm_pb2.GenerateResponse(
            request_id=request_id, text=content,
            token_ids=[delta.token_id] if delta.token_id is not None else [],
            finish_reason=finish, tool_calls=_calls(calls), index=delta.index,
        )
        if delta.finish_reason and gen.n == 1:
            response.usage.CopyFrom(usage(gen))
        yield response
    if gen.n > 1:  # every choice has ended: the usage of them all
        yield vlm_pb2.GenerateResponse(request_id=request_id, usage=usage(gen))


@dataclasses.dataclass
class GrpcAdapter:
    """The RPCs' bodies; the Serve deployment's methods of the RPCs' names call these."""

    core: RequestCore

    async def generate(self, request: vlm_pb2.GenerateRequest, grpc_context) -> vlm_pb2.GenerateResponse:
        request_id = new_request_id()
        shown_id = client_request_id(request.request_id, request_id)
        try:
            gen = await self._start(request, request_id, grpc_context)
            response = await completion(gen, shown_id)
        except Exception as e:
            return self._failed(e, request_id, shown_id, grpc_context)
        self.core.finished(gen)
        grpc_context.set_trailing_metadata([(REQUEST_ID_KEY, shown_id)])
        return response

    async def generate_stream(self, request: vlm_pb2.GenerateRequest,
                              grpc_context) -> AsyncIterator[vlm_pb2.GenerateResponse]:
        request_id = new_request_id()
        shown_id = client_request_id(request.request_id, request_id)
        grpc_context.set_trailing_metadata([(REQUEST_ID_KEY, shown_id)])
        try:
            gen = await self._start(request, request_id, grpc_context)
            async for response in stream(gen, shown_id):
                yield response
        except Exception as e:
            yield self._failed(e, request_id, shown_id, grpc_context)
            return
        self.core.finished(gen)

    def check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: SERVING for "" and the VLM service once the app is ready (an LLM replica,
        and an Encoder replica where the app has them, loaded and warm), NOT_SERVING before and
        while it drains before shutdown."""
        if request.service not in ("", VLM_SERVICE):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        status = health_pb2.HealthCheckResponse
        return status(status=status.NOT_SERVING if self.core.unavailable() else status.SERVING)

    async def _start(self, request: vlm_pb2.GenerateRequest, request_id: str, grpc_context) -> Generation:
        async def read() -> ChatRequest:
            self.core.check_size(request.ByteSize())
            return chat_request(request)

        authorization = dict(grpc_context.invocation_metadata()).get("authorization")
        gen = await self.core.generate(authorization, read, request_id, peer_host(grpc_context.peer()))
        gen.report_stages = request.return_stage_times
        return gen

    def _failed(self, e: Exception, request_id: str, shown_id: str, grpc_context) -> vlm_pb2.GenerateResponse:
        failure = self.core.failed(e, request_id)
        grpc_context.set_code(failure.grpc_code)
        grpc_context.set_details(failure.message)
        grpc_context.set_trailing_metadata([(REQUEST_ID_KEY, shown_id)])
        return vlm_pb2.GenerateResponse(request_id=shown_id)
