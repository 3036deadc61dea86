"""LLM deployment: wraps `llm_service`'s engine; streams token events back to the router."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from deployments.config import GrpcArgs
from deployments.encoder import resolve_device
from deployments.metrics import LLMMetrics
from deployments.replica_env import resolve_model_dir
from deployments.transport import EmbeddingHandle, resolve
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine, LLMRequest, TokenEvent
from llm_service.model import LanguageModel
from llm_service.sampling import SamplingParams
from mmserve.embeddings import ItemEmbedding
from mmserve.errors import EmbeddingsLost, InvalidRequest, Overloaded, QueueFull
from mmserve.media import PlaceholderRange
from mmserve.positions import PositionPlan

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class PendingRequest:
    """What the router sends: the prompt plan plus object refs of embeddings still being computed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    positions: PositionPlan
    ranges: tuple[PlaceholderRange, ...]
    embeddings: tuple[EmbeddingHandle, ...]  # one per range
    resumed_tokens: int = 0  # a failover continuation: the last this many prompt tokens were already sent
    attempt: int = 0  # 0: the first submission; n: the router's n-th resubmission (never refused as busy)


def root_cause(e: BaseException) -> BaseException:
    """The exception a replica raised, through Ray's task-error wrappers."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    return e


@serve.deployment
class LLMDeployment:
    def __init__(self, model_dir: str | None, dtype: str, device: str, engine: EngineConfig | None = None,
                 transport: str = "object_store", grpc: GrpcArgs | None = None, stall_timeout_s: float = 60.0,
                 max_waiting_tokens: int | None = None):
        model_dir, grpc = resolve_model_dir(model_dir), (grpc or GrpcArgs()).on_node()
        self.stall_timeout_s = stall_timeout_s
        self.max_waiting_tokens = max_waiting_tokens  # None: unbounded
        self.waiting_tokens = 0  # prompt tokens of requests admitted here whose first event is not back
        self.model = LanguageModel(model_dir, dtype=dtype, device=resolve_device(device))
        self.engine = LLMEngine(self.model, engine or EngineConfig())
        self.engine.start()
        self.metrics = LLMMetrics()
        self._stats_task: asyncio.Task | None = None
        self.fetcher = None
        if transport == "grpc":  # encoder results arrive as refs to pull from the encoder replica
            from deployments.transport import GrpcFetcher

            self.fetcher = GrpcFetcher(grpc or GrpcArgs())

    async def _export_stats(self, interval_s: float = 1.0) -> None:
        """Engine gauges (queues, KV blocks, preemptions, tokens/s) every `interval_s`."""
        last = self.engine.stats()
        while True:
            await asyncio.sleep(interval_s)
            stats = self.engine.stats()
            self.metrics.scheduled.set(stats.num_running)
            self.metrics.waiting.set(stats.num_waiting)
            self.metrics.kv_blocks_used.set(stats.kv_blocks_used)
            self.metrics.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
            if stats.num_preemptions > last.num_preemptions:
                self.metrics.preemptions.inc(stats.num_preemptions - last.num_preemptions)
            self.metrics.tokens_per_s.set((stats.num_generated - last.num_generated) / interval_s)
            last = stats

    def check_health(self) -> None:
        """Serve's liveness probe: a replica whose engine thread died, or that holds work and made
        no step in `stall_timeout_s`, is replaced (its requests fail over in the router)."""
        if reason := self.engine.health(self.stall_timeout_s):
            logger.error("LLM replica unhealthy: %s", reason)
            raise RuntimeError(reason)

    def stats(self) -> dict:
        """The engine's counters (queues, KV blocks, preemptions, tokens): for tests and debugging."""
        return self.engine.stats()._asdict()

    async def _embeddings(self, pending: PendingRequest) -> list[ItemEmbedding]:
        start = time.perf_counter()
        try:
            embeddings = await resolve(pending.embeddings, self.fetcher)
        except EmbeddingsLost as e:  # the router re-encodes these items and resubmits
            logger.warning("request %s: %s", pending.request_id, e)
            raise
        except Exception as e:
            cause = root_cause(e)
            if isinstance(cause, InvalidRequest):
                raise InvalidRequest(str(cause)) from None
            raise
        self.metrics.embedding_wait_ms.observe((time.perf_counter() - start) * 1000)
        self.metrics.embedding_bytes.inc(sum(e.num_bytes for e in embeddings))
        return embeddings

    async def generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        """Stream of `TokenEvent`s; the stream ends after the one carrying `finish_reason`."""
        cost = len(pending.prompt_token_ids)
        bound = self.max_waiting_tokens
        if bound is not None and not pending.attempt and self.waiting_tokens and self.waiting_tokens + cost > bound:
            raise QueueFull(f"{self.waiting_tokens} prompt tokens wait for the language model (limit {bound})")
        if pending.resumed_tokens:
            logger.info("request %s: resuming a stream after a lost replica, %d tokens already sent",
                        pending.request_id, pending.resumed_tokens)
        self.waiting_tokens += cost
        events = self._generate(pending)
        try:
            async for event in events:
                self.waiting_tokens -= cost  # the first event (a token or the end) is back
                cost = 0
                yield event
        finally:
            self.waiting_tokens -= cost
            await events.aclose()  # aborts the engine request when the caller went away

    async def _generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        embeddings = await self._embeddings(pending) if pending.embeddings else []
        request = LLMRequest(
            request_id=pending.request_id,
            prompt_token_ids=pending.prompt_token_ids,
            sampling=pending.sampling,
            positions=pending.positions,
            media=tuple(zip(pending.ranges, embeddings)),
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        if self._stats_task is None:
            self._stats_task = asyncio.create_task(self._export_stats())
        self.engine.add_request(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        finished = False
        last_token_at = time.perf_counter()
        first = True
        try:
            while True:
                event = await events.get()
                if event.error:
                    finished = True
                    if event.finish_reason == "rejected":
                        raise InvalidRequest(event.error)
                    if event.finish_reason == "overloaded":
                        raise Overloaded(event.error)
                    raise RuntimeError(f"generation failed: {event.error}")
                if event.token_id is not None:
                    now = time.perf_counter()
                    (self.metrics.ttft_ms if first else self.metrics.itl_ms).observe((now - last_token_at) * 1000)
                    first, last_token_at = False, now
                    self.metrics.generated.inc()
                yield event
                if event.finish_reason:
                    finished = True
                    self.metrics.finished.inc(tags={"reason": event.finish_reason})
                    return
        finally:
            if not finished:  # the caller went away (client disconnect, stop string): free the request
                logger.info("aborting request %s", pending.request_id)
                self.engine.abort(pending.request_id)
    