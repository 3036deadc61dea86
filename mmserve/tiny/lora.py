"""Deterministic tiny LoRA adapters (PEFT format) of a tiny checkpoint (`mmserve build-tiny-adapter`):
its language model's projections and, optionally, its vision tower's and merger's linears, written
by `peft` itself (a test dependency: `mmserve[test]`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the Qwen2-VL / Qwen2.5-VL towers' block linears (Qwen2-VL's MLP is fc1/fc2, Qwen2.5-VL's
# gate/up/down_proj) and "merger" (the merger's two-layer MLP)
VISION_TARGETS = ("qkv", "proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj", "merger")


def build_tiny_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, rank: int = 4,
                       alpha: float = 8.0, targets: tuple[str, ...] = LM_TARGETS, use_rslora: bool = False,
                       std: float = 0.05, vision_targets: tuple[str, ...] = ()) -> Path:
    """Write a LoRA adapter of `model_dir` to `out_dir` and return its path: `targets` of every
    decoder layer, `vision_targets` of every vision block (those the family has) and the merger,
    A and B drawn from N(0, `std`) with torch seed `seed` (B not zero, so that the adapter changes
    the output). Module names are `peft`'s for the `transformers` class, as a published adapter's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    if (unknown := sorted(set(targets) - set(LM_TARGETS))) or not (targets or vision_targets):
        raise ValueError(f"targets must be among {', '.join(LM_TARGETS)}; got {', '.join(unknown) or 'none'}")
    if unknown := sorted(set(vision_targets) - set(VISION_TARGETS)):
        raise ValueError(f"vision targets must be among {', '.join(VISION_TARGETS)}; got {', '.join(unknown)}")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    # regular expressions: the language model's layers only (Qwen2.5-VL's ViT has gate/up/down_proj
    # too), the tower's blocks only (its patch embedding is a `proj` too)
    patterns = [rf".*language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(map(re.escape, targets))})"] \
        if targets else []
    if blocks := [t for t in vision_targets if t != "merger"]:
        patterns.append(rf".*visual\.blocks\.\d+\.(attn|mlp)\.({'|'.join(map(re.escape, blocks))})")
    if "merger" in vision_targets:
        patterns.append(r".*visual\.merger\.mlp\.(0|2)")
    pattern = patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=pattern,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    return out
