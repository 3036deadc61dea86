"""Vision-encoder runtime: loads only the vision tower, preprocesses media, packed ViT forward,
token-budget batching across requests (`EncoderPool`), embedding cache.

Ray-free and pydantic-free by design (DESIGN.md): `deployments/` wraps it.
"""

from encoder_service.batching import BatchConfig
from encoder_service.families.base import PreparedItem
from encoder_service.pool import EncoderPool, PoolConfig
from encoder_service.runtime import VisionEncoder

__all__ = ["BatchConfig", "EncoderPool", "PoolConfig", "PreparedItem", "VisionEncoder"]
