"""Deterministic tiny checkpoints of every registered family, for tests and the embedded default.

A tiny checkpoint is a normal Hugging Face directory: a real `transformers` config with small
dimensions, random weights from a fixed seed (safetensors), a byte-level BPE tokenizer trained
here (`tokenizer.py`, with the family's special tokens), the chat template and processor configs of
the checkpoints it imitates. `AutoProcessor` / `AutoModelForImageTextToText` load it unchanged;
the same seed gives the same bytes.

Builders: one module per module name of `mmserve.families.FAMILIES`, found with
`face_class("mmserve.tiny", model_type, attribute)`; each module has two attributes:
- `build(name, seed) -> (config, processor, eos_ids, init_seed)`: the model config, the processor
  (its tokenizer trained at `seed`), the token ids generation stops at, and the torch seed the
  float32 weights are drawn from (`seed`, unless the family's tiny LM needs another);
- `VARIANTS`: its tiny names besides its model types -> the model type of their checkpoint
  (`{"llava_siglip": "llava"}`; `{}` for most). `name` is one of its model types or variants.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from mmserve import families
from mmserve.tiny import quantized

# Names other code imports from here (tests, bench/serve.py).
from mmserve.tiny.llava import LLAVA_CHAT_TEMPLATE, LLAVA_IMAGE_TOKEN, LLAVA_QWEN_CHAT_TEMPLATE  # noqa: F401
from mmserve.tiny.qwen2_vl import CHAT_TEMPLATE, MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS  # noqa: F401
from mmserve.tiny.qwen3_vl import QWEN3_CHAT_TEMPLATE, QWEN3_SPECIAL_TOKENS  # noqa: F401
from mmserve.tiny.tokenizer import SPECIAL_TOKENS  # noqa: F401


def _model_types() -> dict[str, str]:
    """Tiny name -> model type: each registered model type, then its variants."""
    names = {}
    for model_type in families.FAMILIES:
        variants = families.face_class(__name__, model_type, "VARIANTS")
        names.update({model_type: model_type, **{v: t for v, t in variants.items() if t == model_type}})
    return names


_MODEL_TYPES = _model_types()
FAMILIES = tuple(_MODEL_TYPES)  # the tiny names (`mmserve build-tiny-model --family`)
LLAVA_FAMILIES = tuple(name for name, model_type in _MODEL_TYPES.items() if model_type == "llava")


def build_tiny_model(family: str, out_dir: str | os.PathLike, seed: int = 0, quantization: str | None = None) -> Path:
    """Write the tiny checkpoint `family` (a name in `FAMILIES`) to `out_dir` (atomically) and return
    its path; `quantization` (one of `quantized.QUANTIZATIONS`): its language model's weights in that format."""
    if family not in _MODEL_TYPES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if quantization not in (None, *quantized.QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; "
                         f"choose one of {', '.join(quantized.QUANTIZATIONS)}")
    out = Path(out_dir)
    build = families.face_class(__name__, _MODEL_TYPES[family], "build")
    config, processor, eos_ids, init_seed = build(family, seed)
    # A tokenizer that prepends a BOS (LLaVA's `<s>`) names it in the generation config too.
    prepends_bos = getattr(processor.tokenizer, "add_bos_token", False)
    bos = {"bos_token_id": config.text_config.bos_token_id} if prepends_bos else {}
    model = random_model(config, init_seed, "float32", eos_ids, config.text_config.pad_token_id, **bos)
    settings = {"family": family, "seed": seed} | ({"quantization": quantization} if quantization else {})
    rewrite = partial(quantized.quantize_checkpoint, quantization=quantization) if quantization else None
    save_checkpoint(model, processor, out, "mmserve_tiny.json", settings, rewrite=rewrite)
    return out


def random_model(config, seed: int, dtype: str, eos_ids: list[int], pad_id: int, **generation):
    """`config`'s model in `dtype` (a torch dtype's name), its weights drawn at torch seed `seed`;
    its generation config greedy, stopping at `eos_ids` (`generation`: more of its fields)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, **generation, do_sample=False)
    return model


def save_checkpoint(model, processor, out: Path, marker: str, settings: dict,
                    config_layout: Callable[[dict], dict] | None = None,
                    rewrite: Callable[[Path], None] | None = None) -> None:
    """`model` and `processor` as a Hugging Face directory at `out`, with `marker` (JSON `settings`)
    written last; atomically: built beside `out`, then renamed over it. `config_layout` rewrites
    the saved config.json (e.g. `qwen2_vl.published_layout`); `rewrite(dir)` then changes the
    saved directory (e.g. `quantized.quantize_checkpoint`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        if config_layout is not None:
            path = tmp / "config.json"
            path.write_text(json.dumps(config_layout(json.loads(path.read_text())), indent=2) + "\n")
        if rewrite is not None:
            rewrite(tmp)
        (tmp / marker).write_text(json.dumps(settings) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_model_dir(family: str = "qwen2_vl") -> Path:
    """Where `mmserve serve` keeps the embedded default checkpoint (built once)."""
    return Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve")) / f"tiny-{family}-seed0"


def ensure_tiny_model(family: str = "qwen2_vl", out_dir: str | os.PathLike | None = None) -> Path:
    out = Path(out_dir) if out_dir is not None else default_model_dir(family)
    return out if (out / "mmserve_tiny.json").exists() else build_tiny_model(family, out)
