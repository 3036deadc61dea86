"""Encoder face of Qwen3.5-MoE: Qwen3.5's, built as `transformers`' `Qwen3_5MoeVisionModel` (the
same tower under the MoE model's class)."""

from __future__ import annotations

from torch import nn

from encoder_service.families.qwen3_5 import Qwen3_5EncoderFace


class Qwen3_5MoeEncoderFace(Qwen3_5EncoderFace):
    def tower_class(self) -> type[nn.Module]:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel


ENCODER_FACE = Qwen3_5MoeEncoderFace
