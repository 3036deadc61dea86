"""Encoder faces of the model families, keyed by the family names of `mmserve.families`."""

from __future__ import annotations


def encoder_face(family: str):
    from encoder_service.families.qwen2_vl import QwenVLEncoderFace

    if family in ("qwen2_vl", "qwen2_5_vl"):
        return QwenVLEncoderFace(family)
    raise ValueError(f"no encoder face for model family {family!r}")
