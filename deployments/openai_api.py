"""OpenAI wire format <-> the app's protocol-neutral request and generation."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deployments.config import LimitArgs
from deployments.generation import Delta, Generation, GenerationOptions
from deployments.media_fetch import load_url
from deployments.protocol import ChatCompletionRequest, ImageURLPart, TextPart
from mmserve.errors import InvalidRequest
from mmserve.media import MediaItem, MediaKind
from mmserve.planner import Message


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def parse_body(body: bytes, limits: LimitArgs) -> ChatCompletionRequest:
    if len(body) > limits.max_request_bytes:
        raise InvalidRequest(f"request body of {len(body)} bytes exceeds the limit of {limits.max_request_bytes}")
    try:
        request = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        problems = []
        for err in e.errors()[:3]:
            where = ".".join(str(x) for x in err.get("loc", ()))
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
        max_tokens=request.max_completion_tokens or request.max_tokens,
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


async def messages(request: ChatCompletionRequest, limits: LimitArgs) -> list[Message]:
    """Messages with every media URL loaded into bytes."""

    async def convert(message) -> Message:
        if isinstance(message.content, str):
            return Message(message.role, (message.content,))
        parts: list[str | MediaItem] = []
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append(part.text)
            elif isinstance(part, ImageURLPart):
                parts.append(MediaItem(MediaKind.IMAGE, (await load_url(part.image_url.url, limits),)))
            else:
                if len(part.video) > limits.max_frames_per_video:
                    raise InvalidRequest(
                        f"video has {len(part.video)} frames; the limit is {limits.max_frames_per_video}"
                    )
                frames = await asyncio.gather(*(load_url(u, limits) for u in part.video))
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
