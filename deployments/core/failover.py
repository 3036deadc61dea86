"""Lossless LLM failover: one request's submissions to the LLM deployment, resubmitted when the
replica serving it dies.

A request that has not produced its first token yet runs again. A stream that already sent
tokens resumes: the continuation's prompt is the prompt + the tokens sent, with the same position
plan (it answers positions for any token index), the same embedding handles and ranges (refs the
router owns, so the new replica fetches the same tensors), and `max_tokens` less the tokens sent.
The router's detokenizer (in `Generation`) keeps its stop-string state, so the client sees one
uninterrupted stream, and greedy output equals an uninterrupted run token for token.

An encoder replica that dies with a request's items surfaces inside the LLM replica, which
raises `EmbeddingsLost` naming those items before it runs anything. The router re-encodes just
them (`reencode`: Serve routes the calls to a live encoder replica, or waits for a replacement when
none is left) and resubmits with the new handles; the request keeps its place in the flow.

A request of `n` choices lost after its first token resumes each unfinished choice on its own
(`ChoiceStreams`): a request of one choice whose continuation is that choice's prompt + its own
tokens sent, with its own seed (the request's + its index, as the LLM replica seeds its choices),
failing over on its own from then on; their events merged, each with its choice's index.

Not bit-exact on resume: seeded sampling and frequency/presence penalties (docs/operations.md#failures);
repetition penalty, stop ids and EOS are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from deployments.core.failures import replica_lost, root_cause
from deployments.core.llm_inputs import EmbeddingHandle, PendingRequest
from llm_service.engine.sequence import TokenEvent
from mmserve.errors import EmbeddingsLost

Reencode = Callable[[tuple[EmbeddingHandle, ...], tuple[int, ...]], Awaitable[tuple[EmbeddingHandle, ...]]]

logger = logging.getLogger("ray.serve")


class TokenStream(Protocol):
    """One submission's `TokenEvent`s (Serve's streaming `DeploymentResponseGenerator`)."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def __anext__(self) -> TokenEvent: ...

    def cancel(self) -> None: ...


class LLMClient(Protocol):
    """Where the router submits requests: the LLM deployment (`deployments.serve.router.ServeLLMClient`)."""

    def generate(self, pending: PendingRequest) -> TokenStream: ...


class Failover:
    """Submits `pending` to `llm` and resubmits on replica loss, at most `retries` times per
    request for lost LLM replicas and as many for lost encoder replicas."""

    def __init__(self, llm: LLMClient, pending: PendingRequest, retries: int,
                 on_resume: Callable[[PendingRequest], None] | None = None, reencode: Reencode | None = None,
                 routing: asyncio.Lock | None = None):
        """`routing`: held from a submission until its first event, shared by a request's choices
        resumed apart: Serve matches a routed call to its replica by the request's internal id, which
        calls made from one request share, so concurrent ones would never be matched (the
        dispatcher routes a request's encoder calls one at a time for the same reason)."""
        self.llm = llm
        self.routing = routing or asyncio.Lock()
        self.pending = pending
        self.retries = retries
        self.on_resume = on_resume  # called with each continuation before it is submitted
        self.reencode = reencode  # (handles, lost item positions) -> new handles; None: no encoder failover
        self.attempts = 0  # resubmissions so far (they name the engine requests)
        self.llm_losses = 0
        self.encoder_losses = 0

    async def start(self):
        """(stream, first event) of the request; retried like a resume with no tokens sent."""
        try:
            return await self._submit(self.pending)
        except Exception as e:
            return await self.resume(e, ())

    async def resume(self, error: BaseException, sent: tuple[int, ...] | dict[int, tuple[int, ...]]):
        """(stream, first event) of a continuation after `error`; re-raises `error` (or the last
        one) when it is not a lost replica or the retries are spent. `sent` by choice (a request of
        `n` that sent tokens): each of those choices resumed on its own (`ChoiceStreams`)."""
        if isinstance(sent, dict):
            stream = ChoiceStreams(self, error, sent)
            return stream, await stream.__anext__()
        while True:
            lost = root_cause(error)
            if isinstance(lost, EmbeddingsLost) and self.reencode and self.encoder_losses < self.retries:
                self.encoder_losses += 1
                logger.warning("request %s: %s; re-encoding on a live encoder (retry %d of %d)",
                               self.pending.request_id, lost, self.encoder_losses, self.retries)
                try:
                    handles = await self.reencode(self.pending.embeddings, lost.items)
                except Exception as e:
                    error = e
                    continue
                self.pending = dataclasses.replace(self.pending, embeddings=handles)
            elif replica_lost(error) and self.llm_losses < self.retries:
                self.llm_losses += 1
                logger.warning(
                    "request %s: LLM replica lost (%s); resubmitting with %d tokens already sent (retry %d of %d)",
                    self.pending.request_id, type(error).__name__, len(sent), self.llm_losses, self.retries,
                )
            else:
                raise error
            self.attempts += 1
            continuation = self._continuation(sent)
            if self.on_resume is not None:
                self.on_resume(continuation)
            try:
                return await self._submit(continuation)
            except Exception as e:
                error = e

    def for_choice(self, choice: int) -> Failover:
        """Choice `choice` of this request as a request of one choice (its own engine key and seed,
        `max_tokens` as given), failing over on its own with the retries left."""
        p = self.pending
        seed = None if p.sampling.seed is None else p.sampling.seed + choice
        one = dataclasses.replace(p, request_id=f"{p.request_id}#{choice}", n=1,
                                  sampling=dataclasses.replace(p.sampling, seed=seed))
        failover = Failover(self.llm, one, self.retries, self.on_resume, self.reencode, self.routing)
        failover.llm_losses, failover.encoder_losses = self.llm_losses, self.encoder_losses
        return failover

    def _continuation(self, sent: tuple[int, ...]) -> PendingRequest:
        p = self.pending
        return dataclasses.replace(
            p,
            # a fresh engine key: a replica that only looked lost may still hold the old one
            request_id=f"{p.request_id}.{self.attempts}",
            prompt_token_ids=p.prompt_token_ids + tuple(sent),
            sampling=dataclasses.replace(p.sampling, max_tokens=p.sampling.max_tokens - len(sent)),
            resumed_tokens=len(sent),
            attempt=self.attempts,
        )

    async def _submit(self, pending: PendingRequest):
        async with self.routing:
            stream = self.llm.generate(pending)
            try:
                first = await stream.__anext__()  # errors surface here, before any response is sent
            except BaseException:
                stream.cancel()
                raise
        return stream, first


class ChoiceStreams:
    """The unfinished choices of a request of `n` after its replica was lost (`TokenStream`): each
    resumed from its own tokens as a request of one choice (`Failover.for_choice`), each failing
    over on its own; their events as they come, each with its choice's index."""

    def __init__(self, failover: Failover, error: BaseException, sent: dict[int, tuple[int, ...]]):
        self._events: asyncio.Queue = asyncio.Queue()
        self._open = len(sent)
        self._tasks = [asyncio.ensure_future(self._run(failover.for_choice(c), c, error, t)) for c, t in sent.items()]

    async def _run(self, failover: Failover, choice: int, error: BaseException, sent: tuple[int, ...]) -> None:
        stream = None
        try:
            stream, event = await failover.resume(error, sent)
            while True:
                await self._events.put(event._replace(choice=choice))
                sent += (event.token_id,) if event.token_id is not None else ()
                if event.finish_reason:
                    return
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as e:  # lost again: this choice alone resumes
                    stream.cancel()
                    stream, event = await failover.resume(e, sent)
        except BaseException as e:  # retries spent, or not a lost replica: the request fails with it
            await self._events.put(e)
        finally:
            if stream is not None:
                stream.cancel()
            self._open -= 1
            if not self._open:
                await self._events.put(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._events.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.cancel()
            raise item
        return item

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
