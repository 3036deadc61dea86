"""LM face of Qwen3-VL: the text decoder (interleaved M-RoPE, 3 rows) and DeepStack injection.

An item's parts are `(embeddings, *deepstack features)`. The embeddings replace the input rows at
the item's slots; feature `k` is added to the hidden states after decoder layer `k` at the same
positions: `Qwen3VLTextModel` takes them as `visual_pos_masks` `(1, T)` and
`deepstack_visual_embeds` (one `(num_visual, hidden)` tensor per layer, rows in position order).
With chunked prefill the engine hands over each item's parts already sliced to the chunk's slots.

Dense Qwen3-VL runs the engine's own decoder (`llm_service.model.layers`: q/k norms, interleaved
M-RoPE from `transformers`' rotary module, the same DeepStack arguments); `Qwen3VLLMFace`, which
the MoE face shares, builds `transformers`' text model.
"""

from __future__ import annotations

import torch

from llm_service.families.qwen2_vl import PackedLanguageModel, QwenVLLMFace
from llm_service.model import layers
from llm_service.model.transfer import to_device


class Qwen3VLLMFace(QwenVLLMFace):
    def decoder_class(self) -> type:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

        return Qwen3VLTextModel

    def inject(self, embeds: torch.Tensor, media: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> dict:
        super().inject(embeds, media)
        if not media or len(media[0][1]) < 2:
            return {}
        dev = embeds.device
        index = to_device(torch.cat([i for i, _ in media]), dev)
        order = torch.argsort(index)  # the decoder reads the features in mask (position) order
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool, device=dev)
        mask[index] = True
        layers = [to_device(torch.cat([parts[k] for _, parts in media]), dev).to(embeds.dtype)[order]
                  for k in range(1, len(media[0][1]))]
        return {"visual_pos_masks": mask.unsqueeze(0), "deepstack_visual_embeds": layers}


class Qwen3VLDenseLMFace(Qwen3VLLMFace):
    modules_class = PackedLanguageModel

    def build_decoder(self, dtype: torch.dtype) -> layers.Decoder:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        text = self.config.text_config
        return layers.Decoder(text, dtype, Qwen3VLTextRotaryEmbedding(text), layers.qwen3_spec(text))


LM_FACE = Qwen3VLDenseLMFace
