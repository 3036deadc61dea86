"""The benches' checkpoints, built without the hub (torch and transformers imported lazily).

`bench_checkpoint()`: a random Qwen2-VL (float32) whose ViT is big enough to matter, served by the
CPU serving benches and `mmserve plan --validate`. `qwen2_vl_2b(out)` / `qwen2_5_vl_3b(out)`: those
models' architectures with random weights, a whole servable checkpoint (the tiny models' tokenizer
and Qwen2-VL chat template), bf16, drawn on the CPU from a fixed seed: the same bytes on every host
with the same torch; its answers are gibberish, its sizes (weights, KV bytes per token, ViT FLOPs)
are the real model's. `random_lm(size, dtype)`: the LLM benches' checkpoint (bench/llm.py, bench/llm_tp.py).
"""

from __future__ import annotations

import fcntl
import json
import tempfile
from pathlib import Path
from typing import NamedTuple

# Qwen2-VL-2B-Instruct's config.json
QWEN2_VL_2B_TEXT = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768)
QWEN2_VL_2B_VISION = dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, in_channels=3,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
# the LLM benches' LMs: "small" for a few minutes on 2 CPU cores (big enough that compute shows), "2b"
LM_SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
            "2b": QWEN2_VL_2B_TEXT}
# Qwen2.5-VL-3B-Instruct's config.json (`Qwen2_5_VLConfig`'s field names)
QWEN2_5_VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                          num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000)
QWEN2_5_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                            in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                            window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
# both preprocessor_config.json
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
MARKER = "mmserve_random.json"


class _Architecture(NamedTuple):
    name: str
    config_class: str  # of transformers
    processor_class: str
    text: dict
    vision: dict


QWEN2_VL_2B = _Architecture("Qwen2-VL-2B-Instruct", "Qwen2VLConfig", "Qwen2VLProcessor", QWEN2_VL_2B_TEXT,
                            QWEN2_VL_2B_VISION)
QWEN2_5_VL_3B = _Architecture("Qwen2.5-VL-3B-Instruct", "Qwen2_5_VLConfig", "Qwen2_5_VLProcessor", QWEN2_5_VL_3B_TEXT,
                              QWEN2_5_VL_3B_VISION)
BENCH_CHECKPOINT = Path(tempfile.gettempdir()) / "mmserve-bench-serve-qwen2_vl-v1"


def bench_checkpoint(out: Path = BENCH_CHECKPOINT) -> str:
    """A random Qwen2-VL (float32) whose ViT is big enough to matter: embed 256, depth 6, ≤336² images."""
    from transformers import Qwen2VLImageProcessor

    from mmserve import tiny
    from mmserve.tiny import qwen2_vl

    if (out / "mmserve_tiny.json").exists():
        return str(out)
    config, processor, _, _ = qwen2_vl.build("qwen2_vl", 0)  # the tiny Qwen2-VL, its ViT and images larger
    for key, value in dict(depth=6, embed_dim=256, num_heads=4, mlp_ratio=4).items():
        setattr(config.vision_config, key, value)
    processor.image_processor = Qwen2VLImageProcessor(min_pixels=tiny.MIN_PIXELS, max_pixels=336 * 336)
    model = tiny.random_model(config, 0, "float32", [config.text_config.eos_token_id], config.text_config.pad_token_id)
    tiny.save_checkpoint(model, processor, out, "mmserve_tiny.json", {"family": "qwen2_vl", "seed": 0, "bench": True})
    return str(out)


def random_lm(size: str, dtype, device: str = "cpu", vocab_size: int | None = None) -> Path:
    """A Qwen2-VL checkpoint in a new temporary directory: random weights (seed 0, drawn on `device`,
    in `dtype`), a one-layer vision tower and the LM of `LM_SIZES[size]` (`vocab_size`: another width)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(LM_SIZES[size], **({"vocab_size": vocab_size} if vocab_size else {}),
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [16, 24, 24] if size == "2b" else [4, 6, 6]},
                tie_word_embeddings=size == "2b", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=3, video_token_id=4,
                           vision_start_token_id=5, vision_end_token_id=6)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration(config).to(dtype)
    out = Path(tempfile.mkdtemp(prefix=f"mmserve-bench-{size}-"))
    model.save_pretrained(out)
    return out


def qwen2_vl_2b(out: str | Path, seed: int = 0, text_layers: int | None = None, vision_depth: int | None = None,
                flat: bool = False, quantization: str | None = None) -> str:
    """Qwen2-VL-2B-Instruct's architecture (bf16). Writes the checkpoint to `out` (once: an existing
    one with the same settings is kept) and returns its path. `text_layers` / `vision_depth` shrink
    it (for CPU tests of this builder); `flat`: config.json in the released checkpoint's flat layout;
    `quantization` (`mmserve.tiny.quantized.QUANTIZATIONS`): the language model's projections in
    that published format, at the released block / group size (128), quantized tensor by tensor."""
    return _full_size(QWEN2_VL_2B, out, seed, text_layers, vision_depth, flat, quantization)


def qwen2_5_vl_3b(out: str | Path, seed: int = 0, text_layers: int | None = None, vision_depth: int | None = None,
                  flat: bool = False) -> str:
    """Qwen2.5-VL-3B-Instruct's architecture (bf16; window-attention ViT, 128,000-token context, tied
    embeddings); the same knobs as `qwen2_vl_2b`."""
    return _full_size(QWEN2_5_VL_3B, out, seed, text_layers, vision_depth, flat)


def _full_size(arch: _Architecture, out: str | Path, seed: int, text_layers: int | None, vision_depth: int | None,
               flat: bool, quantization: str | None = None) -> str:
    out = Path(out)
    settings = {"architecture": arch.name, "seed": seed, "text_layers": text_layers, "vision_depth": vision_depth}
    settings |= ({"layout": "flat"} if flat else {}) | ({"quantization": quantization} if quantization else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (scripts/gpu-check builds it in the background while the tests that need it start):
    # a second caller waits, then finds it built
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((out / MARKER).exists() and json.loads((out / MARKER).read_text()) == settings):
            _build(arch, out, seed, settings, text_layers, vision_depth, flat, quantization)
    return str(out)


def _build(arch: _Architecture, out: Path, seed: int, settings: dict, text_layers: int | None,
           vision_depth: int | None, flat: bool, quantization: str | None) -> None:
    from functools import partial

    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from mmserve.tiny import CHAT_TEMPLATE, quantized, random_model, save_checkpoint
    from mmserve.tiny.qwen2_vl import published_layout
    from mmserve.tiny.tokenizer import build_tokenizer, text_config, vision_token_ids

    tokenizer = build_tokenizer(seed, vocab_size=1024)
    text = text_config(tokenizer, **arch.text, initializer_range=0.02, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    vision = dict(arch.vision, initializer_range=0.02)
    if text_layers is not None:
        text["num_hidden_layers"] = text_layers
    if vision_depth is not None:
        vision["depth"] = vision_depth
    config = getattr(transformers, arch.config_class)(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                                      **vision_token_ids(tokenizer))
    model = random_model(config, seed, "bfloat16", [text["eos_token_id"], text["bos_token_id"]], text["pad_token_id"])
    processor = getattr(transformers, arch.processor_class)(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=False), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE)
    rewrite = partial(quantized.quantize_checkpoint, quantization=quantization, block=quantized.RELEASED_BLOCK,
                      group=quantized.RELEASED_GROUP) if quantization else None
    save_checkpoint(model, processor, out, MARKER, settings, published_layout if flat else None, rewrite)
