"""Router face of Qwen2-VL and Qwen2.5-VL: placeholder tokens, item grids, M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mmserve.checkpoint import read_config, read_preprocess_config
from mmserve.errors import InvalidRequest
from mmserve.media import (
    MediaItem,
    MediaKind,
    PlaceholderRange,
    VisionPreprocessConfig,
    image_grid,
    read_image_size,
    tokens_for_grid,
    video_grid,
)
from mmserve.mrope import mrope_positions, video_t_factor
from mmserve.positions import ExplicitPositions, LinearPositions, PositionPlan

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"


@dataclass(frozen=True)
class ItemLayout:
    """What the router knows of one media item before it is encoded."""

    grid: tuple[int, int, int]
    num_tokens: int
    t_factor: float | torch.Tensor


@dataclass(frozen=True)
class QwenVLRouterFace:
    family: str
    preprocess: VisionPreprocessConfig
    tokens_per_second: float | None  # Qwen2.5-VL only: temporal position scaling of videos
    image_token: str = IMAGE_TOKEN
    video_token: str = VIDEO_TOKEN

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, family: str) -> QwenVLRouterFace:
        config = read_config(model_dir)
        tps = None
        if family == "qwen2_5_vl":
            tps = float(config.get("vision_config", {}).get("tokens_per_second", 2))
        return cls(family=family, preprocess=read_preprocess_config(model_dir), tokens_per_second=tps)

    def layout(self, item: MediaItem, max_pixels: int) -> ItemLayout:
        """Grid and token count of `item` from its header(s); every frame must share one size."""
        sizes = {read_image_size(frame, max_pixels) for frame in item.frames}
        if len(sizes) != 1:
            raise InvalidRequest(f"all frames of a video must have the same size, got {sorted(sizes)}")
        height, width = sizes.pop()
        if item.kind is MediaKind.IMAGE:
            grid = image_grid(height, width, self.preprocess)
            t_factor: float | torch.Tensor = 1
        else:
            grid = video_grid(len(item.frames), height, width, self.preprocess)
            t_factor = 1
            if self.tokens_per_second is not None:
                second_per_grid_t = self.preprocess.temporal_patch_size / item.fps
                t_factor = video_t_factor(second_per_grid_t, self.tokens_per_second)
        return ItemLayout(grid, tokens_for_grid(grid, self.preprocess.merge_size), t_factor)

    def position_plan(
        self, num_tokens: int, ranges: list[PlaceholderRange], layouts: list[ItemLayout]
    ) -> PositionPlan:
        """M-RoPE positions (3 rows) of the prompt; text-only prompts count up on every row."""
        if not ranges:
            return LinearPositions(rows=3)
        positions, delta = mrope_positions(
            num_tokens,
            ranges,
            [lay.grid for lay in layouts],
            self.preprocess.merge_size,
            [lay.t_factor for lay in layouts],
        )
        return ExplicitPositions(positions, delta)
