"""Router (ingress): OpenAI-compatible HTTP API -> encoder pool + LLM replicas.

Per request: validate, read media headers (never pixels), expand placeholders, compute M-RoPE
positions, dispatch every media item to the encoder without waiting, hand the prompt and the
pending embedding refs to an LLM replica, detokenize the token stream into JSON or SSE.
"""


import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import LimitArgs
from deployments.llm import PendingRequest, root_cause
from deployments.media_fetch import load_url
from deployments.metrics import RouterMetrics
from deployments.protocol import ChatCompletionRequest, ImageURLPart, TextPart
from llm_service.sampling import SamplingParams
from mmserve.checkpoint import read_config
from mmserve.detokenize import IncrementalDetokenizer
from mmserve.errors import InvalidRequest
from mmserve.media import MediaItem, MediaKind
from mmserve.planner import Message, RequestPlan, RequestPlanner

logger = logging.getLogger("ray.serve")
app = FastAPI(title="mmserve", docs_url=None, redoc_url=None)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _describe_validation_error(e: ValidationError) -> str:
    problems = []
    for err in e.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()))
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(problems)


@dataclass(frozen=True)
class RouterSettings:
    model_dir: str
    served_model_name: str
    limits: LimitArgs
    api_key: str | None


@dataclass
class _Accepted:
    """A validated request on its way: the plan, its sampling and the LLM token stream."""

    request_id: str
    body: ChatCompletionRequest
    plan: RequestPlan
    sampling: SamplingParams
    stream: object  # DeploymentResponseGenerator of TokenEvent
    started: float


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, encoder: DeploymentHandle, llm: DeploymentHandle, settings: RouterSettings):
        from transformers import AutoTokenizer, GenerationConfig

        self.encoder = encoder
        self.llm = llm
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
        self.planner = RequestPlanner(settings.model_dir, self.tokenizer, settings.limits.media_limits())
        text_config = read_config(settings.model_dir).get("text_config", {})
        self.max_model_len = int(text_config.get("max_position_embeddings", 32768))
        try:
            self.generation = GenerationConfig.from_pretrained(settings.model_dir)
        except OSError:
            self.generation = GenerationConfig()
        self.metrics = RouterMetrics()
        self.created = int(time.time())

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if denied := self._check_auth(request):
            return denied
        card = {
            "id": self.settings.served_model_name, "object": "model", "created": self.created,
            "owned_by": "mmserve", "root": self.settings.model_dir, "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        if denied := self._check_auth(request):
            return denied
        request_id = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            accepted = await self._accept(request, request_id)
            first = await accepted.stream.__anext__()
        except InvalidRequest as e:
            self.metrics.requests.inc(tags={"outcome": "invalid"})
            logger.info("request %s rejected: %s", request_id, e)
            return _error(400, str(e))
        except Exception as e:
            cause = root_cause(e)
            if isinstance(cause, InvalidRequest):
                self.metrics.requests.inc(tags={"outcome": "invalid"})
                logger.info("request %s rejected: %s", request_id, cause)
                return _error(400, str(cause))
            self.metrics.requests.inc(tags={"outcome": "error"})
            logger.exception("request %s failed", request_id)
            return _error(500, f"internal error: {type(cause).__name__}", "internal_error")
        self.metrics.ttft_ms.observe((time.perf_counter() - accepted.started) * 1000)
        headers = {"x-request-id": request_id}
        if accepted.body.stream:
            return StreamingResponse(
                self._sse(accepted, first), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(await self._complete(accepted, first), headers=headers)

    # -- request intake -------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> Response | None:
        key = self.settings.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return _error(401, "invalid or missing API key", "authentication_error")
        return None

    async def _accept(self, request: Request, request_id: str) -> _Accepted:
        started = time.perf_counter()
        body_bytes = await request.body()
        if len(body_bytes) > self.settings.limits.max_request_bytes:
            raise InvalidRequest(
                f"request body of {len(body_bytes)} bytes exceeds the limit of {self.settings.limits.max_request_bytes}"
            )
        try:
            body = ChatCompletionRequest.model_validate_json(body_bytes)
        except ValidationError as e:
            raise InvalidRequest(_describe_validation_error(e)) from None
        if body.n != 1:
            raise InvalidRequest(f"n={body.n} is not supported; only n=1")
        if body.model and body.model != self.settings.served_model_name:
            raise InvalidRequest(f"model {body.model!r} is not served here; use {self.settings.served_model_name!r}")
        messages = await asyncio.gather(*(self._message(m) for m in body.messages))
        plan = await asyncio.to_thread(self.planner.plan, list(messages))
        sampling = self._sampling(body, len(plan.token_ids))
        refs = [self.encoder.encode.remote(item) for item in plan.items]  # dispatch all, wait for none
        pending = PendingRequest(
            request_id=request_id,
            prompt_token_ids=tuple(plan.token_ids),
            sampling=sampling,
            positions=plan.positions,
            mrope_delta=plan.mrope_delta,
            ranges=tuple(plan.ranges),
            embedding_refs=tuple([await r._to_object_ref() for r in refs]),
        )
        if plan.items:
            self.metrics.media_items.inc(len(plan.items))
        self.metrics.prompt_tokens.inc(len(plan.token_ids))
        logger.info(
            "request %s: %d prompt tokens, %d media items (%d media tokens), max_tokens %d",
            request_id, len(plan.token_ids), len(plan.items), plan.num_media_tokens, sampling.max_tokens,
        )
        stream = self.llm.options(stream=True).generate.remote(pending)
        return _Accepted(request_id, body, plan, sampling, stream, started)

    async def _message(self, message) -> Message:
        if isinstance(message.content, str):
            return Message(message.role, (message.content,))
        parts: list[str | MediaItem] = []
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append(part.text)
            elif isinstance(part, ImageURLPart):
                parts.append(MediaItem(MediaKind.IMAGE, (await load_url(part.image_url.url, self.settings.limits),)))
            else:
                if len(part.video) > self.settings.limits.max_frames_per_video:
                    raise InvalidRequest(
                        f"video has {len(part.video)} frames; the limit is {self.settings.limits.max_frames_per_video}"
                    )
                frames = await asyncio.gather(*(load_url(u, self.settings.limits) for u in part.video))
                parts.append(MediaItem(MediaKind.VIDEO, tuple(frames), fps=part.fps))
        return Message(message.role, tuple(parts))

    def _sampling(self, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        remaining = self.max_model_len - prompt_len
        requested = body.max_completion_tokens or body.max_tokens
        if remaining <= 0 or (requested is not None and requested > remaining):
            raise InvalidRequest(
                f"prompt of {prompt_len} tokens + max_tokens {requested or 1} exceeds the model's context "
                f"of {self.max_model_len} tokens"
            )
        gen = self.generation
        sample_default = bool(gen.do_sample)
        temperature = body.temperature if body.temperature is not None else (
            float(gen.temperature or 1.0) if sample_default else 0.0
        )
        top_p = body.top_p if body.top_p is not None else (float(gen.top_p or 1.0) if sample_default else 1.0)
        top_k = body.top_k if body.top_k is not None else (int(gen.top_k or 0) if sample_default else 0)
        return SamplingParams(
            max_tokens=requested or remaining,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            seed=body.seed,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )

    # -- responses ------------------------------------------------------------------------------
    def _stops(self, body: ChatCompletionRequest) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    async def _events(self, accepted: _Accepted, first) -> AsyncIterator:
        """The LLM's token events, starting with the one already received."""
        yield first
        if first.finish_reason:
            return
        async for event in accepted.stream:
            yield event
            if event.finish_reason:
                return

    async def _deltas(self, accepted: _Accepted, first) -> AsyncIterator[tuple[str, int | None, str | None]]:
        """(text delta, token id, finish reason) triples; ends the LLM stream early on a stop string."""
        detok = IncrementalDetokenizer(self.tokenizer, self._stops(accepted.body))
        try:
            async for event in self._events(accepted, first):
                delta = detok.add(event.token_id) if event.token_id is not None else ""
                if detok.stopped:
                    yield delta, event.token_id, "stop"
                    return
                finish = event.finish_reason
                yield (delta + detok.flush() if finish else delta), event.token_id, finish
        finally:
            accepted.stream.cancel()

    def _usage(self, accepted: _Accepted, completion_tokens: int) -> dict:
        prompt = len(accepted.plan.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"media_tokens": accepted.plan.num_media_tokens},
        }

    def _record(self, accepted: _Accepted, num_tokens: int) -> None:
        elapsed = (time.perf_counter() - accepted.started) * 1000
        if num_tokens > 1:
            self.metrics.tpot_ms.observe(elapsed / num_tokens)
        self.metrics.requests.inc(tags={"outcome": "ok"})

    async def _complete(self, accepted: _Accepted, first) -> dict:
        text, tokens, finish = [], [], None
        async for delta, token_id, finish in self._deltas(accepted, first):
            text.append(delta)
            if token_id is not None:
                tokens.append(token_id)
        self._record(accepted, len(tokens))
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": finish}
        if accepted.body.return_token_ids:
            choice["token_ids"] = tokens
        return {
            "id": accepted.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.settings.served_model_name, "choices": [choice],
            "usage": self._usage(accepted, len(tokens)),
        }

    async def _sse(self, accepted: _Accepted, first) -> AsyncIterator[str]:
        base = {
            "id": accepted.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": self.settings.served_model_name,
        }

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}) + "\n\n"

        yield chunk({"role": "assistant", "content": ""})
        count = 0
        try:
            async for delta, token_id, finish in self._deltas(accepted, first):
                count += token_id is not None
                extra = {}
                if accepted.body.return_token_ids:
                    extra["token_ids"] = [token_id] if token_id is not None else []
                yield chunk({"content": delta} if delta else {}, finish, **extra)
            self._record(accepted, count)
            opts = accepted.body.stream_options
            if opts is not None and opts.include_usage:
                yield "data: " + json.dumps({**base, "choices": [], "usage": self._usage(accepted, count)}) + "\n\n"
        except Exception as e:  # after headers: end with an error event, never a silent cut
            cause = root_cause(e)
            logger.exception("request %s failed mid-stream", accepted.request_id)
            status = 400 if isinstance(cause, InvalidRequest) else 500
            yield "data: " + json.dumps({"error": {"message": str(cause), "code": status}}) + "\n\n"
        yield "data: [DONE]\n\n"

