"""Deterministic tiny LoRA adapters (PEFT format) of a tiny checkpoint's language model
(`mmserve build-tiny-adapter`), written by `peft` itself (a test dependency: `mmserve[test]`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, rank: int = 4,
                       alpha: float = 8.0, targets: tuple[str, ...] = LM_TARGETS, use_rslora: bool = False,
                       std: float = 0.05) -> Path:
    """Write a LoRA adapter of `model_dir`'s language model to `out_dir` and return its path:
    `targets` of every decoder layer (never the vision tower's), A and B drawn from N(0, `std`)
    with torch seed `seed` (B not zero, so that the adapter changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    unknown = sorted(set(targets) - set(LM_TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must be among {', '.join(LM_TARGETS)}; got {', '.join(unknown) or 'none'}")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    # a regular expression: the language model's layers only (Qwen2.5-VL's ViT has gate/up/down_proj too)
    pattern = rf".*language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(map(re.escape, targets))})"
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=pattern, use_rslora=use_rslora,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    return out
