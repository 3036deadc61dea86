"""Router face of LLaVA (`model_type: llava`, CLIP or SigLIP tower): every image is resized to the
tower's fixed input, so every image expands to the same number of `<image>` tokens; plain 1-D
positions. Images only: LLaVA's processor takes no video.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmserve.errors import InvalidRequest
from mmserve.families.base import ItemExpansion, RouterFace
from mmserve.inputs.media import MediaItem, MediaKind, read_image_size

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

IMAGE_TOKEN = "<image>"
# Rows a tower puts before its patches (CLIP: the CLS embedding).
LEADING_ROWS = {"clip_vision_model": 1, "siglip_vision_model": 0}


def image_token_count(vision_model_type: str, image_size: int, patch_size: int, strategy: str) -> int:
    """Encoder rows (= `<image>` tokens) of one image: `(image_size // patch_size) ** 2` patches,
    plus the tower's leading CLS row, minus 1 for strategy `default` (which drops the first row).

    `LlavaProcessor` expands `<image>` to `(H // p) * (W // p) + num_additional_image_tokens -
    (strategy == "default")` for the processed size (H, W), which is the tower's input size.
    """
    if vision_model_type not in LEADING_ROWS:
        raise ValueError(f"unsupported LLaVA vision tower {vision_model_type!r}")
    rows = (image_size // patch_size) ** 2 + LEADING_ROWS[vision_model_type]
    return rows - 1 if strategy == "default" else rows


@dataclass(frozen=True)
class LlavaRouterFace(RouterFace):
    image_token_id: int
    tokens_per_image: int

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> LlavaRouterFace:
        vision = config.vision_config
        tokens = image_token_count(vision.model_type, int(vision.image_size), int(vision.patch_size),
                                   config.vision_feature_select_strategy)
        return cls(image_token_id=int(config.image_token_id), tokens_per_image=tokens)

    def placeholder(self, kind: MediaKind) -> str | None:
        return IMAGE_TOKEN if kind is MediaKind.IMAGE else None

    def expand(self, item: MediaItem, max_pixels: int) -> ItemExpansion:
        if item.kind is not MediaKind.IMAGE:
            raise InvalidRequest(f"this model takes images only, not {item.kind.value}")
        read_image_size(item.frames[0], max_pixels)  # a readable image within the pixel limit
        n = self.tokens_per_image
        return ItemExpansion((self.image_token_id,) * n, None, cost=n)


ROUTER_FACE = LlavaRouterFace
