"""Encoder face of Qwen2-VL / Qwen2.5-VL: the vision tower, its tensors, its packed forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.checkpoint import strip_prefix

# Legacy checkpoints (every released Qwen2-VL) name the tower `visual.*`; transformers >= 4.52
# in-memory layout is `model.visual.*`.
VISION_PREFIXES = ("visual.", "model.visual.")


class QwenVLEncoderFace:
    def __init__(self, family: str):
        self.family = family

    @staticmethod
    def rename(key: str) -> str | None:
        return strip_prefix(key, VISION_PREFIXES)

    def build_tower(self, config, dtype: torch.dtype) -> nn.Module:
        """The vision tower of `config` with uninitialised weights (the caller loads them)."""
        from transformers.initialization import no_init_weights

        if self.family == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as Tower,
            )
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
        with no_init_weights():
            return Tower._from_config(config.vision_config, dtype=dtype)

    @staticmethod
    def forward(tower: nn.Module, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One packed varlen forward over all items (`pixel_values` concatenated); one output per item."""
        grid_thw = torch.tensor(grids, dtype=torch.long, device=pixel_values.device)
        merged = tower(pixel_values, grid_thw=grid_thw).pooler_output
        merge = tower.spatial_merge_size
        sizes = (grid_thw.prod(-1) // (merge * merge)).tolist()
        return list(torch.split(merged, sizes))

    @staticmethod
    def temporal_slice(
        pixel_values: torch.Tensor, grid: tuple[int, int, int], start: int, end: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Temporal patches `[start, end)` of one item: rows are temporal-patch-major."""
        _, h, w = grid
        return pixel_values[start * h * w:end * h * w], (end - start, h, w)
