"""Tiny Qwen3.5 (`qwen3_5`): Qwen/Qwen3.5-* shrunk, natively multimodal with a hybrid decoder.

Structure as the published configs: a 16-px patch ViT without DeepStack, a `qwen3_5_text` decoder of
Gated-DeltaNet linear-attention and full-attention layers (3 of every 4 linear), interleaved M-RoPE
on a quarter of each head, untied lm_head; Qwen3-VL's tiny processor and tokenizer. The chat template
follows Qwen3.5's published one (turns, tools as `<tool_call><function=NAME>` XML, a thinking block
opened by the generation prompt unless `enable_thinking` is false), its instructions shortened.
"""

from __future__ import annotations

from mmserve.tiny import qwen3_vl
from mmserve.tiny.tokenizer import chat_template, text_config, vision_token_ids

VARIANTS: dict[str, str] = {}

LAYERS = 4  # 3 linear-attention layers, then a full-attention one
HEAD_DIM = 32  # the rotary part: 8 of 32 dims (4 frequencies: mrope_section [2, 1, 1])
# Weights drawn at the builder's seed (offset 0): of offsets 0-9 (the tokenizer with Qwen3's plain
# added tokens), one where both families' greedy answers depend on the images, differ between all
# 8 of a set of text prompts, and end every forced tool call (greedy and sampled) before 800
# tokens; at other offsets the 8 prompts got as few as 2 answers, or greedy forced calls ran on
# to the limit, or the MoE sibling ignored the image.
INIT_SEED_OFFSET = 0

QWEN3_5_CHAT_TEMPLATE = chat_template("qwen3_5")


def config(tokenizer, config_class=None, **text):
    """The tiny `Qwen3_5Config` (`config_class`, `text`: the MoE sibling's class and decoder fields);
    its ViT is Qwen3-VL's without DeepStack."""
    from transformers import Qwen3_5Config

    decoder = text_config(
        tokenizer, num_hidden_layers=LAYERS, head_dim=HEAD_DIM, tie_word_embeddings=False,
        layer_types=["linear_attention"] * (LAYERS - 1) + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **text)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=qwen3_vl.PATCH_SIZE, spatial_merge_size=qwen3_vl.MERGE_SIZE, temporal_patch_size=2,
                  num_position_embeddings=64, initializer_range=0.2)
    return (config_class or Qwen3_5Config)(text_config=decoder, vision_config=vision, **vision_token_ids(tokenizer),
                                           tie_word_embeddings=False)


def build(name: str, seed: int, make_config=config):
    """The tiny Qwen3.5 (see `mmserve.tiny` for the contract): Qwen3-VL's processor and tokenizer,
    the Qwen3.5 config and chat template."""
    config, processor, eos_ids, _ = qwen3_vl.build(name, seed, make_config, QWEN3_5_CHAT_TEMPLATE)
    return config, processor, eos_ids, seed + INIT_SEED_OFFSET
