"""The LLM replica's request path, without Ray: admit a request, resolve its embeddings, run its choices.

`LLMReplica.generate` refuses a request at once while too many prompt tokens wait here for their
first event (429; a failover resubmission never), resolves its embeddings while its streamed videos
decode and encode (`video_stream`), compiles its grammar, adds its first choice to the engine (the
other `n - 1` once that one's prompt blocks are cached) and streams its `TokenEvent`s, the last one
carrying the stage times (`usage.stage_ms`); a consumer that stops early aborts them. The Serve
deployment (`deployments.serve.llm`) builds the engine and injects what reaches other replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from deployments.core.failures import client_error, root_cause
from deployments.core.llm_inputs import EmbeddingHandle, PendingRequest, StreamedVideo
from deployments.core.video_stream import Encode, Frames, VideoStream
from llm_service.engine.llm_engine import EngineStats, LLMEngine, LLMRequest, TokenEvent
from mmserve.errors import EmbeddingsLost, QueueFull
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.encode_timing import embedding_stages

logger = logging.getLogger("ray.serve")

# the embeddings behind the handles, in order (`EmbeddingsLost` naming the items whose encoder is gone)
Resolve = Callable[[Sequence[EmbeddingHandle]], Awaitable[list[ItemEmbedding]]]


class ReplicaListener:
    """What the replica reports (metrics): a request's embeddings in, its grammar compiled (or cached),
    each event (`first`: the first token, `since_last_ms` after the last token or the admission); every `interval_s`, the engine's stats now and before. No-ops here."""

    def on_embeddings(self, wait_ms: float, num_bytes: int) -> None: ...
    def on_grammar(self, cached: bool) -> None: ...
    def on_event(self, event: TokenEvent, first: bool, since_last_ms: float) -> None: ...
    def on_stats(self, engine: LLMEngine, stats: EngineStats, last: EngineStats, interval_s: float) -> None: ...


class LLMReplica:
    def __init__(self, engine: LLMEngine, max_waiting_tokens: int, resolve: Resolve, frames: Frames | None = None,
                 group_encoder: Callable[[], Encode] | None = None,
                 step_failed: Callable[[], Awaitable[None]] | None = None, listener: ReplicaListener | None = None):
        """`engine`: started; `resolve`: the embeddings behind the router's handles (object store, gRPC,
        colocated pool); `frames`, `group_encoder()`: a streamed video's frame groups from the
        VideoDecoder, and a new request's encoder of them; `step_failed()`: awaited before an engine
        step's error is raised (a tensor-parallel replica learns whether a rank ended)."""
        self.engine = engine
        self.max_waiting_tokens = max_waiting_tokens
        self.resolve, self.frames, self.group_encoder = resolve, frames, group_encoder
        self.step_failed = step_failed
        self.listener = listener or ReplicaListener()
        self.waiting_tokens = 0  # prompt tokens of requests admitted here whose first event is not back
        self.video_groups_reencoded = 0  # streamed frame groups whose encoder replica was lost
        self._stats_task: asyncio.Task | None = None

    async def generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        """Stream of `TokenEvent`s; the stream ends after the one carrying `finish_reason`."""
        cost = len(pending.prompt_token_ids) * pending.n  # n choices are n sequences to schedule and run
        bound = self.max_waiting_tokens
        if not pending.attempt and self.waiting_tokens and self.waiting_tokens + cost > bound:
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

    async def _embeddings(self, pending: PendingRequest, handles: Sequence[EmbeddingHandle]) -> list[ItemEmbedding]:
        start = time.perf_counter()
        try:
            embeddings = await self.resolve(handles)
        except EmbeddingsLost as e:  # the router re-encodes these items and resubmits
            logger.warning("request %s: %s", pending.request_id, e)
            raise
        except Exception as e:
            raise client_error(e) from None
        self.listener.on_embeddings((time.perf_counter() - start) * 1000, sum(e.num_bytes for e in embeddings))
        return embeddings

    async def _generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        began = time.perf_counter()
        streamed = {i: h for i, h in enumerate(pending.embeddings) if isinstance(h, StreamedVideo)}
        others = [h for h in pending.embeddings if not isinstance(h, StreamedVideo)]
        stream, firsts = None, {}
        if streamed:  # prefill behind the decoder: admitted once each video's first group is in
            stream = VideoStream(pending.request_id, pending.ranges, streamed, self.frames, self.group_encoder())
            stream.on_reencode = self._count_reencode
            starting = asyncio.ensure_future(stream.start())  # decoding while the other items resolve
        try:
            resolved_list = await self._embeddings(pending, others) if others else []
            received_at, resolved = time.time(), iter(resolved_list)
            if stream is not None:
                firsts = await starting
        except BaseException as e:  # a failure, or the caller gone
            if stream is None:
                raise
            starting.cancel()
            stream.cancel()
            raise client_error(e) from None
        embeddings = [firsts[i] if i in streamed else next(resolved) for i in range(len(pending.embeddings))]
        matchers = [None] * pending.n
        if pending.sampling.grammar is not None:  # compiled and copied off the engine's thread and this loop
            compiler = await asyncio.to_thread(lambda: self.engine.grammars)  # the tokenizer loads on first use
            hits = compiler.stats.cache_hits
            matchers = await compiler.matchers(pending.sampling.grammar, pending.n,
                                               pending.prompt_token_ids[len(pending.prompt_token_ids)
                                                                        - pending.resumed_tokens:])
            self.listener.on_grammar(compiler.stats.cache_hits > hits)
        request = LLMRequest(pending.request_id, pending.prompt_token_ids, pending.sampling, pending.positions,
                             media=tuple(zip(pending.ranges, embeddings)), matcher=matchers[0],
                             snapshot_boundaries=pending.snapshot_boundaries, grammar_prefix=pending.resumed_tokens,
                             lora=pending.lora)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        if self._stats_task is None:
            self._stats_task = asyncio.create_task(self._export_stats())

        def emit(choice: int):
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev._replace(choice=choice))

        # n choices: the first alone, the others once its prefill is done, so that they find its
        # prompt blocks in the prefix cache and prefill only the last partial block
        choices = [request] + [_choice(request, i, matchers[i]) for i in range(1, pending.n)]
        unfinished, siblings_added = {request.request_id}, pending.n == 1
        self.engine.add_request(request, emit(0), ready=stream.ready() if stream else None)
        if stream is not None:
            stream.on_progress = lambda ready: self.engine.extend(pending.request_id, ready)
            stream.on_progress(stream.ready())  # groups that came in since
            stream.task.add_done_callback(lambda task: self._stream_ended(task, pending.request_id, events))
        added_at = last_token_at = time.perf_counter()
        first = True
        waited_ms = (added_at - began) * 1000  # encode queue + encode + transfer, as seen here
        stages = {"embeddings_ms": waited_ms}
        if stream is None:  # the split (`encode_timing.embedding_stages`): the request's last item
            stages.update(embedding_stages([e.timing for e in resolved_list], waited_ms, received_at))
        try:
            while True:
                event = await events.get()
                if event.error:
                    if self.step_failed is not None:
                        await self.step_failed()
                    raise event.error
                if not siblings_added:  # choice 0's first event: its prompt blocks are cached
                    siblings_added = True
                    for i, choice in enumerate(choices[1:], 1):
                        unfinished.add(choice.request_id)
                        self.engine.add_request(choice, emit(i))
                now = time.perf_counter()
                if "prefill_ms" not in stages:  # the first event: the prefill is done
                    queued = (event.stages or {}).get("prefill_queue_ms", 0.0)
                    stages.update(prefill_queue_ms=queued, prefill_ms=(now - added_at) * 1000 - queued)
                    first_at = now
                self.listener.on_event(event, first, (now - last_token_at) * 1000)
                if event.token_id is not None:
                    first, last_token_at = False, now
                if event.finish_reason:
                    unfinished.discard(choices[event.choice].request_id)
                    if not unfinished:  # the last choice's end carries the stages
                        event = event._replace(stages={**stages, "decode_ms": (now - first_at) * 1000})
                yield event
                if event.finish_reason and not unfinished:
                    return
        finally:
            if stream is not None:
                stream.cancel()
            for request_id in unfinished:  # the caller went away (client disconnect, stop string), or an error
                logger.info("aborting request %s", request_id)
                self.engine.abort(request_id)

    def _count_reencode(self) -> None:
        self.video_groups_reencoded += 1

    def _stream_ended(self, task: asyncio.Task, request_id: str, events: asyncio.Queue) -> None:
        """A streamed video failed: the engine request is aborted and the stream ends with its error."""
        if task.cancelled() or task.exception() is None:
            return
        error = client_error(task.exception())
        logger.warning("request %s: streamed video failed: %r", request_id, root_cause(error))
        self.engine.abort(request_id)
        events.put_nowait(TokenEvent(None, "error", error))

    async def _export_stats(self, interval_s: float = 1.0) -> None:
        last = self.engine.stats()
        while True:
            await asyncio.sleep(interval_s)
            stats = self.engine.stats()
            self.listener.on_stats(self.engine, stats, last, interval_s)
            last = stats


def _choice(request: LLMRequest, index: int, matcher) -> LLMRequest:
    """Choice `index` (> 0) of a request with `n` choices: its own id, its own seed (the request's
    + its index) so that seeded choices differ and each is reproducible, and its own `matcher`."""
    sampling = request.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
    return dataclasses.replace(request, request_id=f"{request.request_id}#{index}", sampling=sampling,
                               matcher=matcher)
