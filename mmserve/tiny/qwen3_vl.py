"""Tiny Qwen3-VL (`qwen3_vl`): Qwen/Qwen3-VL-*-Instruct shrunk: a 16-px patch ViT with a learned
position grid and DeepStack mergers, interleaved M-RoPE, the Qwen2-VL image and Qwen3-VL video
processors with small pixel bounds, the Qwen3-VL chat template and special tokens.
"""

from __future__ import annotations

from mmserve.tiny.tokenizer import (QWEN3_ADDED_TOKENS, SPECIAL_TOKENS, build_tokenizer, chat_template, text_config,
                                    vision_token_ids)

VARIANTS: dict[str, str] = {}

# Qwen3's special tokens are Qwen2-VL's; its tool and thinking tags are plain added tokens
# (`special: false`: decoded into the text, as the released tokenizers decode them)
QWEN3_SPECIAL_TOKENS = SPECIAL_TOKENS

# The chat template of Qwen3-VL-*-Instruct: system turn only when given, media placeholders in
# place, tool calls in <tool_call> tags, tool responses grouped in one user turn.
QWEN3_CHAT_TEMPLATE = chat_template("qwen3_vl")

PATCH_SIZE = 16
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE
# Small pixel bounds (factor 32 = patch 16 x merge 2): images 4..64 tokens; a video's bounds are
# on frames x height x width (the Qwen3-VL video processor's rule).
MIN_PIXELS = FACTOR * FACTOR * 4
MAX_PIXELS = FACTOR * FACTOR * 64
VIDEO_MIN_PIXELS = FACTOR * FACTOR * 8
VIDEO_MAX_PIXELS = FACTOR * FACTOR * 64
DEEPSTACK_VISUAL_INDEXES = (0, 1)


def config(tokenizer, config_class=None, **text_overrides):
    """The tiny `Qwen3VLConfig` for `tokenizer`'s vocabulary (`config_class` and `text_overrides`:
    a sibling model type with the same vision side, e.g. Qwen3-VL-MoE)."""
    from transformers import Qwen3VLConfig

    text = text_config(tokenizer, num_hidden_layers=3, head_dim=16, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        **text_overrides)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
                  num_position_embeddings=64, deepstack_visual_indexes=list(DEEPSTACK_VISUAL_INDEXES),
                  initializer_range=0.2)
    return (config_class or Qwen3VLConfig)(text_config=text, vision_config=vision, **vision_token_ids(tokenizer),
                                           tie_word_embeddings=False)


def build(name: str, seed: int, make_config=config, chat_template: str = QWEN3_CHAT_TEMPLATE):
    """The tiny Qwen3-VL (see `mmserve.tiny` for the contract); `make_config(tokenizer)` and
    `chat_template`: those of a sibling with the same processor (Qwen3-VL-MoE, Qwen3.5)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokenizer = build_tokenizer(seed, 1024, QWEN3_SPECIAL_TOKENS, added_tokens=QWEN3_ADDED_TOKENS)
    model_config = make_config(tokenizer)
    norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    sizes = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                            **sizes, **norm)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
                                            cap_pixels_per_frame=False, fps=2, **sizes, **norm)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                                 chat_template=chat_template)
    text = model_config.text_config
    return model_config, processor, [text.eos_token_id, text.bos_token_id], seed
