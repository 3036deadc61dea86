"""OpenAI wire format <-> the app's protocol-neutral request and generation."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deployments.config import RETRY_AFTER_S, LimitArgs
from deployments.generation import Delta, Generation, GenerationOptions
from deployments.media_fetch import MediaFetcher
from deployments.protocol import ChatCompletionRequest, ImageURLPart, TextPart
from mmserve.errors import InvalidRequest, RequestTooLarge
from mmserve.media import MediaItem, MediaKind
from mmserve.planner import Message


def error_response(status: int, message: str, kind: str | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None  # busy / overloaded / lost
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status,
                        headers=headers)


async def read_body(request, limits: LimitArgs) -> bytes:
    """The body of a Starlette request, refused (413) as soon as it is known to be over the limit."""
    limit = limits.max_request_bytes
    too_large = RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _location(loc: tuple) -> str:
    """Where a validation error is, as "messages.0.content.1.image_url.url": without the tags
    pydantic inserts for the tagged unions of `ChatMessage.content` and of a content part."""
    loc = list(loc)
    if len(loc) > 3 and loc[2] == "content" and loc[3] in ("text", "parts"):
        del loc[3]
        if len(loc) > 4 and isinstance(loc[3], int) and loc[4] in ("text", "image_url", "video"):
            del loc[4]
    return ".".join(str(x) for x in loc)


def parse_body(body: bytes, limits: LimitArgs) -> ChatCompletionRequest:
    if len(body) > limits.max_request_bytes:
        raise RequestTooLarge(f"request body of {len(body)} bytes exceeds the limit of {limits.max_request_bytes}")
    try:
        request = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        problems = []
        for err in e.errors()[:3]:
            where = _location(tuple(err.get("loc", ())))
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        raise InvalidRequest("invalid request: " + "; ".join(problems)) from None
    if request.n != 1:
        raise InvalidRequest(f"n={request.n} is not supported; only n=1")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    return request


def options(request: ChatCompletionRequest) -> GenerationOptions:
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return GenerationOptions(
        max_tokens=request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        seed=request.seed,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )


def _logprob_entry(gen: Generation, delta: Delta) -> dict:
    """OpenAI's `logprobs.content[i]` for one generated token."""

    def entry(token_id: int, logprob: float) -> dict:
        text = gen.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(delta.token_id, delta.logprob),
            "top_logprobs": [entry(t, lp) for t, lp in delta.top_logprobs or ()]}


def _check_media_counts(request: ChatCompletionRequest, limits: LimitArgs) -> None:
    """Item and frame limits, checked before any URL is loaded."""
    parts = [p for m in request.messages if not isinstance(m.content, str) for p in m.content]
    media = [p for p in parts if not isinstance(p, TextPart)]
    if len(media) > limits.max_items_per_request:
        raise InvalidRequest(f"request has {len(media)} media items; the limit is {limits.max_items_per_request}")
    for part in media:
        if not isinstance(part, ImageURLPart) and len(part.video) > limits.max_frames_per_video:
            raise InvalidRequest(f"video has {len(part.video)} frames; the limit is {limits.max_frames_per_video}")


async def messages(request: ChatCompletionRequest, limits: LimitArgs) -> list[Message]:
    """Messages with every media URL loaded into bytes (limits on counts checked first)."""
    _check_media_counts(request, limits)
    fetcher = MediaFetcher(limits)

    async def convert(message) -> Message:
        if isinstance(message.content, str):
            return Message(message.role, (message.content,))
        parts: list[str | MediaItem] = []
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append(part.text)
            elif isinstance(part, ImageURLPart):
                parts.append(MediaItem(MediaKind.IMAGE, (await fetcher.load(part.image_url.url),)))
            else:
                frames = await asyncio.gather(*(fetcher.load(u) for u in part.video))
                parts.append(MediaItem(MediaKind.VIDEO, tuple(frames), fps=part.fps))
        return Message(message.role, tuple(parts))

    return list(await asyncio.gather(*(convert(m) for m in request.messages)))


async def completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    text, tokens, logprobs, finish = [], [], [], None
    async for delta in gen.deltas():
        text.append(delta.text)
        if delta.token_id is not None:
            tokens.append(delta.token_id)
            if delta.logprob is not None:
                logprobs.append(_logprob_entry(gen, delta))
        finish = delta.finish_reason
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": finish}
    if gen.sampling.logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    if with_token_ids:
        choice["token_ids"] = tokens
    return {
        "id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [choice], "usage": gen.usage(),
    }


async def sse(gen: Generation, model: str, with_token_ids: bool, include_usage: bool,
              on_error) -> AsyncIterator[str]:
    """SSE chunks; an error after the headers went out ends the stream with an error event."""
    base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for delta in gen.deltas():
            extra = {}
            if with_token_ids:
                extra["token_ids"] = [delta.token_id] if delta.token_id is not None else []
            if delta.logprob is not None and delta.token_id is not None:
                extra["logprobs"] = {"content": [_logprob_entry(gen, delta)]}
            yield chunk({"content": delta.text} if delta.text else {}, delta.finish_reason, **extra)
        if include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})
    except Exception as e:
        status, message = on_error(e)
        yield event({"error": {"message": message, "code": status}})
    yield "data: [DONE]\n\n"
