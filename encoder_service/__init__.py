"""Vision-encoder runtime: loads only the vision tower, preprocesses media, packed ViT forward.

Ray-free and pydantic-free by design (DESIGN.md): `deployments/` wraps it.
"""

from encoder_service.runtime import PreparedItem, VisionEncoder

__all__ = ["PreparedItem", "VisionEncoder"]
