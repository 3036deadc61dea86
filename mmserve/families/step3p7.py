"""Router face of Step3 (`model_type: step3p7`): an image becomes its local crops (row-major,
`<patch_newline>` after each grid row but the last), then its global view:

    (<patch_start> <im_patch> * crop_tokens <patch_end> [<patch_newline>]) * crops
    <im_start> <im_patch> * global_tokens <im_end>

`Step3p7Processor.replace_image_token`. The crop grid follows from width and height alone
(`Step3p7ImageProcessor._plan_patches`, reproduced in `plan_crops`). Structure tokens take no
encoder rows (`is_embed`). Plain 1-D positions. Images only: Step3 has no video processor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.errors import InvalidRequest
from mmserve.families.base import ItemExpansion, RouterFace
from mmserve.inputs.media import MediaItem, MediaKind, read_image_size

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

IMAGE_TOKEN = "<im_patch>"
STRUCTURE = ("<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>")


@dataclass(frozen=True)
class CropLayout:
    """One image: `cols x rows` local crops (0 x 0: none) and the tokens of a crop / the global view."""

    cols: int
    rows: int
    crop_tokens: int
    global_tokens: int

    @property
    def num_crops(self) -> int:
        return self.cols * self.rows

    @property
    def num_embeds(self) -> int:
        return self.num_crops * self.crop_tokens + self.global_tokens


def plan_crops(width: int, height: int, image_size: int, patch_size: int, max_image_size: int) -> tuple[int, int]:
    """(cols, rows) of local crops, as `Step3p7ImageProcessor._plan_patches` plans them."""
    if min(width, height) < 32 and max(width / height, height / width) > 4:
        width = height = max(width, height)  # extreme aspect: squared by zero padding
    if max(height, width) > max_image_size:
        scale = max_image_size / max(height, width)
        width, height = int(width * scale), int(height * scale)
    short, long = min(height, width), max(height, width)
    if long <= image_size:
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, patch_size)
    else:
        window = patch_size
    if window == 0:
        return 0, 0
    crop_w, crop_h = (
        window * (d // window + (d % window > 0.2 * window)) if d >= window else d for d in (width, height)
    )
    return max(1, crop_w // window), max(1, crop_h // window)


@dataclass(frozen=True)
class Step3RouterFace(RouterFace):
    image_token_id: int
    structure_ids: dict
    image_size: int  # global view side
    patch_size: int  # local crop side
    max_image_size: int
    stride: int  # ViT patch x downsampler stride: one output token per stride x stride pixels

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> Step3RouterFace:
        processor = json.loads((Path(model_dir) / "processor_config.json").read_text())["image_processor"]
        tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
        if missing := [t for t in (IMAGE_TOKEN, *STRUCTURE) if t not in added]:
            raise ValueError(f"the tokenizer of {model_dir} lacks Step3's tokens {missing}")
        return cls(image_token_id=added[IMAGE_TOKEN], structure_ids={t: added[t] for t in STRUCTURE},
                   image_size=int(processor.get("size", {}).get("height", 728)),
                   patch_size=int(processor.get("patch_size", 504)),
                   max_image_size=int(processor.get("max_image_size", 3024)),
                   stride=int(processor.get("vision_patch_size", 14)) * int(processor.get("downsampler_stride", 4)))

    def placeholder(self, kind: MediaKind) -> str | None:
        return IMAGE_TOKEN if kind is MediaKind.IMAGE else None

    def layout(self, height: int, width: int) -> CropLayout:
        cols, rows = plan_crops(width, height, self.image_size, self.patch_size, self.max_image_size)
        return CropLayout(cols, rows, (self.patch_size // self.stride) ** 2, (self.image_size // self.stride) ** 2)

    def expand(self, item: MediaItem, max_pixels: int) -> ItemExpansion:
        if item.kind is not MediaKind.IMAGE:
            raise InvalidRequest(f"this model takes images only, not {item.kind.value}")
        height, width = read_image_size(item.frames[0], max_pixels)
        layout = self.layout(height, width)
        s = self.structure_ids
        tokens, embed = [], []

        def block(start: str, n: int, end: str) -> None:
            tokens.extend((s[start], *(self.image_token_id,) * n, s[end]))
            embed.extend((False, *(True,) * n, False))

        for index in range(layout.num_crops):
            block("<patch_start>", layout.crop_tokens, "<patch_end>")
            if index % layout.cols == layout.cols - 1 and index // layout.cols < layout.rows - 1:
                tokens.append(s["<patch_newline>"])
                embed.append(False)
        block("<im_start>", layout.global_tokens, "<im_end>")
        return ItemExpansion(tuple(tokens), tuple(embed), cost=layout.num_embeds, layout=layout)


ROUTER_FACE = Step3RouterFace
