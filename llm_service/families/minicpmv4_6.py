"""LM face of MiniCPM-V 4.6 (`model_type: minicpmv4_6`): not served yet.

Its language model defaults to `qwen3_5_text`, a hybrid in which 3 of every 4 layers are
Gated-DeltaNet linear attention. Those layers carry a recurrent state (conv + SSM-like state) per
sequence, which the paged KV engine has no place for; serving them is the "Hybrid language models"
issue. Until then an LLM replica refuses the checkpoint at startup with this explanation, while
its router and encoder faces serve (encoder-only deployments, `mmserve encoder-server`).
"""

from __future__ import annotations

from llm_service.families.base import LMFace


class MiniCPMVLMFace(LMFace):
    def __init__(self, config):
        text = getattr(config, "text_config", None)
        layer_types = sorted(set(getattr(text, "layer_types", None) or []))
        raise ValueError(
            f"MiniCPM-V 4.6's language model ({getattr(text, 'model_type', '?')}, layer types {layer_types}) "
            "has linear-attention layers with recurrent state, which the paged LLM engine cannot serve yet; "
            "only its router and encoder faces are available (e.g. `mmserve encoder-server`)"
        )

    rename = build = text_positions = position_ids = None  # never reached: __init__ refuses


LM_FACE = MiniCPMVLMFace
