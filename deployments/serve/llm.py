"""LLM deployment: the Serve shell of the replica core (`deployments.core.llm_replica`).

It builds the model and the warmed-up engine (tensor parallelism: rank 0 here, the others as actors,
`deployments.serve.tp_ranks`), injects the Ray clients (embeddings by object store or gRPC, the
VideoDecoder's frame groups, the Encoder for them, metrics), answers health, readiness, stats and
memory, and hands `generate` to the core. With `colocated: true` it also runs an `EncoderPool` on its
device for the `LocalMedia` the router hands it: the baseline disaggregation is measured against
(vLLM's DP-N); a request failed over carries its media, which the next replica encodes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments.config import AppArgs
from deployments.core.llm_inputs import PendingRequest, StoredEmbedding
from deployments.core.llm_replica import LLMReplica
from deployments.core.video_stream import Encode
from deployments.replica_env import set_cpu_threads
from deployments.serve.encoder import multiplexed_adapters, start_pool
from deployments.serve.metrics import LLMMetrics
from deployments.serve.transport import GrpcFetcher, resolve
from deployments.serve.video_decoder import ServeVideoClient
from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine, TokenEvent
from llm_service.engine.sequence import LoraRequest
from llm_service.model.language_model import LanguageModel
from mmserve.device import device_memory, hold_to_share, resolve_device
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import EncodeItem

logger = logging.getLogger("ray.serve")
RANK_LOSS_WAIT_S = 5.0  # a tensor-parallel step's error: how long to wait for Ray to report a rank's end


@serve.deployment
class LLMDeployment:
    def __init__(self, args: AppArgs, encoder=None, video=None):
        args = args.on_node(api_key=False)  # the model, engine.max_model_len, the gRPC token, resolved here
        engine = args.engine.resolve(args.llm.device_share)
        model_dir, device, dtype = args.model, resolve_device(args.device), args.dtype
        self.stall_timeout_s = args.engine.stall_timeout_s
        hold_to_share(device, engine.device_share)  # the KV pool is sized within it too
        tp = engine.tensor_parallel_size
        self.torch_threads = set_cpu_threads(args.llm.cpu_threads, args.replicas_at_start("llm"), "LLM", ranks=tp)
        self.pool = None
        if args.colocated:  # encode the media the router hands over, in-process
            # loaded before the engine sizes its KV pool, so the pool leaves room for these weights
            self.pool, self.encoder_metrics = start_pool(args, model_dir, device, capture_graphs=False)

        def load(group=None):  # the model and its engine, warmed up (a prefill and decode steps, then forgotten)
            model = LanguageModel(model_dir, dtype=dtype, device=device, tp=group)
            llm = LLMEngine(model, engine)
            llm.warm_up()
            llm.load_loras([LoraRequest(name, path) for name, path in args.lora_modules.items()])
            return model, llm

        self.ranks = None  # a tensor-parallel replica's other ranks (`deployments.serve.tp_ranks`)
        self.model, self.engine = self._start_ranks(args, engine, device, dtype, load) if tp > 1 else load()
        self.engine.start()
        if self.ranks is not None:
            self.ranks.watch()  # a rank that ends ends this replica: its requests fail over
        self.encoder = encoder  # the Encoder's handle: this replica encodes streamed videos' frame groups on it
        # with `transport: grpc` encoder results arrive as refs to pull from the encoder replica
        fetcher = GrpcFetcher(args.grpc) if args.transport == "grpc" else None
        resolve_handles = functools.partial(resolve, fetcher=fetcher,
                                            encode_locally=self._encode_locally if self.pool else None)
        self.multiplexed: set[str] = set()  # the LoRA adapters Serve counts as loaded here (reported to routers)
        self.adapters = self._multiplex_adapters(args) if args.lora_modules else None
        self.core = LLMReplica(self.engine, args.engine.max_waiting_tokens, resolve_handles,
                               ServeVideoClient(video).frames if video is not None else None, self._group_encoder,
                               self._step_failed, LLMMetrics())

    def _start_ranks(self, args: AppArgs, engine: EngineConfig, device: str, dtype: str, load):
        """`load(group)`: (model, warmed-up engine) of rank 0 of a tensor-parallel group, its other
        ranks started as actors in this replica's placement group. Rank 0 joins and loads in a thread
        while the ranks are watched: a rank that fails to start fails this replica's start at once (rank 0 would
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
        pool = ThreadPoolExecutor(1, thread_name_prefix="tp-rank-0")
        started = pool.submit(lambda: load(TPGroup(0, size, self.ranks.init_method, torch.device(device),
                                                   timeout_s=timeout_s)))
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

    def _multiplex_adapters(self, args: AppArgs):
        """`multiplexed_adapters` of the engine's (`LLMEngine.prepare_lora`: the engine then only
        installs it), at most `engine.max_loras` (as the engine's own `LoraSet`)."""
        engine, paths = self.engine, dict(args.lora_modules)

        class Lease:  # what Serve's multiplexer holds per adapter; dropping it forgets what was read ahead
            def __init__(self, name: str):
                self.name = name

            def __del__(lease):  # called by Serve when it drops the adapter, then again when collected
                if lease.name is not None:
                    self.multiplexed.discard(lease.name)
                    engine.forget_lora(lease.name)
                    lease.name = None

        return multiplexed_adapters(lambda name: engine.prepare_lora(LoraRequest(name, paths[name])), self.multiplexed,
                                    max(1, engine.config.max_loras), Lease)

    async def _step_failed(self) -> None:
        ranks = self.ranks  # (None once the replica shuts down)
        if ranks is not None and await asyncio.to_thread(ranks.dead, RANK_LOSS_WAIT_S):
            # a rank ended: the step failed with it (ReplicaLost), and the watcher ends this process;
            # the caller sees the replica's death and fails the request over
            await asyncio.sleep(0 if ranks.stopping else 10 * RANK_LOSS_WAIT_S)

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
        return {**self.engine.stats()._asdict(), "video_groups_reencoded": self.core.video_groups_reencoded,
                "torch_threads": self.torch_threads, "replica": serve.get_replica_context().replica_id.unique_id,
                "tensor_parallel_size": self.engine.config.tensor_parallel_size,
                "multiplexed_adapters": sorted(self.multiplexed)}

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

    def _group_encoder(self) -> Encode:
        """One request's encoder of its streamed videos' frame groups: here (colocated) or on the Encoder
        deployment (`EmbeddingsLost` when its replica died: the stream encodes the group again). The
        groups are routed one at a time under the request's `routing` lock, then encode concurrently:
        calls made from one request share Serve's internal request id, which a custom request router
        (`deployments.serve.affinity_routing`) matches replicas by; concurrent siblings would never
        match and wait forever (as the dispatcher's calls, one at a time)."""
        routing = asyncio.Lock()

        async def encode(item: EncodeItem) -> ItemEmbedding:
            if self.pool is not None:
                return (await self._encode_locally([item]))[0]
            async with routing:
                ref = await self.encoder.encode.remote([item])._to_object_ref()
            [embedding] = await self.core.resolve([StoredEmbedding(ref, 0)])
            return embedding

        return encode

    async def generate(self, pending: PendingRequest) -> AsyncIterator[TokenEvent]:
        """`LLMReplica.generate`: stream of `TokenEvent`s, the last one carrying `finish_reason`. A
        request under a LoRA adapter first has it loaded (`_multiplex_adapters`) by the multiplexed
        model id the router set."""
        lora = pending.lora
        if self.adapters is not None and lora is not None and serve.get_multiplexed_model_id() == lora.name:
            await self.adapters(lora.name)
        async with contextlib.aclosing(self.core.generate(pending)) as events:
            async for event in events:
                yield event
