"""Router face of Qwen3.5-MoE: Qwen3.5's (the same processor, placeholders, video timestamps and
interleaved M-RoPE plans; only the decoder's MLPs differ)."""

from __future__ import annotations

from mmserve.families.qwen3_5 import ROUTER_FACE  # noqa: F401
