"""Router face of Qwen2-VL and Qwen2.5-VL: item grids from headers, placeholders, M-RoPE plans.

The sizing rules (`smart_resize`, grids) are the processors' own arithmetic, read from the
checkpoint's processor configs, so the router knows every item's token count before anything is
decoded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmserve.checkpoint import processor_settings
from mmserve.errors import InvalidRequest
from mmserve.families.base import ItemExpansion, RouterFace, StreamGroup
from mmserve.inputs.media import MediaItem, MediaKind, PlaceholderRange
from mmserve.inputs.mrope import mrope_positions, video_t_factor
from mmserve.inputs.positions import ExplicitPositions, LinearPositions, PositionPlan

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """What the router needs of the checkpoint's image/video processor configs to size items."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_cap_pixels_per_frame: bool = False
    video_max_tokens: int = 128000

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, num_frames: int = 1,
                 temporal: int = 1, what: str = "image") -> tuple[int, int]:
    """Qwen2-VL's resize rule (same arithmetic as `transformers`' `smart_resize`); with `num_frames`
    and `temporal` the Qwen3-VL video processor's, which bounds frames x height x width."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequest(f"{what} aspect ratio {max(height, width) / min(height, width):.1f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image of `height` x `width` after the processor's resize."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def video_grid(num_frames: int, height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a video: frames padded to a multiple of the temporal patch size."""
    max_pixels = cfg.video_max_pixels
    if cfg.video_cap_pixels_per_frame:
        total = int(cfg.video_max_tokens * cfg.factor * cfg.factor * 0.9) * cfg.temporal_patch_size
        max_pixels = max(min(max_pixels, total // num_frames), int(cfg.video_min_pixels * 1.05))
    h, w = smart_resize(height, width, cfg.factor, cfg.video_min_pixels, max_pixels)
    return -(-num_frames // cfg.temporal_patch_size), h // cfg.patch_size, w // cfg.patch_size


def tokens_for_grid(grid: tuple[int, int, int], merge_size: int) -> int:
    return math.prod(grid) // (merge_size * merge_size)


def _pixel_bounds(cfg: dict, default_min: int, default_max: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    return (int(cfg.get("min_pixels", size.get("shortest_edge", default_min))),
            int(cfg.get("max_pixels", size.get("longest_edge", default_max))))


def read_preprocess_config(model_dir: str | Path) -> VisionPreprocessConfig:
    """The sizing rules of the checkpoint's image and video processors, without loading them."""
    model_dir = Path(model_dir)
    image = processor_settings(model_dir, "image_processor", "preprocessor_config.json")
    video = processor_settings(model_dir, "video_processor", "video_preprocessor_config.json") or image
    d = VisionPreprocessConfig()
    min_px, max_px = _pixel_bounds(image, d.min_pixels, d.max_pixels)
    vmin, vmax = _pixel_bounds(video, d.video_min_pixels, d.video_max_pixels)
    sizes = {k: int(image.get(k, getattr(d, k))) for k in ("patch_size", "merge_size", "temporal_patch_size")}
    return VisionPreprocessConfig(**sizes, min_pixels=min_px, max_pixels=max_px, video_min_pixels=vmin,
                                  video_max_pixels=vmax,
                                  video_cap_pixels_per_frame=bool(video.get("cap_pixels_per_frame", False)),
                                  video_max_tokens=int(video.get("max_video_tokens", d.video_max_tokens)))

@dataclass(frozen=True)
class QwenLayout:
    """An item as the Qwen2-VL ViT sees it: patch grid `(t, h, w)` and temporal position step."""

    grid: tuple[int, int, int]
    t_factor: float | torch.Tensor = 1


@dataclass(frozen=True)
class QwenVLRouterFace(RouterFace):
    model_type: str
    preprocess: VisionPreprocessConfig
    image_token_id: int
    video_token_id: int
    tokens_per_second: float | None  # Qwen2.5-VL only: temporal position scaling of videos
    video_grid = staticmethod(video_grid)  # a video's patch grid (Qwen3-VL: its own video sizing)

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> QwenVLRouterFace:
        seconds = float(config.vision_config.tokens_per_second) if config.model_type == "qwen2_5_vl" else None
        return cls(model_type=config.model_type, preprocess=read_preprocess_config(model_dir),
                   image_token_id=int(config.image_token_id), video_token_id=int(config.video_token_id),
                   tokens_per_second=seconds)

    def placeholder(self, kind: MediaKind) -> str:
        return IMAGE_TOKEN if kind is MediaKind.IMAGE else VIDEO_TOKEN

    def layout(self, item: MediaItem, max_pixels: int) -> QwenLayout:
        """Grid of `item` from its header(s); every frame of a video must share one size."""
        height, width = item.frame_size(max_pixels)
        if item.kind is MediaKind.IMAGE:
            return QwenLayout(image_grid(height, width, self.preprocess))
        grid = self.video_grid(item.num_frames, height, width, self.preprocess)
        if self.tokens_per_second is None:
            return QwenLayout(grid)
        second_per_grid_t = self.preprocess.temporal_patch_size / item.sampled_fps
        return QwenLayout(grid, video_t_factor(second_per_grid_t, self.tokens_per_second))

    def expand(self, item: MediaItem, max_pixels: int) -> ItemExpansion:
        layout = self.layout(item, max_pixels)
        n = tokens_for_grid(layout.grid, self.preprocess.merge_size)
        token = self.image_token_id if item.kind is MediaKind.IMAGE else self.video_token_id
        return ItemExpansion((token,) * n, None, cost=n, layout=layout)

    def stream_groups(self, item: MediaItem, layout: QwenLayout, frames: int = 1) -> list[StreamGroup] | None:
        """Whole temporal patches per group: the ViT attends within a temporal patch only."""
        if item.kind is not MediaKind.VIDEO:
            return None
        t, h, w = layout.grid
        temporal, rows = self.preprocess.temporal_patch_size, h * w // self.preprocess.merge_size ** 2
        patches = max(1, frames // temporal)  # temporal patches per group
        return [StreamGroup(min(n * temporal, item.num_frames - first * temporal), QwenLayout((n, h, w)), n * rows)
                for first in range(0, t, patches) for n in [min(patches, t - first)]]

    def position_plan(self, token_ids: Sequence[int], ranges: Sequence[PlaceholderRange],
                      expansions: Sequence[ItemExpansion]) -> PositionPlan:
        """M-RoPE positions (3 rows) of the prompt; text-only prompts count up on every row."""
        if not ranges:
            return LinearPositions(rows=3)
        layouts: list[QwenLayout] = [e.layout for e in expansions]
        return ExplicitPositions(*mrope_positions(len(token_ids), ranges, [lay.grid for lay in layouts],
                                                  self.preprocess.merge_size, [lay.t_factor for lay in layouts]))


ROUTER_FACE = QwenVLRouterFace
