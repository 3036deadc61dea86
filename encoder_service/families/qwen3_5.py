"""Encoder face of Qwen3.5: `Qwen3_5VisionModel`, Qwen3-VL's ViT and merger without DeepStack.

Per item the output is one part, the merged rows the LM takes at the item's slots (no per-layer
features). Preprocessing, packing, temporal splitting and streamed video groups are Qwen3-VL's
(attention within a temporal patch, so a video's groups concatenate to the whole item's rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder_service.families.base import PreparedItem
from encoder_service.families.qwen3_vl import Qwen3VLEncoderFace


class Qwen3_5EncoderFace(Qwen3VLEncoderFace):
    def tower_class(self) -> type[nn.Module]:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    def build(self) -> nn.Module:
        from transformers.initialization import no_init_weights

        with no_init_weights():
            return self.tower_class()._from_config(self.config.vision_config, dtype=self.dtype)

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        device = next(module.parameters()).device
        grid_thw = torch.tensor([p.layout for p in batch], dtype=torch.long, device=device)
        out = module(self.pixel_values(batch, device).to(self.dtype), grid_thw=grid_thw)
        return [(rows,) for rows in torch.split(out.pooler_output, [p.num_tokens for p in batch])]


ENCODER_FACE = Qwen3_5EncoderFace
