"""Tiny LLaVA (`llava`) in two shapes, the model type and its variant `llava_siglip`:
- `llava` like llava-hf/llava-1.5-*-hf: CLIP tower, Llama LM, layer -2, strategy `default` (CLS
  dropped), resize + center crop, a tokenizer that prepends `<s>`, "USER: <image>\n... ASSISTANT:".
- `llava_siglip` like llava-hf/llava-interleave-qwen-*-hf: SigLIP tower (no CLS, no head), Qwen2 LM
  with tied embeddings, layer -1, strategy `full`, resize to a fixed square, im_start/im_end turns.
"""

from __future__ import annotations

from mmserve.tiny.tokenizer import build_tokenizer, chat_template, text_config

# Tiny names besides the model type -> the model type their checkpoint has.
VARIANTS = {"llava_siglip": "llava"}

# llava-hf/llava-1.5-*-hf: each message's images first, then its text parts, each followed by a space.
LLAVA_CHAT_TEMPLATE = chat_template("llava")

# llava-hf/llava-interleave-qwen-*-hf without its `<video>` clause (LlavaProcessor takes images only):
# im_start turns, each message's images first, no default system prompt.
LLAVA_QWEN_CHAT_TEMPLATE = chat_template("llava_qwen")

LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", LLAVA_IMAGE_TOKEN, "<pad>")
LLAVA_QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", LLAVA_IMAGE_TOKEN)
LLAVA_PATCH_SIZE = 14
LLAVA_CLIP_IMAGE_SIZE = 84  # 6 x 6 patches + CLS; strategy `default` drops CLS: 36 tokens
LLAVA_SIGLIP_IMAGE_SIZE = 70  # 5 x 5 patches, no CLS, strategy `full`: 25 tokens


def build(name: str, seed: int):
    """The tiny LLaVA `name`: `llava` or `llava_siglip` (see `mmserve.tiny` for the contract)."""
    from transformers import (
        CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor, Qwen2Config,
        SiglipImageProcessor, SiglipVisionConfig,
    )

    grid = (LLAVA_CLIP_IMAGE_SIZE if name == "llava" else LLAVA_SIGLIP_IMAGE_SIZE) // LLAVA_PATCH_SIZE
    tower = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, patch_size=LLAVA_PATCH_SIZE)
    if name == "llava":
        tokenizer = build_tokenizer(seed, 1024, LLAVA_SPECIAL_TOKENS, eos_token="</s>", pad_token="<pad>",
                                    bos_token="<s>")
        vision = CLIPVisionConfig(num_hidden_layers=4, image_size=LLAVA_CLIP_IMAGE_SIZE, projection_dim=32, **tower)
        text = LlamaConfig(**text_config(tokenizer, "<s>", "</s>", "<pad>", tie_word_embeddings=False))
        select, layer, extra_tokens = "default", -2, 1
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": LLAVA_CLIP_IMAGE_SIZE},
            crop_size={"height": LLAVA_CLIP_IMAGE_SIZE, "width": LLAVA_CLIP_IMAGE_SIZE})
        template, eos = LLAVA_CHAT_TEMPLATE, ["</s>"]
    else:
        tokenizer = build_tokenizer(seed, 1024, LLAVA_QWEN_SPECIAL_TOKENS)
        vision = SiglipVisionConfig(num_hidden_layers=3, image_size=LLAVA_SIGLIP_IMAGE_SIZE, vision_use_head=False,
                                    **tower)
        text = Qwen2Config(**text_config(tokenizer, None, tie_word_embeddings=True))
        select, layer, extra_tokens = "full", -1, 0
        image_processor = SiglipImageProcessor(size={"height": LLAVA_SIGLIP_IMAGE_SIZE,
                                                     "width": LLAVA_SIGLIP_IMAGE_SIZE})
        template, eos = LLAVA_QWEN_CHAT_TEMPLATE, ["<|im_end|>", "<|endoftext|>"]
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
                         image_seq_length=grid * grid,
                         vision_feature_layer=layer, vision_feature_select_strategy=select, projector_hidden_act="gelu",
                         tie_word_embeddings=text.tie_word_embeddings)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=LLAVA_PATCH_SIZE,
                               vision_feature_select_strategy=select, chat_template=template,
                               image_token=LLAVA_IMAGE_TOKEN, num_additional_image_tokens=extra_tokens)
    return config, processor, [tokenizer.convert_tokens_to_ids(t) for t in eos], seed
