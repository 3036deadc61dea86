"""Model-family registry: checkpoint `model_type` -> family name, and each family's router face.

A family is one adapter with three faces, one file each: the router face here (placeholders,
tokens per item, positions), the encoder face in `encoder_service.families`, the LM face in
`llm_service.families`. All three registries are keyed by the family name below.
"""

from __future__ import annotations

from pathlib import Path

from mmserve.checkpoint import read_config

MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
}


def family_of(model_dir: str | Path) -> str:
    model_type = read_config(model_dir).get("model_type")
    try:
        return MODEL_TYPES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {model_dir}; supported: {', '.join(MODEL_TYPES)}"
        ) from None


def router_face(model_dir: str | Path):
    """The router face of the checkpoint's family (`QwenVLRouterFace` for the Qwen2-VL family)."""
    from mmserve.families.qwen2_vl import QwenVLRouterFace

    family = family_of(model_dir)
    return QwenVLRouterFace.from_checkpoint(model_dir, family)
