"""Tiny Step3 (`model_type: step3p7`, transformers' in-tree descendant of vLLM's `step3_vl`).

The real layer mix at toy sizes: full and `sliding_attention` layers (the sliding ones with their
own head count and RoPE theta), dense and sparse (MoE) MLPs, the per-head gate. The image
processor is shrunk so 40-200 px images give several local crops: global view 112 px (ViT patch 7,
two stride-2 downsamplers: 4 x 4 = 16 tokens), local crops 56 px (2 x 2 = 4 tokens each).
"""

from __future__ import annotations

from mmserve.tiny.tokenizer import build_tokenizer, chat_template

VARIANTS: dict[str, str] = {}

STEP3_IMAGE_TOKEN = "<im_patch>"
STEP3_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",  # DeepSeek-style, as Step-3.7's
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", STEP3_IMAGE_TOKEN, "<im_start>", "<im_end>",
    "<patch_start>", "<patch_end>", "<patch_newline>",
)
STEP3_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
STEP3_IMAGE_SIZE = 112  # global view side
STEP3_CROP_SIZE = 56  # local crop side
STEP3_VIT_PATCH = 7
STEP3_SLIDING_WINDOW = 24  # shorter than the long-prompt test

# A ChatML template that writes one `<im_patch>` per image where the message puts it.
STEP3_CHAT_TEMPLATE = chat_template("step3p7")


def build(name: str, seed: int):
    from transformers import Step3p7Config
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor
    from transformers.models.step3p7.processing_step3p7 import Step3p7Processor

    tokenizer = build_tokenizer(seed, 1024, STEP3_SPECIAL_TOKENS, added_tokens=STEP3_ADDED_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        sliding_window=STEP3_SLIDING_WINDOW, num_sliding_attention_heads=2,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, share_expert_dim=32,
        rope_theta=[10000.0, 5000.0, 5000.0, 10000.0], max_position_embeddings=4096,
        initializer_range=0.2, pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        tie_word_embeddings=False)
    vision = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=STEP3_IMAGE_SIZE,
        patch_size=STEP3_VIT_PATCH, mlp_ratio=2.0, initializer_range=0.2)
    config = Step3p7Config(text_config=text, vision_config=vision, image_token_id=ids(STEP3_IMAGE_TOKEN))
    image_processor = Step3p7ImageProcessor(
        size={"height": STEP3_IMAGE_SIZE, "width": STEP3_IMAGE_SIZE}, patch_size=STEP3_CROP_SIZE,
        vision_patch_size=STEP3_VIT_PATCH)
    processor = Step3p7Processor(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=STEP3_CHAT_TEMPLATE)
    return config, processor, [ids("<|im_end|>"), ids("<|endoftext|>")], seed
