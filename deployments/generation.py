"""A request on its way through the app, independent of the API it came in by (HTTP or gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

from deployments.llm import root_cause
from llm_service.sampling import SamplingParams
from mmserve.detokenize import IncrementalDetokenizer
from mmserve.errors import InvalidRequest
from mmserve.planner import RequestPlan


@dataclass(frozen=True)
class GenerationOptions:
    """What the client asked for; None means the model's default (vLLM semantics)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # most likely alternatives to return per token; None: no logprobs


class Delta(NamedTuple):
    text: str
    token_id: int | None
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def as_invalid_request(e: BaseException) -> InvalidRequest | None:
    """The InvalidRequest behind `e` (raised here or in a replica), if that is what it is."""
    cause = root_cause(e)
    return cause if isinstance(cause, InvalidRequest) else None


class Failure(NamedTuple):
    """Why a request failed, as every API reports it: `kind` is one of "invalid" (the client's
    fault), "overloaded" (backpressure), "unavailable" (a backend is down), "deadline", "internal"."""

    kind: str
    message: str


def _unavailable() -> tuple[type[BaseException], ...]:
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    from mmserve.encoder_client import EmbeddingNotFound

    return (serve_exceptions.DeploymentUnavailableError, serve_exceptions.ReplicaUnavailableError,
            ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError, EmbeddingNotFound)


def classify(e: BaseException) -> Failure:
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    if (invalid := as_invalid_request(e)) is not None:
        return Failure("invalid", str(invalid))
    cause = root_cause(e)
    for error in (e, cause):
        if isinstance(error, serve_exceptions.BackPressureError):
            return Failure("overloaded", "server overloaded (backpressure); retry later")
        if isinstance(error, _unavailable()):
            return Failure("unavailable", f"a backend is unavailable: {type(error).__name__}")
        if isinstance(error, (TimeoutError, asyncio.TimeoutError, ray_exceptions.GetTimeoutError)):
            return Failure("deadline", "deadline exceeded")
    return Failure("internal", f"internal error: {type(cause).__name__}")


class Generation:
    """A validated, dispatched request and its token stream (first event already received)."""

    def __init__(self, request_id: str, plan: RequestPlan, sampling: SamplingParams, stop: tuple[str, ...],
                 stream, first, tokenizer):
        self.request_id = request_id
        self.plan = plan
        self.sampling = sampling
        self.first_token_at = time.perf_counter()  # made when the first token is back
        self.num_generated = 0
        self._stop = stop
        self._stream = stream
        self._first = first
        self._tokenizer = tokenizer

    async def _events(self) -> AsyncIterator:
        yield self._first
        if self._first.finish_reason:
            return
        async for event in self._stream:
            yield event
            if event.finish_reason:
                return

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas; a stop string ends the stream early and aborts the LLM request."""
        detok = IncrementalDetokenizer(self._tokenizer, self._stop)
        try:
            async for event in self._events():
                self.num_generated += event.token_id is not None
                delta = detok.add(event.token_id) if event.token_id is not None else ""
                if detok.stopped:
                    yield Delta(delta, event.token_id, "stop", event.logprob, event.top_logprobs)
                    return
                finish = event.finish_reason
                text = delta + detok.flush() if finish else delta
                yield Delta(text, event.token_id, finish, event.logprob, event.top_logprobs)
        finally:
            self._stream.cancel()

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def usage(self) -> dict:
        prompt = len(self.plan.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_generated,
            "total_tokens": prompt + self.num_generated,
            "prompt_tokens_details": {"media_tokens": self.plan.num_media_tokens},
        }

    @property
    def time_per_output_token_ms(self) -> float | None:
        """Mean time per token after the first (TTFT excluded); None below two tokens."""
        if self.num_generated < 2:
            return None
        return (time.perf_counter() - self.first_token_at) * 1000 / (self.num_generated - 1)
