"""Router (ingress): client APIs -> encoder pool + LLM replicas.

`submit` is the whole request flow, whatever API the request came in by: read media headers
(never pixels), expand placeholders, compute M-RoPE positions, dispatch every media item to the
encoder without waiting, hand the prompt and the pending embedding refs to an LLM replica, and
return once the first token (or the first error) is back. The HTTP routes below only translate.
"""

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import openai_api
from deployments.colocated import LocalMedia
from deployments.config import LimitArgs
from deployments.drain import DrainWatch
from deployments.encoder import spread
from deployments.failover import Failover
from deployments.failures import as_invalid_request, classify
from deployments.generation import Generation, GenerationOptions
from deployments.grpc_ingress import GrpcIngress
from deployments.llm import PendingRequest
from deployments.transport import EmbeddingHandle
from deployments.metrics import RouterMetrics
from deployments.replica_env import resolve_model_dir, secret
from llm_service.sampling import SamplingParams
from mmserve.checkpoint import read_config
from mmserve.errors import InvalidRequest, QueueFull, ShuttingDown
from mmserve.media import EncodeItem, MediaItem
from mmserve.planner import Message, RequestPlan, RequestPlanner

logger = logging.getLogger("ray.serve")
app = FastAPI(title="mmserve", docs_url=None, redoc_url=None)


@dataclass(frozen=True)
class RouterSettings:
    model_dir: str | None  # as given (None: the tiny model); `on_node()` resolves it where the replica runs
    served_model_name: str
    limits: LimitArgs
    api_key: str | None
    await_embeddings: bool = False  # True: wait for the encoder before calling the LLM (see AppArgs)
    external_encoder: str | None = None  # host:port of a standalone EncoderService, used instead of `encoder`
    encoder_token: str | None = None
    encoder_tls_ca: str | None = None  # PEM file: reach external_encoder over TLS
    llm_retries: int = 2  # resubmissions of one request after its LLM replica was lost (failover)
    max_pending_requests: int = 16  # admitted requests without a first token yet; more: 429
    api_key_env: str | None = None  # environment variable holding api_key, read on the replica's node
    encoder_token_env: str | None = None  # likewise for encoder_token
    colocated: bool = False  # no encoder: the LLM replica encodes the media it is handed (LocalMedia)

    def on_node(self) -> "RouterSettings":
        """These settings with the model directory and secrets resolved on this node."""
        return replace(
            self,
            model_dir=resolve_model_dir(self.model_dir),
            api_key=secret(self.api_key, self.api_key_env, "api_key_env"),
            encoder_token=secret(self.encoder_token, self.encoder_token_env, "grpc.token_env"),
        )


@serve.deployment
@serve.ingress(app)
class Router(GrpcIngress):
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, settings: RouterSettings):
        from transformers import AutoTokenizer, GenerationConfig

        settings = settings.on_node()
        self.encoder = encoder
        self.llm = llm
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
        self.planner = RequestPlanner(settings.model_dir, self.tokenizer, settings.limits.media_limits())
        text_config = read_config(settings.model_dir).get("text_config", {})
        self.max_model_len = int(text_config.get("max_position_embeddings", 32768))
        try:
            self.generation_defaults = GenerationConfig.from_pretrained(settings.model_dir)
        except OSError:
            self.generation_defaults = GenerationConfig()
        self.metrics = RouterMetrics()
        self.created = int(time.time())
        self._external_client = None  # EncoderClient of settings.external_encoder, made on first use
        self.drain = DrainWatch(serve.get_replica_context().app_name)
        self.before_first_token = 0  # requests admitted here that have no first token yet
        self._failovers = {"resubmits": 0, "resumed_streams": 0, "resumed_tokens": 0, "resumed_with_media": 0,
                           "reencoded_items": 0}

    # -- the request flow ---------------------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self):
        """Admission, before a request's body is even read: 503 while draining, 429 while
        `max_pending_requests` requests wait for their first token. Held until `submit` returns."""
        self.drain.start()
        if self.drain.draining:
            raise ShuttingDown("server is shutting down")
        if self.before_first_token >= self.settings.max_pending_requests:  # bounds TTFT under bursts
            raise QueueFull(f"{self.before_first_token} requests wait for their first token "
                            f"(limit {self.settings.max_pending_requests})")
        self.before_first_token += 1
        try:
            yield
        finally:
            self.before_first_token -= 1

    async def submit(self, messages: list[Message], opts: GenerationOptions, request_id: str) -> Generation:
        """Plan, dispatch and start generating; raises InvalidRequest for anything the client got wrong."""
        started = time.perf_counter()
        try:
            plan = await asyncio.to_thread(self.planner.plan, messages)
            sampling = self._sampling(opts, len(plan.token_ids))
            pending = PendingRequest(
                request_id=request_id,
                prompt_token_ids=tuple(plan.token_ids),
                sampling=sampling,
                positions=plan.positions,
                ranges=tuple(plan.ranges),
                embeddings=await self._encode(plan.media),
            )
            logger.info(
                "request %s: %d prompt tokens, %d media items (%d media tokens), max_tokens %d",
                request_id, len(plan.token_ids), len(plan.items), plan.num_media_tokens, sampling.max_tokens,
            )
            failover = Failover(self.llm, pending, self.settings.llm_retries, self._count_resume,
                                lambda handles, lost: self._reencode(plan, handles, lost))
            stream, first = await failover.start()  # errors surface here, before any response is sent
        except Exception as e:
            invalid = as_invalid_request(e)
            if invalid is None:
                raise
            raise invalid from None
        self.metrics.prompt_tokens.inc(len(plan.token_ids))
        self.metrics.ttft_ms.observe((time.perf_counter() - started) * 1000)
        return Generation(request_id, plan, sampling, opts.stop, stream, first, self.tokenizer, failover.resume)

    def _count_resume(self, continuation: PendingRequest) -> None:
        self.metrics.resubmits.inc()
        self._failovers["resubmits"] += 1
        if sent := continuation.resumed_tokens:
            self.metrics.resumed_tokens.inc(sent)
            self._failovers["resumed_streams"] += 1
            self._failovers["resumed_tokens"] += sent
            self._failovers["resumed_with_media"] += bool(continuation.embeddings)

    def failover_stats(self) -> dict:
        """This replica's failover counters (resubmits, resumed streams, tokens they carried)."""
        return dict(self._failovers)

    async def _encode(self, media: list[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        """Send every item to the encoder at once, waiting for none; one handle per item, in order.

        A large request is split into groups of near-equal tokens, one encoder call each, so Serve
        spreads them over replicas; each replica batches them with other requests' items.
        """
        if not media:
            return ()
        self.metrics.media_items.inc(len(media))
        if self.settings.colocated:
            return tuple(LocalMedia(m) for m in media)
        if self.settings.external_encoder:
            return await self._encode_externally([m.item for m in media])
        groups = spread([m.cost for m in media])  # balanced by encoder cost: one call per group
        responses = [self.encoder.encode.remote([media[i] for i in group]) for group in groups]
        refs = [await r._to_object_ref() for r in responses]
        if self.settings.await_embeddings:  # the alternative hand-off; never fetches the tensors here
            await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        where = {i: EmbeddingHandle(ref, pos) for group, ref in zip(groups, refs) for pos, i in enumerate(group)}
        return tuple(where[i] for i in range(len(media)))

    async def _reencode(self, plan: RequestPlan, handles: tuple[EmbeddingHandle, ...],
                        lost: tuple[int, ...]) -> tuple[EmbeddingHandle, ...]:
        """`handles` with the items at `lost` (their encoder replica died) encoded again."""
        self.metrics.reencoded_items.inc(len(lost))
        self._failovers["reencoded_items"] += len(lost)
        media = plan.media
        new = list(handles)
        for i, handle in zip(lost, await self._encode([media[i] for i in lost])):
            new[i] = handle
        return tuple(new)

    async def _encode_externally(self, items: list[MediaItem]) -> tuple[EmbeddingHandle, ...]:
        """Encode on the standalone encoder; it keeps each result pinned for the LLM to fetch."""
        if self._external_client is None:  # grpc.aio channels belong to the running loop
            from mmserve.encoder_client import EncoderClient

            ca = self.settings.encoder_tls_ca
            self._external_client = EncoderClient(
                self.settings.external_encoder, self.settings.encoder_token,
                root_certificates=Path(ca).read_bytes() if ca else None,
            )
        refs = await asyncio.gather(*(self._external_client.encode_pinned(item) for item in items))
        return tuple(EmbeddingHandle(ref) for ref in refs)

    def _sampling(self, opts: GenerationOptions, prompt_len: int) -> SamplingParams:
        remaining = self.max_model_len - prompt_len
        if remaining <= 0 or (opts.max_tokens is not None and opts.max_tokens > remaining):
            raise InvalidRequest(
                f"prompt of {prompt_len} tokens + max_tokens {opts.max_tokens or 1} exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        gen = self.generation_defaults
        sample = bool(gen.do_sample)  # the checkpoint's defaults apply to what the client left out

        def default(value, model_value, greedy_value):
            if value is not None:
                return value
            return model_value if sample and model_value is not None else greedy_value

        return SamplingParams(
            max_tokens=opts.max_tokens or remaining,
            temperature=float(default(opts.temperature, gen.temperature, 0.0)),
            top_p=float(default(opts.top_p, gen.top_p, 1.0)),
            top_k=max(int(default(opts.top_k, gen.top_k, 0)), 0),
            min_p=float(default(opts.min_p, getattr(gen, "min_p", None), 0.0)),
            # like transformers' generate and vLLM, the checkpoint's repetition penalty applies greedy too
            repetition_penalty=float(opts.repetition_penalty or gen.repetition_penalty or 1.0),
            frequency_penalty=float(opts.frequency_penalty or 0.0),
            presence_penalty=float(opts.presence_penalty or 0.0),
            seed=opts.seed,
            stop_token_ids=frozenset(opts.stop_token_ids),
            ignore_eos=opts.ignore_eos,
            logprobs=opts.logprobs,
        )

    def _record(self, gen: Generation) -> None:
        if (tpot := gen.time_per_output_token_ms) is not None:
            self.metrics.tpot_ms.observe(tpot)
        self.metrics.requests.inc(tags={"outcome": "ok"})

    def _reject(self, e: BaseException, request_id: str) -> tuple[int, str]:
        """(HTTP status, message) for a failed request, counted and logged."""
        failure = classify(e)
        self.metrics.requests.inc(tags={"outcome": failure.kind})
        if failure.kind in ("invalid", "too_large"):
            logger.info("request %s rejected: %s", request_id, failure.message)
        elif failure.kind == "internal":
            logger.error("request %s failed: %r", request_id, e, exc_info=e)
        else:
            logger.warning("request %s failed (%s): %r", request_id, failure.kind, e)
        return failure.http_status, failure.message

    def check_health(self) -> None:
        """Serve's liveness probe (a blocked event loop fails it by timing out): the tokenizer answers."""
        if not self.tokenizer.encode("ok"):
            raise RuntimeError("the router's tokenizer returned no tokens")

    # -- HTTP (OpenAI-compatible) -------------------------------------------------------------
    def _check_auth(self, request: Request) -> Response | None:
        key = self.settings.api_key
        given = request.headers.get("authorization", "")
        if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return openai_api.error_response(401, "invalid or missing API key", "authentication_error")
        return None

    @app.get("/health")
    async def health(self) -> Response:
        self.drain.start()
        return Response(status_code=503 if self.drain.draining else 200)  # draining: take me out of rotation

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
        # the engine and encoders key requests by our own id. The client's x-request-id (or the one
        # Serve's proxy made up) is only logged here; the proxy echoes it in the response headers.
        request_id = uuid.uuid4().hex
        if given := request.headers.get("x-request-id"):
            logger.info("request %s: x-request-id %r", request_id, given[:128])
        name = self.settings.served_model_name
        try:
            with self.admitted():  # a refused request costs next to nothing: its body is not read
                body = openai_api.parse_body(await openai_api.read_body(request, self.settings.limits),
                                             self.settings.limits)
                if body.model and body.model != name:
                    raise InvalidRequest(f"model {body.model!r} is not served here; use {name!r}")
                messages = await openai_api.messages(body, self.settings.limits)
                gen = await self.submit(messages, openai_api.options(body), request_id)
            if not body.stream:
                result = await openai_api.completion(gen, name, body.return_token_ids)
        except Exception as e:
            return openai_api.error_response(*self._reject(e, request_id))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._recorded(gen, openai_api.sse(
                gen, name, body.return_token_ids, include_usage, lambda e: self._reject(e, request_id)
            ))
            return StreamingResponse(chunks, media_type="text/event-stream")
        self._record(gen)
        return JSONResponse(result)

    async def _recorded(self, gen: Generation, chunks):
        async for chunk in chunks:
            yield chunk
        self._record(gen)
