"""Colocated mode (`colocated: true`): each LLM replica encodes its own requests' media in-process.

The baseline that disaggregation is measured against (vLLM's DP-N). There is no Encoder
deployment: the router hands the LLM replica one `LocalMedia` per item instead of an
`EmbeddingHandle`, and the replica runs them through its own `EncoderPool` (the same pool,
batching, cache and runtime as `EncoderDeployment`) on its own device. Failover stays lossless:
a request resubmitted to another replica carries its media, which that replica encodes again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray import serve

from deployments.config import EncoderPoolArgs, GrpcArgs
from deployments.encoder import _MetricsListener, pool_config, resolve_device
from deployments.llm import LLMDeployment, PendingRequest
from deployments.metrics import EncoderMetrics
from deployments.replica_env import resolve_model_dir
from encoder_service import VisionEncoder
from encoder_service.pool import EncoderPool
from llm_service.config import EngineConfig
from mmserve.embeddings import ItemEmbedding
from mmserve.media import EncodeItem


@dataclass(frozen=True)
class LocalMedia:
    """An item for the LLM replica to encode itself (colocated mode's embedding handle)."""

    item: EncodeItem


class ColocatedLLM(LLMDeployment.func_or_class):
    def __init__(self, model_dir: str | None, dtype: str, device: str, engine: EngineConfig | None = None,
                 grpc: GrpcArgs | None = None, stall_timeout_s: float = 60.0,
                 max_waiting_tokens: int | None = None, pool: EncoderPoolArgs | None = None):
        super().__init__(model_dir, dtype, device, engine, "object_store", grpc, stall_timeout_s, max_waiting_tokens)
        encoder = VisionEncoder(resolve_model_dir(model_dir), dtype=dtype, device=resolve_device(device))
        self.encoder_metrics = EncoderMetrics()
        self.pool = EncoderPool(encoder, pool_config(pool or EncoderPoolArgs()), _MetricsListener(self.encoder_metrics))

    async def _embeddings(self, pending: PendingRequest) -> list[ItemEmbedding]:
        if not all(isinstance(h, LocalMedia) for h in pending.embeddings):
            return await super()._embeddings(pending)
        start = time.perf_counter()
        embeddings = await self.pool.encode([h.item for h in pending.embeddings])
        elapsed_ms = (time.perf_counter() - start) * 1000
        self.metrics.embedding_wait_ms.observe(elapsed_ms)
        self.encoder_metrics.encode_ms.observe(elapsed_ms)
        return embeddings

    def encoder_stats(self) -> dict:
        """The in-process pool's counters (forwards, cache, dedup): for tests and debugging."""
        return self.pool.stats()._asdict()


ColocatedLLMDeployment = serve.deployment(ColocatedLLM, name="LLM")
