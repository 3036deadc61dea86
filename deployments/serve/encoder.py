"""Encoder deployment: one `encoder_service.EncoderPool` per replica (GPU replicas in production).

Every `encode` call, from any number of routers and requests, goes through the replica's pool:
embedding cache and in-flight dedup, CPU preprocessing workers, token-budget batches. Replicas
report their queued tokens to Serve's autoscaler (`record_autoscaling_stats`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from ray import serve

from deployments.config import AppArgs, DeploymentArgs, EncoderPoolArgs
from deployments.serve.autoscaling import QUEUED_TOKENS, scaled
from deployments.serve.metrics import EncoderMetrics, PoolMetrics
from deployments.replica_env import resolve_model_dir, set_cpu_threads
from encoder_service import VisionEncoder
from encoder_service.pool import EncoderPool
from mmserve.device import device_memory, hold_to_share, resolve_device
from mmserve.errors import InvalidRequest, Overloaded
from mmserve.inputs.media import AdapterRef, EncodeItem

logger = logging.getLogger("ray.serve")


def encoder_options(deployment: DeploymentArgs, pool: EncoderPoolArgs) -> dict:
    """Serve options of the encoder deployment: fixed replicas, or autoscaling on queued tokens."""
    return scaled(pool, deployment.options("Encoder"), target_tokens_per_replica=pool.target_queued_tokens_per_replica)


def start_pool(args: AppArgs, model_dir: str, device: str,
               capture_graphs: bool = True) -> tuple[EncoderPool, EncoderMetrics]:
    """The vision tower loaded (its CUDA graphs captured where `encoder_pool` asks) and warmed up
    (before `ready()` can answer: the first request finds it warm), behind a pool reporting to its
    metrics: the Encoder deployment's, or a colocated LLM replica's (no graphs)."""
    # every listed adapter's tower modules stay read (`encoder_service.lora`)
    encoder = VisionEncoder(model_dir, dtype=args.dtype, device=device, max_loras=max(1, len(args.lora_modules)))
    pool = args.encoder_pool
    if capture_graphs and pool.cuda_graphs and torch.device(device).type == "cuda":
        encoder.capture_graphs(pool.max_batch_tokens, pool.cost_unit, max_patches=pool.cuda_graphs_max_patches)
    encoder.warm_up()
    metrics = EncoderMetrics()
    return EncoderPool(encoder, pool.resolve(), PoolMetrics(metrics)), metrics


def multiplexed_adapters(read_ahead: Callable[[str], object], held: set[str], most: int, lease=lambda name: name):
    """Serve's model multiplexing of LoRA adapters: the router names a call's adapter as its
    multiplexed model id, so Serve prefers the replicas that reported it, and the call's method awaits
    the loader this returns with it first. A miss runs `read_ahead(name)` in a thread, off the
    forward's way (a failure is only logged: the adapter is read again where it is used, which
    answers the request), records it in `held` (what this replica reports) and returns `lease(name)`,
    what Serve holds while it keeps the adapter (at most `most` per replica, least recently used
    dropped)."""

    async def load_adapter(name: str):
        try:
            await asyncio.to_thread(read_ahead, name)
        except Exception:
            logger.exception("LoRA adapter %r could not be read ahead", name)
        held.add(name)
        return lease(name)

    return serve.multiplexed(max_num_models_per_replica=most)(load_adapter)


@serve.deployment
class EncoderDeployment:
    def __init__(self, args: AppArgs):
        model_dir, grpc, device = resolve_model_dir(args.model), args.grpc.on_node(), resolve_device(args.device)
        self.device_share = args.encoder.device_share
        hold_to_share(device, self.device_share)  # past its part of the GPU a forward fails here (503)
        self.torch_threads = set_cpu_threads(args.encoder.cpu_threads, args.replicas_at_start("encoder"), "Encoder")
        self.pool, self.metrics = start_pool(args, model_dir, device)
        self.encoder = self.pool.encoder
        self.publisher = None
        if args.transport == "grpc":  # results stay here, pinned, until the LLM replica pulls them
            from deployments.serve.transport import GrpcPublisher

            self.publisher = GrpcPublisher(grpc, self.encoder)
        self.multiplexed: set[str] = set()  # the tower adapters Serve counts as read here (reported to routers)
        self.adapters = None  # the tower's adapters (`TowerLoras.get`), named by `EncoderPoolDispatcher`
        if paths := dict(args.lora_modules):
            self.adapters = multiplexed_adapters(lambda name: self.encoder.loras.get(AdapterRef(name, paths[name])),
                                                 self.multiplexed, len(paths))

    def ready(self) -> bool:
        """True: a call reaches a replica only once its constructor returned, the tower loaded and
        warmed up. The routers ask it before they answer ready (`deployments.core.readiness`)."""
        return True

    async def encode(self, items: list[EncodeItem]) -> list:
        """One `ItemEmbedding` (CPU) per item — or, with `transport: grpc`, one `EncodedRef` to
        fetch it by. InvalidRequest if an item cannot be decoded, Overloaded when the pool's queue
        (or the result store, or device memory) is full."""
        start = time.perf_counter()
        if self.adapters is not None and (adapter := serve.get_multiplexed_model_id()):
            await self.adapters(adapter)
        try:
            embeddings = await self.pool.encode(items)
        except Exception as e:
            self.metrics.failures.inc()
            if isinstance(e, torch.OutOfMemoryError):
                logger.warning("encoding %d items ran out of device memory", len(items))
                raise Overloaded("the encoder ran out of device memory") from None
            if not isinstance(e, (InvalidRequest, Overloaded)):  # bad media (400), a full queue (503): not our bug
                logger.exception("encoding %d items failed", len(items))  # a bug: the router answers 500
            raise
        for item, embedding in zip(items, embeddings):
            self.metrics.items.inc(tags={"kind": item.item.kind.value})
            self.metrics.tokens.inc(embedding.num_rows)
        self.metrics.encode_ms.observe((time.perf_counter() - start) * 1000)
        return self.publisher.publish(items, embeddings) if self.publisher else embeddings

    def stats(self) -> dict:
        """The pool's counters (forwards, cache, dedup, queue), its torch threads and which replica answered: for
        tests, benches and debugging (`encoder_stats` collects every replica's)."""
        return {**self.pool.stats()._asdict(), "torch_threads": self.torch_threads,
                "replica": serve.get_replica_context().replica_id.unique_id,
                "multiplexed_adapters": sorted(self.multiplexed)}

    def memory(self) -> dict:
        """This replica's device memory (`mmserve.device.device_memory`) and its share of the device."""
        return {**device_memory(self.encoder.device), "device_share": self.device_share}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (see `deployments.serve.autoscaling`)."""
        return {QUEUED_TOKENS: float(self.pool.queued_tokens)}

    def check_health(self) -> None:
        if not any(True for _ in self.encoder.tower.parameters()):
            raise RuntimeError("vision tower has no parameters")


def encoder_stats(handle, num_replicas: int, tries: int = 50) -> dict[str, dict]:
    """Replica id -> `EncoderDeployment.stats()` of every one of `num_replicas` replicas (Serve
    picks the replica of each call: ask until each has answered)."""
    found: dict[str, dict] = {}
    for _ in range(tries):
        answer = handle.stats.remote().result()
        found[answer["replica"]] = answer
        if len(found) >= num_replicas:
            break
    return found
