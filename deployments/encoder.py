"""Encoder deployment: one `encoder_service.EncoderPool` per replica (GPU replicas in production).

Every `encode` call, from any number of routers and requests, goes through the replica's pool:
embedding cache and in-flight dedup, CPU preprocessing workers, token-budget batches. Replicas
report their queued tokens to Serve's autoscaler (`record_autoscaling_stats`).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence

import torch
from ray import serve

from deployments.autoscaling import QUEUED_TOKENS, autoscaling_config
from deployments.config import DeploymentArgs, EncoderPoolArgs, GrpcArgs
from deployments.metrics import EncoderMetrics
from deployments.replica_env import resolve_model_dir
from encoder_service import VisionEncoder
from encoder_service.batching import BatchConfig
from encoder_service.pool import BatchRecord, EncoderPool, Lookup, PoolConfig, PoolListener
from mmserve.errors import InvalidRequest, Overloaded
from mmserve.media import EncodeItem

logger = logging.getLogger("ray.serve")

# One request's items are spread over several encoder calls (so over replicas) only when each
# call still gets at least SPREAD_MIN_GROUP_TOKENS; a small request stays one call (one RPC).
SPREAD_MIN_GROUP_TOKENS = 2048
SPREAD_MAX_GROUPS = 8


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pool_config(args: EncoderPoolArgs) -> PoolConfig:
    batch = BatchConfig(
        max_batch_tokens=args.max_batch_tokens,
        max_batch_items=args.max_batch_items,
        batch_wait_ms=args.batch_wait_ms,
        cost_unit=args.cost_unit,
        skip_ahead=args.skip_ahead,
        max_skips=args.max_skips,
    )
    return PoolConfig(batch=batch, preprocess_workers=args.preprocess_workers, cache_bytes=args.cache_bytes,
                      max_queued_bytes=args.max_queued_bytes)


def encoder_options(deployment: DeploymentArgs, pool: EncoderPoolArgs) -> dict:
    """Serve options of the encoder deployment: fixed replicas, or autoscaling on queued tokens."""
    options = deployment.options("Encoder")
    if pool.autoscale:
        options.pop("num_replicas")
        options["autoscaling_config"] = autoscaling_config(
            min_replicas=pool.min_replicas,
            max_replicas=pool.max_replicas,
            target_tokens_per_replica=pool.target_queued_tokens_per_replica,
            upscale_delay_s=pool.upscale_delay_s,
            downscale_delay_s=pool.downscale_delay_s,
            look_back_period_s=pool.look_back_period_s,
            metrics_interval_s=pool.metrics_interval_s,
        )
    return options


def balanced_groups(sizes: Sequence[int], num_groups: int) -> list[list[int]]:
    """Item indices in `num_groups` groups of near-equal summed size (none empty).

    Largest item first onto the least-loaded group (vLLM's `get_load_balance_assignment`);
    indices ascend within a group. Fewer groups when there are fewer items.
    """
    num_groups = max(1, min(num_groups, len(sizes)))
    heap = [(0, g) for g in range(num_groups)]
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + sizes[i], g))
    return [sorted(g) for g in groups if g]


def spread(sizes: Sequence[int]) -> list[list[int]]:
    """How the router splits one request's items (token counts `sizes`) into encoder calls."""
    return balanced_groups(sizes, min(SPREAD_MAX_GROUPS, max(1, sum(sizes) // SPREAD_MIN_GROUP_TOKENS)))


class _MetricsListener(PoolListener):
    def __init__(self, metrics: EncoderMetrics):
        self.metrics = metrics

    def on_lookup(self, outcome: Lookup) -> None:
        {"hit": self.metrics.cache_hits, "miss": self.metrics.cache_misses, "dedup": self.metrics.dedup_hits}[
            outcome
        ].inc()

    def on_batch(self, record: BatchRecord) -> None:
        m = self.metrics
        m.batch_tokens.observe(record.cost)
        m.batch_items.observe(record.items)
        m.batch_fill.observe(record.fill_ratio)
        m.batch_wait_ms.observe(record.wait_ms)
        m.forward_ms.observe(record.forward_ms)

    def on_queue(self, queued_tokens: int, queued_items: int, cache_bytes: int) -> None:
        self.metrics.queued_tokens.set(queued_tokens)
        self.metrics.in_flight.set(queued_items)
        self.metrics.cache_bytes.set(cache_bytes)


@serve.deployment
class EncoderDeployment:
    def __init__(self, model_dir: str | None, dtype: str, device: str, pool: EncoderPoolArgs | None = None,
                 transport: str = "object_store", grpc: GrpcArgs | None = None):
        model_dir, grpc = resolve_model_dir(model_dir), (grpc or GrpcArgs()).on_node()
        self.encoder = VisionEncoder(model_dir, dtype=dtype, device=resolve_device(device))
        self.metrics = EncoderMetrics()
        self.pool = EncoderPool(self.encoder, pool_config(pool or EncoderPoolArgs()), _MetricsListener(self.metrics))
        self.publisher = None
        if transport == "grpc":  # results stay here, pinned, until the LLM replica pulls them
            from deployments.transport import GrpcPublisher

            self.publisher = GrpcPublisher(grpc or GrpcArgs(), self.encoder)

    async def encode(self, items: list[EncodeItem]) -> list:
        """One `ItemEmbedding` (CPU) per item — or, with `transport: grpc`, one `EncodedRef` to
        fetch it by. InvalidRequest if an item cannot be decoded, Overloaded when the pool's queue
        (or the result store, or device memory) is full."""
        start = time.perf_counter()
        try:
            embeddings = await self.pool.encode(items)
        except (InvalidRequest, Overloaded):  # bad media (400) / a full queue (503): not our bug
            self.metrics.failures.inc()
            raise
        except torch.OutOfMemoryError:
            self.metrics.failures.inc()
            logger.warning("encoding %d items ran out of device memory", len(items))
            raise Overloaded("the encoder ran out of device memory") from None
        except Exception:  # a bug: the router answers 500
            self.metrics.failures.inc()
            logger.exception("encoding %d items failed", len(items))
            raise
        for item, embedding in zip(items, embeddings):
            self.metrics.items.inc(tags={"kind": item.item.kind.value})
            self.metrics.tokens.inc(embedding.num_rows)
        self.metrics.encode_ms.observe((time.perf_counter() - start) * 1000)
        return self.publisher.publish(items, embeddings) if self.publisher else embeddings

    def stats(self) -> dict:
        """The pool's counters (forwards, cache, dedup, queue): for tests and debugging."""
        return self.pool.stats()._asdict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (see `deployments.autoscaling`)."""
        return {QUEUED_TOKENS: float(self.pool.queued_tokens)}

    def check_health(self) -> None:
        if not any(True for _ in self.encoder.tower.parameters()):
            raise RuntimeError("vision tower has no parameters")
