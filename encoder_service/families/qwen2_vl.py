"""Encoder face of Qwen2-VL / Qwen2.5-VL: the vision tower, its processors, its packed forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder_service.batching import temporal_groups
from encoder_service.families.base import EncoderFace, PreparedItem
from encoder_service.vit_attention import use_packed_attention
from mmserve.checkpoint import strip_prefix
from mmserve.media import MediaItem, MediaKind, decode_image, video_frames

# Legacy checkpoints (every released Qwen2-VL) name the tower `visual.*`; transformers >= 4.52
# in-memory layout is `model.visual.*`.
VISION_PREFIXES = ("visual.", "model.visual.")


class QwenVLEncoderFace(EncoderFace):
    """Images and videos as flat patches, one packed varlen forward (`cu_seqlens`, no padding)."""

    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        from transformers import AutoProcessor

        self.config = config
        self.dtype = dtype
        processor = AutoProcessor.from_pretrained(model_dir)
        self.image_processor = processor.image_processor
        self.video_processor = processor.video_processor
        self.merge = int(config.vision_config.spatial_merge_size)

    def rename(self, key: str) -> str | None:
        return strip_prefix(key, VISION_PREFIXES)

    def build(self) -> nn.Module:
        from transformers.initialization import no_init_weights

        if self.config.model_type == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as Tower,
            )
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
        with no_init_weights():
            tower = Tower._from_config(self.config.vision_config, dtype=self.dtype)
        return use_packed_attention(tower)  # one attention call per layer over the whole batch

    def preprocess_fingerprint(self) -> str:
        return self.image_processor.to_json_string() + self.video_processor.to_json_string()

    def _prepared(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> PreparedItem:
        t, h, w = grid
        return PreparedItem((pixels,), grid, t * h * w // (self.merge * self.merge), t * h * w)

    def preprocess(self, item: MediaItem, layout) -> PreparedItem:
        """Decode (EXIF orientation applied) and run the checkpoint's image/video processor."""
        if item.kind is MediaKind.IMAGE:
            out = self.image_processor(images=[decode_image(item.frames[0])], return_tensors="pt")
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        elif item.decoded is not None and layout is not None:
            # sized as the router planned it: a streamed video's group of frames is resized as
            # the whole video is (the processor would size a few frames alone differently)
            patch = self.video_processor.patch_size
            frames = resized_frames(self.video_processor, item.decoded.pixels, layout.grid[1] * patch,
                                    layout.grid[2] * patch)
            out = self.video_processor(videos=[frames], do_sample_frames=False, do_resize=False, return_tensors="pt")
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        else:
            out = self.video_processor(videos=[video_frames(item)], do_sample_frames=False, return_tensors="pt")
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        grid = tuple(int(x) for x in grid[0].tolist())
        if layout is not None and grid != layout.grid:  # the router sized it from the header
            raise RuntimeError(f"processor grid {grid} differs from the router's {layout.grid}")
        return self._prepared(pixels, grid)

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        pixels = torch.cat([p.tensors[0] for p in batch])
        device = next(module.parameters()).device
        grid_thw = torch.tensor([p.layout for p in batch], dtype=torch.long, device=device)
        merged = module(pixels.to(device, self.dtype), grid_thw=grid_thw).pooler_output
        return [(out,) for out in torch.split(merged, [p.num_tokens for p in batch])]

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Groups of whole temporal patches: the ViT attends only within a temporal patch, so the
        groups' outputs concatenated equal the whole item's (rows are temporal-patch-major)."""
        t, h, w = prepared.layout
        if t < 2:
            return [prepared]
        pixels = prepared.tensors[0]
        groups = temporal_groups(t, prepared.cost(unit) // t, budget)
        return [self._prepared(pixels[a * h * w:b * h * w], (b - a, h, w)) for a, b in groups]


def resized_frames(processor, pixels, height: int, width: int) -> torch.Tensor:
    """(frames, 3, height, width) uint8: `pixels` (frames, H, W, 3) resized by the processor's
    own resize op, as its `_preprocess` resizes a whole video to the size it computed."""
    from transformers.image_utils import SizeDict

    video = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()[None]  # (1, T, C, H, W), stacked as there
    resize = super(type(processor), processor).resize
    return resize(image=video, size=SizeDict(height=height, width=width), resample=processor.resample)[0]


ENCODER_FACE = QwenVLEncoderFace
