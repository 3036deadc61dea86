"""Encoder face of MiniCPM-V 4.6 (`model_type: minicpmv4_6`): the SigLIP-style ViT with its
window-attention merger (after layer `insert_layer_id`) and the MLP merger, no resampler.

The processor packs an item's views (an image's source view then its slices; a video's frames,
each a source view then slices) NaViT-style: `pixel_values` `(1, 3, patch, sum of view patches *
patch)` and `target_sizes` `(views, 2)` patch grids. The tower attends within a view only
(`cu_seqlens`), so a view is a sub-item for the token budget: `split` cuts an item into runs of
whole views and a batch packs every item's views into one forward
(`MiniCPMV4_6Model.get_image_features`: tower, then the merger per view); an item's rows are its
views' rows in order. `downsample_mode` "4x" (no ViT merger) is honored as the config sets it.

Unlike the other faces, this one still runs its processor in `preprocess` (CPU threads) and
queues float32 views: the views and their sizes (and so the token counts and `split`'s cuts) come
out of the processor's slicing of the whole image (its best-grid search and per-view resizes), so
uint8 pieces of a split item would each re-run the whole item's slicing on the device, and the
face would need a second copy of that planning when no router layout comes with the item.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder_service.families.base import EncoderFace, PreparedItem
from mmserve.checkpoint import strip_prefix
from mmserve.inputs.media import MediaItem, MediaKind, decode_image, video_frames, video_metadata

_TOWER = ("model.vision_tower.",)
_MERGER = ("model.merger.",)


def rename(key: str) -> str | None:
    if (tower := strip_prefix(key, _TOWER)) is not None:
        return "tower." + tower
    merger = strip_prefix(key, _MERGER)
    return None if merger is None else "merger." + merger


class MiniCPMVVisionEncoder(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        from transformers.initialization import no_init_weights
        from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Merger, MiniCPMV4_6VisionModel

        self.use_vit_merger = config.downsample_mode != "4x"
        with no_init_weights():
            self.tower = MiniCPMV4_6VisionModel._from_config(config.vision_config, dtype=dtype)
            self.merger = MiniCPMV4_6Merger(config).to(dtype)

    def forward(self, pixels: torch.Tensor, target_sizes: torch.Tensor) -> list[torch.Tensor]:
        """Packed views -> per view `(tokens, text_hidden)` (`MiniCPMV4_6Model.get_image_features`)."""
        hidden = self.tower(pixels, target_sizes=target_sizes, use_vit_merger=self.use_vit_merger).last_hidden_state
        return self.merger(hidden, target_sizes // 2 if self.use_vit_merger else target_sizes)


class MiniCPMVEncoderFace(EncoderFace):
    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        super().__init__(model_dir, config, dtype)
        self.divisor = 4 if config.downsample_mode == "4x" else 16
        self.patch = int(config.vision_config.patch_size)

    rename = staticmethod(rename)

    def build(self) -> nn.Module:
        return MiniCPMVVisionEncoder(self.config, self.dtype)

    def _prepared(self, pixels: torch.Tensor, sizes: torch.Tensor) -> PreparedItem:
        patches = int((sizes[:, 0] * sizes[:, 1]).sum())
        tokens = int((sizes[:, 0] * sizes[:, 1] // self.divisor).sum())
        return PreparedItem((pixels, sizes), len(sizes), tokens, patches)

    def preprocess(self, item: MediaItem, layout) -> PreparedItem:
        if item.kind is MediaKind.IMAGE:
            out = self.image_processor(images=[decode_image(item.frames[0])], return_tensors="pt")
            pixels, sizes = out["pixel_values"], out["target_sizes"]
        else:
            out = self.video_processor(videos=[video_frames(item)], do_sample_frames=False,
                                       video_metadata=[video_metadata(item)], return_tensors="pt")
            pixels, sizes = out["pixel_values_videos"][:1], out["target_sizes_videos"]
        prepared = self._prepared(pixels, sizes.to(torch.long))
        if layout is not None and prepared.num_tokens != sum(layout.view_tokens()):
            raise RuntimeError("processor views differ from the router's plan")
        return prepared

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Runs of whole views, in order, each within `budget` where a single view fits."""
        pixels, sizes = prepared.tensors
        area = sizes[:, 0] * sizes[:, 1]
        costs = (area // self.divisor if unit == "tokens" else area).tolist()
        widths = (area * self.patch).tolist()  # columns of each view in the packed pixels
        pieces, start, used, column, first_column = [], 0, 0, 0, 0
        for index, cost in enumerate(costs):
            if used and used + cost > budget:
                pieces.append(self._prepared(pixels[..., first_column:column], sizes[start:index]))
                start, used, first_column = index, 0, column
            used += cost
            column += widths[index]
        pieces.append(self._prepared(pixels[..., first_column:column], sizes[start:]))
        return pieces

    def pixel_values(self, batch: Sequence[PreparedItem], device: torch.device) -> torch.Tensor:
        """The batch's views packed side by side (float32, as the processor made them), on `device`."""
        return torch.cat([p.tensors[0] for p in batch], dim=-1).to(device)

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        device = next(module.parameters()).device
        pixels = self.pixel_values(batch, device).to(self.dtype)
        sizes = torch.cat([p.tensors[1] for p in batch]).to(device)
        views = iter(module(pixels, sizes))  # an item's rows: its views' in order
        return [(torch.cat([next(views) for _ in range(p.tensors[1].shape[0])]),) for p in batch]


ENCODER_FACE = MiniCPMVEncoderFace
