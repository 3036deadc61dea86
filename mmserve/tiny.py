"""Deterministic tiny checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) for tests and the embedded default.

A tiny checkpoint is a normal Hugging Face directory: a real `transformers` config with small
dimensions, random weights from a fixed seed (safetensors), a byte-level BPE tokenizer trained
here with `tokenizers` (the family's special tokens), the chat template and processor configs of
the checkpoints it imitates. `AutoProcessor` / `AutoModelForImageTextToText` load it unchanged;
the same seed gives the same bytes.

LLaVA (`model_type: llava`) comes in two shapes:
- `llava` like llava-hf/llava-1.5-*-hf: CLIP tower, Llama LM, `vision_feature_layer: -2`,
  strategy `default` (CLS dropped), CLIPImageProcessor (resize shortest edge + center crop), a
  tokenizer that prepends `<s>` (the chat template does not), "USER: <image>\n... ASSISTANT:".
- `llava_siglip` like llava-hf/llava-interleave-qwen-*-hf: SigLIP tower (no CLS, no head),
  Qwen2 LM with tied embeddings, `vision_feature_layer: -1`, strategy `full`,
  SiglipImageProcessor (resize to a fixed square), im_start/im_end chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
LLAVA_FAMILIES = ("llava", "llava_siglip")
QWEN3_FAMILIES = ("qwen3_vl",)
STEP3_FAMILIES = ("step3p7",)
MINICPMV_FAMILIES = ("minicpmv4_6",)
FAMILIES = QWEN_FAMILIES + QWEN3_FAMILIES + LLAVA_FAMILIES + STEP3_FAMILIES + MINICPMV_FAMILIES

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The chat template shipped with Qwen2-VL-*-Instruct (identical for Qwen2.5-VL).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split pattern.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a an of to in is it that this what where who how why image video picture photo frame "
    "describe show tell me about color colour red green blue yellow black white cat dog bird car "
    "tree house sky sea mountain person people left right top bottom middle small large many one "
    "two three four five six seven eight nine ten hello world assistant user system helpful answer "
    "question please thank you see look there are is was were will would can could should model "
    "vision language token embedding encoder decoder serve request response stream batch cache"
).split()

# Pixel limits kept small so the tiny model sees few patches (factor 28 = patch 14 x merge 2).
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
VIDEO_MIN_PIXELS = 28 * 28 * 4
VIDEO_MAX_PIXELS = 28 * 28 * 16


def _corpus(seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        sep = rng.choice([" ", " ", " ", ", ", ". "])
        lines.append(sep.join(words).capitalize() + rng.choice([".", "?", "!", "", "\n"]))
    lines.append("0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ café naïve 日本語 😀")
    return lines


def _build_tokenizer(
    seed: int,
    vocab_size: int,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    bos_token: str | None = None,
):
    """Byte-level BPE trained on a fixed corpus; with `bos_token`, it is prepended to every encoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_special_tokens(list(special_tokens))
    bos = {} if bos_token is None else {"bos_token": bos_token, "add_bos_token": True}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=None,
        **bos,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


def _configs(family: str, tokenizer):
    from transformers import Qwen2VLConfig, Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tokenizer)
    text = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        vision = dict(
            depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, in_channels=3,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    vision = dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[1, 3], tokens_per_second=2, initializer_range=0.2,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


# llava-hf/llava-1.5-*-hf: each message's images first, then its text parts, each followed by a space.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# llava-hf/llava-interleave-qwen-*-hf without its `<video>` clause (LlavaProcessor takes images only):
# im_start turns, each message's images first, no default system prompt.
LLAVA_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", LLAVA_IMAGE_TOKEN, "<pad>")
LLAVA_QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", LLAVA_IMAGE_TOKEN)
LLAVA_PATCH_SIZE = 14
LLAVA_CLIP_IMAGE_SIZE = 84  # 6 x 6 patches + CLS; strategy `default` drops CLS: 36 tokens
LLAVA_SIGLIP_IMAGE_SIZE = 70  # 5 x 5 patches, no CLS, strategy `full`: 25 tokens


def _llava_text_config(tokenizer, bos: str | None, eos: str, pad: str, **extra) -> dict:
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids(bos) if bos else None,
        eos_token_id=ids(eos),
        pad_token_id=ids(pad),
        **extra,
    )


def _llava(family: str, seed: int):
    """(model, processor, eos ids) of a tiny LLaVA of either shape."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
        Qwen2Config,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    grid = (LLAVA_CLIP_IMAGE_SIZE if family == "llava" else LLAVA_SIGLIP_IMAGE_SIZE) // LLAVA_PATCH_SIZE
    tower = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, patch_size=LLAVA_PATCH_SIZE)
    if family == "llava":
        tokenizer = _build_tokenizer(
            seed, 1024, LLAVA_SPECIAL_TOKENS, eos_token="</s>", pad_token="<pad>", bos_token="<s>"
        )
        vision = CLIPVisionConfig(
            num_hidden_layers=4, image_size=LLAVA_CLIP_IMAGE_SIZE, projection_dim=32, **tower
        )
        text = LlamaConfig(**_llava_text_config(tokenizer, "<s>", "</s>", "<pad>", tie_word_embeddings=False))
        select, layer, extra_tokens = "default", -2, 1
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": LLAVA_CLIP_IMAGE_SIZE},
            crop_size={"height": LLAVA_CLIP_IMAGE_SIZE, "width": LLAVA_CLIP_IMAGE_SIZE},
        )
        template, eos = LLAVA_CHAT_TEMPLATE, ["</s>"]
    else:
        tokenizer = _build_tokenizer(seed, 1024, LLAVA_QWEN_SPECIAL_TOKENS)
        vision = SiglipVisionConfig(
            num_hidden_layers=3, image_size=LLAVA_SIGLIP_IMAGE_SIZE, vision_use_head=False, **tower
        )
        text = Qwen2Config(
            **_llava_text_config(tokenizer, None, "<|im_end|>", "<|endoftext|>", tie_word_embeddings=True)
        )
        select, layer, extra_tokens = "full", -1, 0
        image_processor = SiglipImageProcessor(
            size={"height": LLAVA_SIGLIP_IMAGE_SIZE, "width": LLAVA_SIGLIP_IMAGE_SIZE}
        )
        template, eos = LLAVA_QWEN_CHAT_TEMPLATE, ["<|im_end|>", "<|endoftext|>"]
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_seq_length=grid * grid,
        vision_feature_layer=layer,
        vision_feature_select_strategy=select,
        projector_hidden_act="gelu",
        tie_word_embeddings=text.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy=select,
        chat_template=template,
        image_token=LLAVA_IMAGE_TOKEN,
        num_additional_image_tokens=extra_tokens,
    )
    return model, processor, [tokenizer.convert_tokens_to_ids(t) for t in eos]


def _qwen(family: str, seed: int):
    """(model, processor, eos ids) of a tiny Qwen2-VL / Qwen2.5-VL."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _build_tokenizer(seed, vocab_size=1024)
    config = _configs(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS, cap_pixels_per_frame=False
    )
    processor_cls = Qwen2VLProcessor if family == "qwen2_vl" else Qwen2_5_VLProcessor
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    return model, processor, [config.text_config.eos_token_id, config.text_config.bos_token_id]


def _qwen3(family: str, seed: int):
    from mmserve.tiny_qwen3 import build_qwen3_vl

    return build_qwen3_vl(seed)


def build_tiny_model(family: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny checkpoint of `family` to `out_dir` (atomically) and return its path."""
    from transformers import GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    if family in STEP3_FAMILIES:
        from mmserve.tiny_step3p7 import step3p7

        model, processor, eos_ids = step3p7(seed, _build_tokenizer)
    elif family in MINICPMV_FAMILIES:
        from mmserve.tiny_minicpmv import minicpmv4_6

        model, processor, eos_ids = minicpmv4_6(seed, _build_tokenizer)
    else:
        builder = _qwen if family in QWEN_FAMILIES else _qwen3 if family in QWEN3_FAMILIES else _llava
        model, processor, eos_ids = builder(family, seed)
    text_config = model.config.text_config
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids,
        pad_token_id=text_config.pad_token_id,
        **({"bos_token_id": text_config.bos_token_id} if family == "llava" else {}),
        do_sample=False,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        (tmp / "mmserve_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_model_dir(family: str = "qwen2_vl") -> Path:
    """Where `mmserve serve` keeps the embedded default checkpoint (built once)."""
    root = Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))
    return root / f"tiny-{family}-seed0"


def ensure_tiny_model(family: str = "qwen2_vl", out_dir: str | os.PathLike | None = None) -> Path:
    out = Path(out_dir) if out_dir is not None else default_model_dir(family)
    if (out / "mmserve_tiny.json").exists():
        return out
    return build_tiny_model(family, out)
