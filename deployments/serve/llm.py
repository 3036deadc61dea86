"""LLM deployment: wraps `llm_service`'s engine; streams token events back to the router.

With `colocated_pool` (the app's `colocated: true`) the replica also runs its own `EncoderPool`
on its device and encodes the `LocalMedia` the router hands it: the baseline disaggregation is
measured against (vLLM's DP-N). Failover stays lossless: a request resubmitted to another
replica carries its media, which that replica encodes again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments.config import AppArgs
from deployments.core.failures import root_cause
from deployments.core.llm_inputs import PendingRequest, StoredEmbedding, StreamedVideo
from deployments.core.video_stream import VideoStream
from deployments.serve.metrics import EncoderMetrics, LLMMetrics, PoolMetrics
from deployments.replica_env import resolve_model_dir, set_cpu_threads
from deployments.serve.transport import resolve
from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine, LLMRequest, TokenEvent
from llm_service.model.experts import imbalance
from llm_service.model.language_model import LanguageModel
from mmserve.device import device_memory, hold_to_share, resolve_device
from mmserve.errors import EmbeddingsLost, InvalidRequest, QueueFull
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.encode_timing import embedding_stages
from mmserve.inputs.media import EncodeItem

logger = logging.getLogger("ray.serve")
RANK_LOSS_WAIT_S = 5.0  # a tensor-parallel step's error: how long to wait for Ray to report a rank's end


@serve.deployment
class LLMDeployment:
    def __init__(self, args: AppArgs, engine: EngineConfig, encoder=None, video=None):
        """`engine`: `args.engine` resolved by the builder for this deployment's GPU share."""
        model_dir, device, dtype = resolve_model_dir(args.model), resolve_device(args.device), args.dtype
        self.stall_timeout_s = args.engine.stall_timeout_s
        self.max_waiting_tokens = args.engine.max_waiting_tokens
        hold_to_share(device, engine.device_share)  # the KV pool is sized within it too
        tp = engine.tensor_parallel_size
        self.torch_threads = set_cpu_threads(args.llm.cpu_threads, args.replicas_at_start("llm"), "LLM", ranks=tp)
        self.waiting_tokens = 0  # prompt tokens of requests admitted here whose first event is not back
        self.pool = None
        if args.colocated:  # encode the media the router hands over, in-process
            from encoder_service import VisionEncoder
            from encoder_service.pool import EncoderPool

            self.encoder_metrics = EncoderMetrics()
            # loaded before the engine sizes its KV pool, so the pool leaves room for these weights
            encoder = VisionEncoder(model_dir, dtype=dtype, device=device)
            encoder.warm_up()
            self.pool = EncoderPool(encoder, args.encoder_pool.resolve(), PoolMetrics(self.encoder_metrics))
        self.ranks = None  # a tensor-parallel replica's other ranks (`deployments.serve.tp_ranks`)
        if tp > 1:
            self.model, self.engine = self._start_ranks(args, engine, model_dir, device, dtype)
        else:
            self.model = LanguageModel(model_dir, dtype=dtype, device=device)
            self.engine = LLMEngine(self.model, engine)
            self.engine.warm_up()  # a prefill and decode steps through the real engine, then forgotten
        self.engine.start()
        if self.ranks is not None:
            self.ranks.watch()  # a rank that ends ends this replica: its requests fail over
        self.metrics = LLMMetrics()
        self._stats_task: asyncio.Task | None = None
        self._mask_s_exported = 0.0
        self.encoder, self.video = encoder, video  # handles: this replica streams videos through them
        self.video_groups_reencoded = 0  # streamed frame groups whose encoder replica was lost
        self.fetcher = None
        if args.transport == "grpc":  # encoder results arrive as refs to pull from the encoder replica
            from deployments.serve.transport import GrpcFetcher

            self.fetcher = GrpcFetcher(args.grpc.on_node())

    def _start_ranks(self, args: AppArgs, engine: EngineConfig, model_dir: str, device: str, dtype: str):
        """(model, warmed-up engine) of rank 0 of a tensor-parallel group, its other ranks started as
        actors in this replica's placement group. Rank 0 joins and loads in a thread while the ranks
        are watched: a rank that fails to start fails this replica's start at once (rank 0 would
        otherwise wait in the group's first collective until `timeout_s`)."""
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from deployments.serve.tp_ranks import RankWorkers
        from llm_service.model.tensor_parallel import DEFAULT_TIMEOUT_S, TPGroup

        size = engine.tensor_parallel_size
        # a collective waits this long for a hung rank (a dead one fails it at once); loading the
        # shards takes place between the first collectives, so it is long, and the engine's stall
        # check (stall_timeout_s, then Serve's health check) ends a replica whose step hangs first
        timeout_s = max(DEFAULT_TIMEOUT_S, 2 * args.engine.stall_timeout_s)
        replica = serve.get_replica_context().replica_id.unique_id
        self.ranks = RankWorkers(size, replica, args.model, args.device, dtype, engine, self.torch_threads, timeout_s)

        def rank_0():
            group = TPGroup(0, size, self.ranks.init_method, torch.device(device), timeout_s=timeout_s)
            model = LanguageModel(model_dir, dtype=dtype, device=device, tp=group)
            llm = LLMEngine(model, engine)
            llm.warm_up()
            return model, llm

        pool = ThreadPoolExecutor(1, thread_name_prefix="tp-rank-0")
        started = pool.submit(rank_0)
        pool.shutdown(wait=False)
        try:
            while True:
                try:
                    return started.result(timeout=1.0)
                except TimeoutError:
                    if reason := self.ranks.dead():
                        raise RuntimeError(f"LLM replica {replica} could not start: {reason}") from None
        except BaseException:
            self.ranks.kill()
            raise

    async def _export_stats(self, interval_s: float = 1.0) -> None:
        """Engine gauges (queues, KV blocks, state snapshots, preemptions, tokens/s) every `interval_s`."""
        last = self.engine.stats()
        while True:
            await asyncio.sleep(interval_s)
            stats = self.engine.stats()
            self.metrics.scheduled.set(stats.num_running)
            self.metrics.waiting.set(stats.num_waiting)
            self.metrics.kv_blocks_used.set(stats.kv_blocks_used)
            self.metrics.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
            self.metrics.state_snapshots.set(stats.num_snapshots)
            self.metrics.state_snapshot_bytes.set(stats.snapshot_bytes)
            if stats.num_preemptions > last.num_preemptions:
                self.metrics.preemptions.inc(stats.num_preemptions - last.num_preemptions)
            self.metrics.tokens_per_s.set((stats.num_generated - last.num_generated) / interval_s)
            last = stats
            self._export_grammar_stats()
            self._export_expert_load()

    def _export_grammar_stats(self) -> None:
        masks, compiler = self.engine.masks, self.engine.grammar_compiler
        if (spent := masks.mask_s - self._mask_s_exported) > 0:
            self.metrics.grammar_mask_s.inc(spent)
            self._mask_s_exported += spent
        while compiler is not None and compiler.stats.compile_s:
            self.metrics.grammar_compile_ms.observe(compiler.stats.compile_s.pop(0) * 1000)

    def _export_expert_load(self) -> None:
        """Tokens per expert per forward and the worst layer's imbalance (MoE models only)."""
        if (load := self.engine.runner.expert_load.drain()) is None:
            return
        counts, forwards = load
        for tokens in (counts.double().mean(dim=0) / max(forwards, 1)).tolist():
            self.metrics.moe_tokens_per_expert.observe(tokens)
        self.metrics.moe_load_imbalance.set(imbalance(counts))

    def ready(self) -> bool:
        """True: a call reaches a replica only once its constructor returned, the model loaded and
        the engine (and, colocated, the encoder) warmed up. The routers ask it before they answer
        ready (`deployments.core.readiness`)."""
        return True

    def check_health(self) -> None:
        """Serve's liveness probe: a replica whose engine thread died, or that holds work and made
        no step in `stall_timeout_s`, is replaced (its requests fail over in the router)."""
        reason = self.engine.health(self.stall_timeout_s)
        if reason is None and self.ranks is not None:  # a tensor-parallel replica lives while all its ranks do
            reason = self.ranks.dead()
        if reason:
            logger.error("LLM replica unhealthy: %s", reason)
            raise RuntimeError(reason)

    def __del__(self):
        """Serve's shutdown of a tensor-parallel replica: the engine stops its group, then the rank
        actors are ended (Ray would end them with this process too: they are its own)."""
        ranks, self.ranks = getattr(self, "ranks", None), None
        if ranks is None:
            return
        ranks.closing()
        if (engine := getattr(self, "engine", None)) is not None:
            engine.shutdown()
        ranks.close()

    def stats(self) -> dict:
        """The engine's counters (queues, KV blocks, preemptions, tokens), the streamed video frame
        groups encoded again after their encoder replica was lost, the torch threads it computes
        with, its ranks (tensor parallelism) and which replica answered: for tests and debugging."""
        return {**self.engine.stats()._asdict(), "video_groups_reencoded": self.video_groups_reencoded,
                "torch_threads": self.torch_threads, "replica": serve.get_replica_context().replica_id.unique_id,
                "tensor_parallel_size": self.engine.config.tensor_parallel_size}

    def memory(self) -> dict:
        """This replica's device memory (`mmserve.device.device_memory`), its share of the
        device and its KV pool's bytes: for tests and debugging."""
        pool = self.engine.runner.kv_pool
        return {**device_memory(self.model.device), "device_share": self.engine.config.device_share,
                "kv_cache_bytes": pool.numel() * pool.element_size()}

    async def _encode_locally(self, items: list[EncodeItem]) -> list[ItemEmbedding]:
        start = time.perf_counter()
        embeddings = await self.pool.encode(items)
        self.encoder_metrics.encode_ms.observe((time.perf_counter() - start) * 1000)
        return embeddings

    async def _embeddings(self, pending: PendingRequest, handles) -> list[ItemEmbedding]:
        start = time.perf_counter()
        try:
            embeddings = await resolve(handles, self.fetcher, self._encode_locally if self.pool else None)
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

    async def _frames(self, data: bytes, request_id: str, group_size: int, indices: tuple[int, ...]) -> AsyncIterator:
        """A streamed video's frame groups (`indices`: its header's) from the VideoDecoder, as it decodes them."""
        groups = self.video.options(stream=True).frames.remote(data, request_id, group_size, indices)
        try:
            async for group in groups:
                yield group
        finally:
            groups.cancel()  # stopped early (a failure, the client gone): the decoder stops too

    async def _encode_group(self, item: EncodeItem, routing: asyncio.Lock) -> ItemEmbedding:
        """One frame group of a streamed video, encoded here (colocated) or by the Encoder
        deployment (`EmbeddingsLost` when its replica died: the stream encodes it again).

        A request's groups are routed one at a time under its `routing` lock, then encode
        concurrently: calls made from one request share Serve's internal request id, which a
        custom request router (`deployments.serve.affinity_routing`) matches replicas by; concurrent
        siblings would never match and wait forever (as the dispatcher's calls, one at a time)."""
        if self.pool is not None:
            return (await self._encode_locally([item]))[0]
        async with routing:
            ref = await self.encoder.encode.remote([item])._to_object_ref()
        [embedding] = await resolve([StoredEmbedding(ref, 0)], self.fetcher)
        return embedding

    async def _generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        began = time.perf_counter()
        streamed = {i: h for i, h in enumerate(pending.embeddings) if isinstance(h, StreamedVideo)}
        others = [h for h in pending.embeddings if not isinstance(h, StreamedVideo)]
        stream, firsts = None, {}
        if streamed:  # prefill behind the decoder: admitted once each video's first group is in
            stream = VideoStream(pending.request_id, pending.ranges, streamed, self._frames,
                                 functools.partial(self._encode_group, routing=asyncio.Lock()))
            stream.on_reencode = self._count_reencode
            starting = asyncio.ensure_future(stream.start())  # decoding while the other items resolve
        try:
            resolved_list = await self._embeddings(pending, others) if others else []
            received_at, resolved = time.time(), iter(resolved_list)
            if stream is not None:
                firsts = await starting
        except BaseException as e:  # a failure, or the caller gone
            if stream is not None:
                starting.cancel()
                stream.cancel()
                if isinstance(cause := root_cause(e), InvalidRequest):
                    raise InvalidRequest(str(cause)) from None
            raise
        embeddings = [firsts[i] if i in streamed else next(resolved) for i in range(len(pending.embeddings))]
        matchers = [None] * pending.n
        if pending.sampling.grammar is not None:  # compiled and copied off the engine's thread and this loop
            compiler = await asyncio.to_thread(lambda: self.engine.grammars)  # the tokenizer loads on first use
            hits = compiler.stats.cache_hits
            matchers = await compiler.matchers(pending.sampling.grammar, pending.n,
                                               pending.prompt_token_ids[len(pending.prompt_token_ids)
                                                                        - pending.resumed_tokens:])
            self.metrics.grammar_requests.inc(tags={"cached": str(compiler.stats.cache_hits > hits).lower()})
        request = LLMRequest(
            request_id=pending.request_id,
            prompt_token_ids=pending.prompt_token_ids,
            sampling=pending.sampling,
            positions=pending.positions,
            media=tuple(zip(pending.ranges, embeddings)),
            snapshot_boundaries=pending.snapshot_boundaries,
            matcher=matchers[0],
            grammar_prefix=pending.resumed_tokens,
        )
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
                    ranks = self.ranks
                    if ranks is not None and await asyncio.to_thread(ranks.dead, RANK_LOSS_WAIT_S):
                        # a rank ended: the step failed with it (ReplicaLost), and the watcher ends this
                        # process; the caller sees the replica's death and fails the request over
                        await asyncio.sleep(0 if ranks.stopping else 10 * RANK_LOSS_WAIT_S)
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
                if event.token_id is not None:
                    (self.metrics.ttft_ms if first else self.metrics.itl_ms).observe((now - last_token_at) * 1000)
                    first, last_token_at = False, now
                    self.metrics.generated.inc()
                if event.finish_reason:
                    self.metrics.finished.inc(tags={"reason": event.finish_reason})
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
        cause = root_cause(task.exception())
        logger.warning("request %s: streamed video failed: %r", request_id, cause)
        self.engine.abort(request_id)
        error = InvalidRequest(str(cause)) if isinstance(cause, InvalidRequest) else task.exception()
        events.put_nowait(TokenEvent(None, "error", error))


def _choice(request: LLMRequest, index: int, matcher) -> LLMRequest:
    """Choice `index` (> 0) of a request with `n` choices: its own id, its own seed (the request's
    + its index) so that seeded choices differ and each is reproducible, and its own `matcher`."""
    sampling = request.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
    return dataclasses.replace(request, request_id=f"{request.request_id}#{index}", sampling=sampling,
                               matcher=matcher)
