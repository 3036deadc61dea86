"""LM side of LLaVA (`model_type: llava`): the plain text decoder of `text_config` (Llama,
Qwen2, Mistral, ...) with 1-D positions (`position_ids` of shape `(1, L)`, no M-RoPE, no delta),
and the checkpoint's language-model keys.

Key layouts of the language model:
- transformers >= 4.52 in memory (`LlavaForConditionalGeneration.state_dict()`):
  `model.language_model.<decoder key>` and `lm_head.weight`;
- hub llava-*-hf checkpoints (transformers 4.x) and what transformers 5.x `save_pretrained`
  writes: `language_model.model.<decoder key>` and `language_model.lm_head.weight`.
With `tie_word_embeddings` (llava-interleave-qwen-0.5b) the checkpoint has no lm_head tensor:
the lm_head is the embedding table.
"""

from __future__ import annotations

from llm_service.families.base import LMFace, decoder_key

_DECODER_PREFIXES = ("model.language_model.", "language_model.model.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def rename(key: str) -> str | None:
    """Checkpoint key -> `decoder.*` / `lm_head.weight` (None: not a language-model tensor)."""
    return decoder_key(key, _DECODER_PREFIXES, _LM_HEAD_KEYS)


def decoder_class(config) -> type:
    """The base model class of `config.text_config` (e.g. `LlamaModel`, `Qwen2Model`), as
    `LlavaModel` builds it with `AutoModel.from_config(text_config)`."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(config.text_config)]


class LlavaLMFace(LMFace):
    rename = staticmethod(rename)

    def decoder_class(self) -> type:
        return decoder_class(self.config)


LM_FACE = LlavaLMFace
