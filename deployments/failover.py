"""Lossless LLM failover: one request's submissions to the LLM deployment, resubmitted when the
replica serving it dies.

A request that has not produced its first token yet runs again. A stream that already sent
tokens resumes: the continuation's prompt is the prompt + the tokens sent, with the same position
plan (it answers positions for any token index), the same embedding handles and ranges (refs the
router owns, so the new replica fetches the same tensors), and `max_tokens` less the tokens sent.
The router's detokenizer (in `Generation`) keeps its stop-string state, so the client sees one
uninterrupted stream, and greedy output equals an uninterrupted run token for token.

Not bit-exact on resume: seeded sampling (the continuation's generator starts again from the seed)
and frequency/presence penalties (they count output tokens only; the tokens sent before the
failure are prompt tokens of the continuation). Repetition penalty, stop ids and EOS are exact.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from deployments.failures import replica_lost
from deployments.llm import PendingRequest

logger = logging.getLogger("ray.serve")


class Failover:
    """Submits `pending` to `llm` (a DeploymentHandle or anything with its `options().generate.remote`
    shape) and resubmits on replica loss, at most `retries` times per request."""

    def __init__(self, llm, pending: PendingRequest, retries: int,
                 on_resume: Callable[[PendingRequest], None] | None = None):
        self.llm = llm
        self.pending = pending
        self.retries = retries
        self.on_resume = on_resume  # called with each continuation before it is submitted
        self.attempts = 0  # resubmissions so far

    async def start(self):
        """(stream, first event) of the request; retried like a resume with no tokens sent."""
        try:
            return await self._submit(self.pending)
        except Exception as e:
            return await self.resume(e, ())

    async def resume(self, error: BaseException, sent: tuple[int, ...]):
        """(stream, first event) of a continuation after `error`; re-raises `error` (or the last
        one) when it is not a lost replica or the retries are spent."""
        while True:
            if not replica_lost(error) or self.attempts >= self.retries:
                raise error
            self.attempts += 1
            logger.warning(
                "request %s: LLM replica lost (%s); resubmitting with %d tokens already sent (retry %d of %d)",
                self.pending.request_id, type(error).__name__, len(sent), self.attempts, self.retries,
            )
            continuation = self._continuation(sent)
            if self.on_resume is not None:
                self.on_resume(continuation)
            try:
                return await self._submit(continuation)
            except Exception as e:
                error = e

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
        stream = self.llm.options(stream=True).generate.remote(pending)
        try:
            first = await stream.__anext__()  # errors surface here, before any response is sent
        except BaseException:
            stream.cancel()
            raise
        return stream, first
