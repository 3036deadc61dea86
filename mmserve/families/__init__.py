"""Model-family registry: checkpoint `model_type` -> the module name of the family's faces.

A family is one adapter with three faces, one module each, under the same name:
`mmserve.families.<name>` (router face: `ROUTER_FACE`), `encoder_service.families.<name>`
(`ENCODER_FACE`) and `llm_service.families.<name>` (`LM_FACE`). Adding a family is its three
modules, one line here and its tiny-model builder (see docs/adding-a-family.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from mmserve.checkpoint import load_config, read_config

FAMILIES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "llava": "llava",
    "step3p7": "step3p7",
    "minicpmv4_6": "minicpmv4_6",
}


def family_of(model_dir: str | Path) -> str:
    """The checkpoint's `model_type` (a key of `FAMILIES`); ValueError when unsupported."""
    if (model_type := read_config(model_dir).get("model_type")) not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} in {model_dir}; supported: {', '.join(FAMILIES)}")
    return model_type


def face_class(package: str, model_type: str, attribute: str):
    """`<package>.<family module>.<attribute>` for `model_type` (how each service finds its face)."""
    return getattr(importlib.import_module(f"{package}.{FAMILIES[model_type]}"), attribute)


def router_face(model_dir: str | Path):
    face = face_class("mmserve.families", family_of(model_dir), "ROUTER_FACE")
    return face.from_checkpoint(str(model_dir), load_config(model_dir))
