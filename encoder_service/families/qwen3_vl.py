"""Encoder face of Qwen3-VL: the ViT + merger and its DeepStack mergers.

Per item the output parts are `(embeddings, *deepstack features)`: the merged rows the LM takes at
the item's slots, then one part per `deepstack_visual_indexes` layer (same rows, the LM's hidden
size), which the LM adds to the hidden states of its first layers. Preprocessing, packing and
temporal splitting are Qwen2-VL's (attention stays within a temporal patch, so a video's groups
concatenate to the whole item in every part).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder_service.families.base import PreparedItem
from encoder_service.families.qwen2_vl import QwenVLEncoderFace
from mmserve.families import qwen3_vl as router


class Qwen3VLEncoderFace(QwenVLEncoderFace):
    video_grid = staticmethod(router.video_grid)

    def tower_class(self) -> type[nn.Module]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        device = next(module.parameters()).device
        grid_thw = torch.tensor([p.layout for p in batch], dtype=torch.long, device=device)
        out = module(self.pixel_values(batch, device).to(self.dtype), grid_thw=grid_thw)
        sizes = [p.num_tokens for p in batch]
        features = getattr(out, "deepstack_features", None) or ()  # Qwen3.5's tower has none
        parts = [torch.split(out.pooler_output, sizes)] + [torch.split(f, sizes) for f in features]
        return [tuple(part[i] for part in parts) for i in range(len(batch))]


ENCODER_FACE = Qwen3VLEncoderFace
