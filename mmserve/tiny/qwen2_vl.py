"""Tiny Qwen2-VL (`qwen2_vl`) and Qwen2.5-VL (`qwen2_5_vl`): the Qwen2-VL special tokens and chat
template, the Qwen2-VL image and video processors with small pixel bounds; Qwen2.5-VL's ViT has
window attention (full attention in blocks 1 and 3)."""

from __future__ import annotations

from mmserve.tiny.tokenizer import QWEN2_5_ADDED_TOKENS, build_tokenizer, chat_template, text_config, vision_token_ids

VARIANTS: dict[str, str] = {}

# The chat template shipped with Qwen2-VL-*-Instruct (identical for Qwen2.5-VL).
CHAT_TEMPLATE = chat_template("qwen2_vl")

# Pixel limits kept small so the tiny model sees few patches (factor 28 = patch 14 x merge 2).
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
VIDEO_MIN_PIXELS = 28 * 28 * 4
VIDEO_MAX_PIXELS = 28 * 28 * 16


def config(model_type: str, tokenizer):
    from transformers import Qwen2VLConfig, Qwen2_5_VLConfig

    text = text_config(tokenizer, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(vision_token_ids(tokenizer), tie_word_embeddings=False)
    if model_type == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, in_channels=3,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1, 3], tokens_per_second=2, initializer_range=0.2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def published_layout(nested: dict) -> dict:
    """A `config.json` as `transformers` 5 saves it (the language model under `text_config`) in the
    flat layout of the released Qwen2-VL / Qwen2.5-VL checkpoints: the text fields at the top level
    (`torch_dtype`, `rope_theta`, `rope_scaling: {"type": "mrope", "mrope_section": ...}`, no
    `layer_types`), `vision_config` without `model_type` or rope settings. Loads to the same config."""
    out = {k: v for k, v in nested.items() if k != "text_config"}
    text = {k: v for k, v in nested["text_config"].items() if k not in ("model_type", "layer_types", "dtype")}
    rope = text.pop("rope_parameters")
    if rope.get("rope_type", "default") != "default" or "mrope_section" not in rope:
        raise ValueError(f"not an M-RoPE text config: rope_parameters {rope}")
    text |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    out["vision_config"] = {k: v for k, v in nested["vision_config"].items()
                            if k not in ("model_type", "rope_parameters", "dtype")}
    return dict(sorted((text | out).items()))  # top-level values win (tie_word_embeddings)


def build(name: str, seed: int):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    # Qwen2.5-VL's tokenizer adds the tool-call and fill-in-the-middle tokens; Qwen2-VL's has none
    tokenizer = build_tokenizer(seed, vocab_size=1024, added_tokens=QWEN2_5_ADDED_TOKENS if name == "qwen2_5_vl" else ())
    model_config = config(name, tokenizer)
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video_processor = Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS,
                                            cap_pixels_per_frame=False)
    processor = (Qwen2VLProcessor if name == "qwen2_vl" else Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=CHAT_TEMPLATE)
    text = model_config.text_config
    return model_config, processor, [text.eos_token_id, text.bos_token_id], seed
