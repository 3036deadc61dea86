"""LM face of Qwen2-VL / Qwen2.5-VL: the text decoder, embedding table and lm_head."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.checkpoint import strip_prefix
from mmserve.positions import LinearPositions, PositionPlan

# transformers >= 4.52 layout first, then the legacy one of every released checkpoint.
_DECODER_PREFIXES = ("model.language_model.", "model.")
_VISION_PREFIXES = ("visual.", "model.visual.")
LM_HEAD_KEY = "lm_head.weight"


class QwenVLLMFace:
    def __init__(self, family: str):
        self.family = family

    @staticmethod
    def rename(key: str) -> str | None:
        """Checkpoint key -> key in `LanguageModelModules` (None: not a language-model tensor)."""
        if key.startswith(_VISION_PREFIXES):
            return None
        if key == LM_HEAD_KEY:
            return "lm_head.weight"
        name = strip_prefix(key, _DECODER_PREFIXES)
        return None if name is None else "decoder." + name

    @staticmethod
    def text_positions() -> PositionPlan:
        return LinearPositions(rows=3)

    @staticmethod
    def position_ids(positions: torch.Tensor) -> torch.Tensor:
        """`(3, T)` M-RoPE rows of a packed sequence -> the decoder's `(3, 1, T)`."""
        return positions.unsqueeze(1)

    def build(self, config, dtype: torch.dtype) -> LanguageModelModules:
        from transformers.initialization import no_init_weights

        if self.family == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel as Decoder
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel as Decoder
        text = config.text_config
        with no_init_weights():
            decoder = Decoder._from_config(text, dtype=dtype)
            lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        return LanguageModelModules(decoder, lm_head, tied)


class LanguageModelModules(nn.Module):
    """Decoder stack (embeddings, layers, norm) + lm_head, named as `QwenVLLMFace.rename` maps."""

    def __init__(self, decoder: nn.Module, lm_head: nn.Linear, tied: bool):
        super().__init__()
        self.decoder = decoder
        self.lm_head = lm_head
        self.tied = tied

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.tied:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
            self.load_state_dict(state, strict=False)
            self.lm_head.weight = self.decoder.embed_tokens.weight
            missing = set(self.state_dict()) - set(state) - {"lm_head.weight"}
        else:
            missing = set(self.state_dict()) - set(state)
            self.load_state_dict(state, strict=True)
        if missing:
            raise ValueError(f"checkpoint lacks language-model tensors: {sorted(missing)[:5]}")
