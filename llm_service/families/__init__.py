"""LM faces of the model families, keyed by the family names of `mmserve.families`."""

from __future__ import annotations


def lm_face(family: str):
    from llm_service.families.qwen2_vl import QwenVLLMFace

    if family in ("qwen2_vl", "qwen2_5_vl"):
        return QwenVLLMFace(family)
    raise ValueError(f"no language-model face for model family {family!r}")
