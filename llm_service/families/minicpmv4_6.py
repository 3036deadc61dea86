"""LM face of MiniCPM-V 4.6 (`model_type: minicpmv4_6`): its `qwen3_5_text` hybrid decoder
(Gated-DeltaNet linear-attention layers with per-sequence state between full-attention layers,
`llm_service.families.qwen3_5_text`), 1-D positions, media rows injected at the embedding slots.

Checkpoint keys: `model.language_model.<decoder key>` and `lm_head.weight` (no lm_head with
`tie_word_embeddings`); the vision tower, the mergers and any `mtp.*` layers are not read.
"""

from __future__ import annotations

from llm_service.families.base import decoder_key
from llm_service.families.qwen3_5_text import HybridLMFace


class MiniCPMVLMFace(HybridLMFace):
    def rename(self, key: str) -> str | None:
        return decoder_key(key, ("model.language_model.",))


LM_FACE = MiniCPMVLMFace
