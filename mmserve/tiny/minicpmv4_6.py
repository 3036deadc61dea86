"""Tiny MiniCPM-V 4.6 (`model_type: minicpmv4_6`): SigLIP-style ViT with the window-attention
merger after layer 1 and the MLP merger, the default `qwen3_5_text` hybrid LM (linear + full
attention layers) at toy sizes. Processors shrunk (`scale_resolution` 112, patch 14) so 40-200 px
images give several slices; the tokenizer names MiniCPM-V's extra special tokens.
"""

from __future__ import annotations

from mmserve.tiny.tokenizer import QWEN3_ADDED_TOKENS, SPECIAL_TOKENS, build_tokenizer, chat_template

VARIANTS: dict[str, str] = {}

MINICPMV_NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "image_start_token": "<image>", "image_end_token": "</image>",
    "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}
# Qwen3.5's tokenizer (the LM's) with MiniCPM-V's image, slice and video tags added as special
MINICPMV_SPECIAL_TOKENS = tuple(dict.fromkeys((*SPECIAL_TOKENS, *MINICPMV_NAMED_TOKENS.values(), "<video>", "</video>")))
MINICPMV_SCALE = 112
# Weights drawn at seed + 1: of offsets 0-9 (the tokenizer with Qwen3.5's added tokens), one whose
# greedy answers depend on the image and differ most between 8 text prompts (7 answers, 5 first
# tokens); at seed + 0 they barely differ (3 answers, 1 first token).
INIT_SEED_OFFSET = 1

# ChatML with one image / video token per item where the message puts it.
MINICPMV_CHAT_TEMPLATE = chat_template("minicpmv4_6")


def build(name: str, seed: int):
    from transformers import MiniCPMV4_6Config
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    tokenizer = build_tokenizer(seed, 1024, MINICPMV_SPECIAL_TOKENS, added_tokens=QWEN3_ADDED_TOKENS,
                                extra_special_tokens=MINICPMV_NAMED_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        model_type="qwen3_5_text", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        initializer_range=0.2, pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  image_size=MINICPMV_SCALE, patch_size=14, insert_layer_id=1)
    config = MiniCPMV4_6Config(
        text_config=text, vision_config=vision, insert_layer_id=1,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"))
    processor = MiniCPMV4_6Processor(
        image_processor=MiniCPMV4_6ImageProcessor(scale_resolution=MINICPMV_SCALE, max_slice_nums=9),
        video_processor=MiniCPMV4_6VideoProcessor(scale_resolution=MINICPMV_SCALE, max_slice_nums=2),
        tokenizer=tokenizer, chat_template=MINICPMV_CHAT_TEMPLATE)
    return config, processor, [ids("<|im_end|>"), ids("<|endoftext|>")], seed + INIT_SEED_OFFSET
