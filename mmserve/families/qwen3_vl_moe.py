"""Router face of Qwen3-VL-MoE: Qwen3-VL's as it is (the same processor, placeholders, video
timestamps and interleaved M-RoPE plans; only the decoder's MLPs differ)."""

from __future__ import annotations

from mmserve.families.qwen3_vl import Qwen3VLRouterFace

ROUTER_FACE = Qwen3VLRouterFace
