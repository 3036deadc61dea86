"""Encoder face of Qwen3.5: `Qwen3_5VisionModel`, Qwen3-VL's ViT and merger without DeepStack.

Per item the output is one part, the merged rows the LM takes at the item's slots (no per-layer
features). Preprocessing, packing, temporal splitting and streamed video groups are Qwen3-VL's
(attention within a temporal patch, so a video's groups concatenate to the whole item's rows).
"""

from __future__ import annotations

from torch import nn

from encoder_service.families.qwen3_vl import Qwen3VLEncoderFace


class Qwen3_5EncoderFace(Qwen3VLEncoderFace):
    def tower_class(self) -> type[nn.Module]:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel


ENCODER_FACE = Qwen3_5EncoderFace
