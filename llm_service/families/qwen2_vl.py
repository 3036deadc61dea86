"""LM face of Qwen2-VL / Qwen2.5-VL: the text decoder (3-row M-RoPE), embedding table and lm_head.

`QwenVLLMFace` holds what the Qwen VL families share (checkpoint names, positions); Qwen2-VL and
Qwen2.5-VL (and dense Qwen3-VL) run the engine's own decoder (`llm_service.model.layers`), whose
packed projections are made from the checkpoint's separate ones as they load; `transformers`'
text model is its reference.
"""

from __future__ import annotations

import torch

from llm_service.families.base import LanguageModelModules, LMFace, decoder_key
from llm_service.model import layers
from mmserve.inputs.positions import LinearPositions, PositionPlan

# transformers >= 4.52 layout first, then the legacy one of every released checkpoint.
_DECODER_PREFIXES = ("model.language_model.", "model.")
_VISION_PREFIXES = ("visual.", "model.visual.")


class QwenVLLMFace(LMFace):
    def rename(self, key: str) -> str | None:
        return None if key.startswith(_VISION_PREFIXES) else decoder_key(key, _DECODER_PREFIXES)

    def text_positions(self) -> PositionPlan:
        return LinearPositions(rows=3)

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """`(3, T)` M-RoPE rows of a packed sequence -> the decoder's `(3, 1, T)`."""
        return positions.unsqueeze(1)

    def decoder_class(self) -> type:
        if self.config.model_type == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

            return Qwen2VLTextModel
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

        return Qwen2_5_VLTextModel


class PackedLanguageModel(LanguageModelModules):
    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return layers.pack_checkpoint_tensors(waiting)


class Qwen2VLLMFace(QwenVLLMFace):
    modules_class = PackedLanguageModel

    def build_decoder(self, dtype: torch.dtype) -> layers.Decoder:
        # the rotary module of both families computes the same (Qwen2.5-VL's is a copy)
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

        text = self.config.text_config
        return layers.Decoder(text, dtype, Qwen2VLRotaryEmbedding(text), layers.qwen2_spec(text))


LM_FACE = Qwen2VLLMFace
