"""LM face of Qwen3.5: its `qwen3_5_text` hybrid decoder with Qwen's M-RoPE positions.

The decoder is MiniCPM-V 4.6's (`llm_service.families.qwen3_5_text`): Gated-DeltaNet
linear-attention layers (3 of every 4, `layer_types`) run the packed step on per-sequence state
slots and are declared in `state_layers` (so the engine sizes state slots and keeps prefix
snapshots at block boundaries), the full-attention layers keep the paged K/V path. Positions are
the router's 3-row interleaved M-RoPE plan, as Qwen3-VL's, passed as `(3, 1, T)`: the decoder's
rotary embedding interleaves them over the rotated part of each head (`partial_rotary_factor`).
Media rows replace the input rows at the slots; there is no DeepStack.

Checkpoint keys: `model.language_model.*` and `lm_head.weight`; `model.visual.*` and the
multi-token-prediction layers (`mtp.*`) are not read.
"""

from __future__ import annotations

from llm_service.families.qwen2_vl import QwenVLLMFace
from llm_service.families.qwen3_5_text import HybridLMFace


class Qwen3_5LMFace(HybridLMFace, QwenVLLMFace):
    """The hybrid decoder's face with Qwen's checkpoint keys and M-RoPE positions."""


LM_FACE = Qwen3_5LMFace
