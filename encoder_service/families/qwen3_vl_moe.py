"""Encoder face of Qwen3-VL-MoE: Qwen3-VL's (the same ViT, merger and DeepStack mergers), built as
`transformers`' `Qwen3VLMoeVisionModel` from the checkpoint's vision config."""

from __future__ import annotations

from torch import nn

from encoder_service.families.qwen3_vl import Qwen3VLEncoderFace


class Qwen3VLMoeEncoderFace(Qwen3VLEncoderFace):
    def build(self) -> nn.Module:
        from transformers.initialization import no_init_weights
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        with no_init_weights():
            return Qwen3VLMoeVisionModel._from_config(self.config.vision_config, dtype=self.dtype)


ENCODER_FACE = Qwen3VLMoeEncoderFace
