"""`mmserve.v1` protobuf <-> the app's protocol-neutral request and generation; gRPC status codes."""

from __future__ import annotations

import asyncio

import grpc

from deployments.config import LimitArgs
from deployments.failures import classify
from deployments.generation import Generation, GenerationOptions
from deployments.media_fetch import MediaFetcher
from mmserve.errors import InvalidRequest, RequestTooLarge
from mmserve.media import MediaItem, MediaKind
from mmserve.planner import Message
from protos.mmserve.v1 import vlm_pb2

ROLES = ("system", "user", "assistant")
REQUEST_ID_KEY = "x-request-id"


class Unauthenticated(Exception):
    """The API key is missing or wrong."""


def status_for(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and client-safe message for an exception raised while serving a request."""
    if isinstance(e, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(e)
    failure = classify(e)
    return failure.grpc_code, failure.message


def check_request(request: vlm_pb2.GenerateRequest, limits: LimitArgs, served_model_name: str) -> None:
    size = request.ByteSize()
    if size > limits.max_request_bytes:
        raise RequestTooLarge(f"request of {size} bytes exceeds the limit of {limits.max_request_bytes}")
    if request.model and request.model != served_model_name:
        raise InvalidRequest(f"model {request.model!r} is not served here; use {served_model_name!r}")
    if not request.messages:
        raise InvalidRequest("messages: at least one message is required")
    parts = [p for m in request.messages for p in m.content]
    media = [p for p in parts if p.WhichOneof("part") in ("image", "image_url", "video")]
    if len(media) > limits.max_items_per_request:
        raise InvalidRequest(f"request has {len(media)} media items; the limit is {limits.max_items_per_request}")
    for p in media:
        if p.WhichOneof("part") == "video" and len(p.video.frames) > limits.max_frames_per_video:
            raise InvalidRequest(f"video has {len(p.video.frames)} frames; the limit is {limits.max_frames_per_video}")


def options(request: vlm_pb2.GenerateRequest) -> GenerationOptions:
    """The request's sampling options; InvalidRequest when one is out of range (`check_options`)."""
    s = request.sampling

    def opt(name: str):
        return getattr(s, name) if s.HasField(name) else None

    return GenerationOptions(
        max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"), top_k=opt("top_k"),
        seed=opt("seed"), stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
    )


async def messages(request: vlm_pb2.GenerateRequest, limits: LimitArgs) -> list[Message]:
    """Messages with every media part as bytes (image URLs loaded under the same rules as HTTP).

    Call `check_request` first: it checks the item and frame limits before anything is loaded.
    """
    fetcher = MediaFetcher(limits)

    async def part(i: int, j: int, p: vlm_pb2.ContentPart) -> str | MediaItem:
        kind = p.WhichOneof("part")
        if kind == "text":
            return p.text
        if kind == "image":
            return MediaItem(MediaKind.IMAGE, (p.image,))
        if kind == "image_url":
            return MediaItem(MediaKind.IMAGE, (await fetcher.load(p.image_url),))
        if kind == "video":
            return MediaItem(MediaKind.VIDEO, tuple(p.video.frames), fps=p.video.fps or 2.0)
        raise InvalidRequest(f"messages[{i}].content[{j}]: empty content part")

    async def message(i: int, m: vlm_pb2.ChatMessage) -> Message:
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.role!r}")
        return Message(m.role, tuple(await asyncio.gather(*(part(i, j, p) for j, p in enumerate(m.content)))))

    return list(await asyncio.gather(*(message(i, m) for i, m in enumerate(request.messages))))


def usage(gen: Generation) -> vlm_pb2.Usage:
    prompt = len(gen.plan.token_ids)
    return vlm_pb2.Usage(
        prompt_tokens=prompt, image_tokens=gen.plan.num_media_tokens,
        completion_tokens=gen.num_generated, total_tokens=prompt + gen.num_generated,
    )


async def completion(gen: Generation, request_id: str) -> vlm_pb2.GenerateResponse:
    """The whole answer; `request_id` is the id shown to the client (its own, when it sent one)."""
    text, tokens, finish = [], [], ""
    async for delta in gen.deltas():
        text.append(delta.text)
        if delta.token_id is not None:
            tokens.append(delta.token_id)
        finish = delta.finish_reason or finish
    return vlm_pb2.GenerateResponse(
        request_id=request_id, text="".join(text), token_ids=tokens, finish_reason=finish, usage=usage(gen),
    )


async def stream(gen: Generation, request_id: str):
    """One response per delta; the last carries finish_reason and usage."""
    async for delta in gen.deltas():
        response = vlm_pb2.GenerateResponse(
            request_id=request_id, text=delta.text,
            token_ids=[delta.token_id] if delta.token_id is not None else [],
            finish_reason=delta.finish_reason or "",
        )
        if delta.finish_reason:
            response.usage.CopyFrom(usage(gen))
        yield response
