"""Encoder face of Qwen3-VL-MoE: Qwen3-VL's (the same ViT, merger and DeepStack mergers), built as
`transformers`' `Qwen3VLMoeVisionModel` from the checkpoint's vision config."""

from __future__ import annotations

from torch import nn

from encoder_service.families.qwen3_vl import Qwen3VLEncoderFace


class Qwen3VLMoeEncoderFace(Qwen3VLEncoderFace):
    def tower_class(self) -> type[nn.Module]:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel


ENCODER_FACE = Qwen3VLMoeEncoderFace
