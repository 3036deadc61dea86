"""Encoder deployment: wraps `encoder_service.VisionEncoder` (GPU replicas in production)."""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from ray import serve

from deployments.metrics import EncoderMetrics
from encoder_service import VisionEncoder
from mmserve.errors import InvalidRequest
from mmserve.media import MediaItem

logger = logging.getLogger("ray.serve")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@serve.deployment
class EncoderDeployment:
    def __init__(self, model_dir: str, dtype: str, device: str):
        self.encoder = VisionEncoder(model_dir, dtype=dtype, device=resolve_device(device))
        self.metrics = EncoderMetrics()
        self._in_flight = 0

    async def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """One embedding `(num_tokens, hidden)` (CPU) per item; InvalidRequest if one cannot be decoded."""
        start = time.perf_counter()
        self._in_flight += len(items)
        self.metrics.in_flight.set(self._in_flight)
        try:
            embeddings = await asyncio.to_thread(self.encoder.encode, items)
        except InvalidRequest:
            self.metrics.failures.inc()
            raise
        except Exception as e:
            self.metrics.failures.inc()
            logger.exception("encoding %d items failed", len(items))
            raise InvalidRequest(f"cannot encode media: {e}") from None
        finally:
            self._in_flight -= len(items)
            self.metrics.in_flight.set(self._in_flight)
        for item, embedding in zip(items, embeddings):
            self.metrics.items.inc(tags={"kind": item.kind.value})
            self.metrics.tokens.inc(embedding.shape[0])
        self.metrics.encode_ms.observe((time.perf_counter() - start) * 1000)
        return embeddings

    def check_health(self) -> None:
        if not any(True for _ in self.encoder.tower.parameters()):
            raise RuntimeError("vision tower has no parameters")
