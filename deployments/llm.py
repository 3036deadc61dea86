"""LLM deployment: wraps `llm_service`'s engine; streams token events back to the router."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from ray import serve

from deployments.encoder import resolve_device
from deployments.metrics import LLMMetrics
from llm_service.engine import LLMEngine, LLMRequest, TokenEvent
from llm_service.model import LanguageModel
from llm_service.sampling import SamplingParams
from mmserve.errors import InvalidRequest
from mmserve.media import PlaceholderRange

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class PendingRequest:
    """What the router sends: the prompt plan plus object refs of embeddings still being computed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    positions: torch.Tensor | None
    mrope_delta: int
    ranges: tuple[PlaceholderRange, ...]
    # Per range: (ObjectRef of one encoder call's list of embeddings, index in that list).
    # The refs are owned by the router, so they outlive the encoder replica that made them.
    embedding_refs: tuple[tuple[object, int], ...]


def root_cause(e: BaseException) -> BaseException:
    """The exception a replica raised, through Ray's task-error wrappers."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    return e


@serve.deployment
class LLMDeployment:
    def __init__(self, model_dir: str, dtype: str, device: str):
        self.model = LanguageModel(model_dir, dtype=dtype, device=resolve_device(device))
        self.engine = LLMEngine(self.model)
        self.engine.start()
        self.metrics = LLMMetrics()

    def info(self) -> dict:
        return {"max_model_len": self.model.max_model_len, "vocab_size": self.model.vocab_size}

    async def _embeddings(self, pending: PendingRequest) -> list[torch.Tensor]:
        start = time.perf_counter()
        try:
            refs = list(dict.fromkeys(ref for ref, _ in pending.embedding_refs))
            groups = dict(zip(refs, await asyncio.gather(*refs)))
            embeddings = [groups[ref][index] for ref, index in pending.embedding_refs]
        except Exception as e:
            cause = root_cause(e)
            if isinstance(cause, InvalidRequest):
                raise InvalidRequest(str(cause)) from None
            raise
        self.metrics.embedding_wait_ms.observe((time.perf_counter() - start) * 1000)
        self.metrics.embedding_bytes.inc(sum(t.numel() * t.element_size() for t in embeddings))
        return embeddings

    async def generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        """Stream of `TokenEvent`s; the stream ends after the one carrying `finish_reason`."""
        embeddings = await self._embeddings(pending) if pending.embedding_refs else []
        request = LLMRequest(
            request_id=pending.request_id,
            prompt_token_ids=pending.prompt_token_ids,
            sampling=pending.sampling,
            positions=pending.positions,
            mrope_delta=pending.mrope_delta,
            media=tuple(zip(pending.ranges, embeddings)),
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.engine.add_request(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        self.metrics.running.set(self.engine.num_requests)
        finished = False
        try:
            while True:
                event = await events.get()
                if event.error:
                    finished = True
                    raise RuntimeError(f"generation failed: {event.error}")
                if event.token_id is not None:
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
            self.metrics.running.set(self.engine.num_requests)
