"""The OpenAI-compatible HTTP API as a thin adapter of the request core: the OpenAI wire format
to a `ChatRequest`, a `Generation` to a completion or SSE chunks, failures to status codes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deployments.api.openai_models import (ChatCompletionRequest, ImageURLPart, NamedToolChoice, ResponseFormat,
                                           TextPart, VideoURLPart)
from deployments.deployment_args import RETRY_AFTER_S
from deployments.core.failures import Failure
from deployments.core.generation import SAMPLING_OPTIONS, Delta, Generation, GenerationOptions, response_format
from deployments.core.request_core import ChatRequest, RequestCore, new_request_id
from llm_service.sampling import Grammar
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import MediaKind, MediaSource
from mmserve.request.prompt_plan import Message
from mmserve.request.tools import ToolCall, ToolSpec, finish_with, new_call_id
from mmserve.settings import setting_name
from mmserve.video.container import VideoSampling

logger = logging.getLogger("ray.serve")


def error_response(status: int, message: str, kind: str | None = None) -> JSONResponse:
    kind = kind or ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
                    else "server_error")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None  # busy / overloaded / lost
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status,
                        headers=headers)


def failure_response(failure: Failure) -> JSONResponse:
    return error_response(failure.http_status, failure.message)


async def read_body(request: Request, check_size: Callable[[int], None], timeout_s: float) -> bytes:
    """The body of a Starlette request, refused as soon as `check_size` says it is too large, or when
    it has not all arrived within `timeout_s` (`limits.body_timeout_s`)."""
    length = request.headers.get("content-length", "")
    if length.isdigit():
        check_size(int(length))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                check_size(size)
                chunks.append(chunk)
    except TimeoutError:
        raise InvalidRequest(f"the request body did not arrive within {timeout_s:g} s "
                             f"({size} bytes came; limits.body_timeout_s)") from None
    return b"".join(chunks)


def _location(loc: tuple) -> str:
    """Where a validation error is, as "messages.0.content.1.image_url.url": without the tags
    pydantic inserts for the tagged unions of `ChatMessage.content` and of a content part."""
    loc = list(loc)
    if len(loc) > 3 and loc[2] == "content" and loc[3] in ("text", "parts"):
        del loc[3]
        if len(loc) > 4 and isinstance(loc[3], int) and loc[4] in ("text", "image_url", "video", "video_url"):
            del loc[4]
    return ".".join(str(x) for x in loc)


def parse_body(body: bytes) -> ChatCompletionRequest:
    try:
        request = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        problems = [(_location(tuple(err.get("loc", ()))), err.get("msg")) for err in e.errors()[:3]]
        raise InvalidRequest("invalid request: " + "; ".join(f"{where}: {msg}" if where else str(msg)
                                                             for where, msg in problems)) from None
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    return request


def options(request: ChatCompletionRequest) -> GenerationOptions:
    """The sampling options: `SAMPLING_OPTIONS` pass as they are (by their names in the body; left out
    or null: the default)."""
    given = {f.name: value for f in SAMPLING_OPTIONS if (value := getattr(request, setting_name(f))) is not None}
    return GenerationOptions(**{
        **given,
        "max_tokens": request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens,
        "stop": (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ()),
        "logprobs": (request.top_logprobs or 0) if request.logprobs else None,
        "response_format": _grammar(request.response_format),
    })


def _grammar(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise InvalidRequest("response_format of type json_schema needs its json_schema")
    return response_format(fmt.type, json.dumps(fmt.json_schema.schema_) if fmt.type == "json_schema" else None)


def chat_request(request: ChatCompletionRequest) -> ChatRequest:
    def part(p) -> str | MediaSource:
        if isinstance(p, TextPart):
            return p.text
        if isinstance(p, ImageURLPart):
            return MediaSource(MediaKind.IMAGE, (p.image_url.url,))
        if isinstance(p, VideoURLPart):
            return MediaSource(MediaKind.VIDEO, (p.video_url.url,), container=True)
        return MediaSource(MediaKind.VIDEO, tuple(p.video), fps=p.fps)

    def message(m) -> Message:
        parts = () if m.content is None else (m.content,) if isinstance(m.content, str) else tuple(map(part, m.content))
        calls = tuple(ToolCall(c.id or new_call_id(), c.function.name, c.function.arguments)
                      for c in m.tool_calls or ())
        if m.content is None and not (m.role == "assistant" and calls):
            raise InvalidRequest(f"a {m.role} message needs content (only an assistant's tool calls may stand alone)")
        return Message(m.role, parts, calls, m.tool_call_id)

    tools = tuple(ToolSpec(t.function.name, t.function.description, t.function.parameters)
                  for t in request.tools or ())
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    elif choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools")
    kwargs = request.mm_processor_kwargs
    sampling = None if kwargs is None else VideoSampling(kwargs.fps, kwargs.num_frames)
    return ChatRequest(tuple(message(m) for m in request.messages), options(request), request.model, tools, choice,
                       request.parallel_tool_calls, sampling)


MIN_LOGPROB = -9999.0  # what a token the grammar forbids reports (-inf is no JSON number), as vLLM


def _logprob_entry(gen: Generation, delta: Delta) -> dict:
    """OpenAI's `logprobs.content[i]` for one generated token."""

    def entry(token_id: int, logprob: float) -> dict:
        text = gen.token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}

    return {**entry(delta.token_id, delta.logprob),
            "top_logprobs": [entry(t, lp) for t, lp in delta.top_logprobs or ()]}


async def completion(gen: Generation, model: str, with_token_ids: bool) -> dict:
    choices = []
    for i, (text, finish, deltas) in enumerate(await gen.choices()):
        tokens = [d for d in deltas if d.token_id is not None]
        content, calls, finish = gen.answer(text, finish)  # tool calls parsed out when the request has tools
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        choice = {"index": i, "message": message, "finish_reason": finish}
        if gen.sampling.logprobs is not None:
            choice["logprobs"] = {"content": [_logprob_entry(gen, d) for d in tokens if d.logprob is not None]}
        if with_token_ids:
            choice["token_ids"] = [d.token_id for d in tokens]
        choices.append(choice)
    return {
        "id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": gen.usage(),
    }


def _tool_delta(event: tuple) -> dict:
    """A `ToolText` event as an OpenAI chunk's delta."""
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "call":
        call = event[2]
        return {"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


async def sse(gen: Generation, model: str, with_token_ids: bool, include_usage: bool,
              on_error: Callable[[Exception], Failure]) -> AsyncIterator[str]:
    """SSE chunks; an error after the headers went out ends the stream with an error event."""
    base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> str:
        return event({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]})

    for i in range(gen.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for delta, pending, calls in gen.tool_deltas():
            extra = {}
            if with_token_ids:
                extra["token_ids"] = [delta.token_id] if delta.token_id is not None else []
            if delta.logprob is not None and delta.token_id is not None:
                extra["logprobs"] = {"content": [_logprob_entry(gen, delta)]}
            if pending is None:  # no tools
                yield chunk(delta.index, {"content": delta.text} if delta.text else {}, delta.finish_reason, **extra)
                continue
            if extra:  # the token ids / logprobs of this delta
                yield chunk(delta.index, {}, None, **extra)
            for piece in pending:  # content; a call's id and name; its arguments, piece by piece
                yield chunk(delta.index, _tool_delta(piece))
            if delta.finish_reason:
                yield chunk(delta.index, {}, finish_with(delta.finish_reason, calls))
        if include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})
    except Exception as e:
        failure = on_error(e)
        yield event({"error": {"message": failure.message, "code": failure.http_status}})
    yield "data: [DONE]\n\n"


@dataclasses.dataclass
class OpenAIAdapter:
    """The routes' bodies; the Serve deployment's FastAPI routes call these."""

    core: RequestCore

    def health(self) -> Response:
        """200 once ready; 503 with what it waits for before (take me out of rotation), or draining."""
        reason = self.core.unavailable()
        return error_response(503, reason) if reason else Response(status_code=200)

    def models(self, request: Request) -> Response:
        """The served model, once ready (before: 503 with what it waits for)."""
        try:
            self.core.authenticate(request.headers.get("authorization"))
        except Exception as e:
            return failure_response(self.core.failed(e, "-"))
        if reason := self.core.not_ready():
            return error_response(503, reason)
        return JSONResponse({"object": "list", "data": self.core.model_cards()})

    async def chat_completions(self, request: Request) -> Response:
        # the engine and encoders key requests by our own id. The client's x-request-id (or the one
        # Serve's proxy made up) is only logged here; the proxy echoes it in the response headers.
        request_id = new_request_id()
        if given := request.headers.get("x-request-id"):
            logger.info("request %s: x-request-id %r", request_id, given[:128])
        body: ChatCompletionRequest | None = None

        async def read() -> ChatRequest:  # only once admitted: a refused request's body is never read
            nonlocal body
            body = parse_body(await read_body(request, self.core.check_size, self.core.limits.body_timeout_s))
            return chat_request(body)

        name = self.core.args.served_model_name
        try:
            client = request.client.host if request.client else ""  # the peer, as Serve's proxy passes it on
            gen = await self.core.generate(request.headers.get("authorization"), read, request_id, client)
            gen.report_stages = body.return_stage_times
            if not body.stream:
                result = await completion(gen, name, body.return_token_ids)
        except Exception as e:
            return failure_response(self.core.failed(e, request_id))
        if not body.stream:
            self.core.finished(gen)
            return JSONResponse(result)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = sse(gen, name, body.return_token_ids, include_usage, lambda e: self.core.failed(e, request_id))
        return StreamingResponse(self._finished(gen, chunks), media_type="text/event-stream")

    async def _finished(self, gen: Generation, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        async for chunk in chunks:
            yield chunk
        self.core.finished(gen)
