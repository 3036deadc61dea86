"""Router face of Qwen3-VL: image and video expansions from headers, interleaved M-RoPE plans.

Images are sized exactly as Qwen2-VL's (16-px patches). Videos follow the Qwen3-VL video processor:
its frames x height x width bounds, and a timestamp (`<1.2 seconds>`, from each frame's time alone:
`MediaItem.frame_seconds`) and vision start/end tokens around each temporal group, which
`get_rope_index` places as an image of one frame (docs/adding-a-family.md#pitfalls-met-adding-qwen3-vl).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.errors import InvalidRequest
from mmserve.families.base import ItemExpansion
from mmserve.families.qwen2_vl import QwenVLRouterFace, VisionPreprocessConfig, read_preprocess_config, smart_resize
from mmserve.inputs.media import MediaItem, MediaKind, PlaceholderRange
from mmserve.inputs.mrope import mrope_positions
from mmserve.inputs.positions import ExplicitPositions, LinearPositions, PositionPlan

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def video_resize(num_frames: int, height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int]:
    """The Qwen3-VL video processor's resize (its `smart_resize` and per-frame cap)."""
    factor, temporal = cfg.factor, cfg.temporal_patch_size
    if num_frames < temporal:
        raise InvalidRequest(f"a video needs at least {temporal} frames, got {num_frames}")
    min_pixels, max_pixels = cfg.video_min_pixels, cfg.video_max_pixels
    if cfg.video_cap_pixels_per_frame:
        per_frame = max(min(cfg.video_max_tokens * factor * factor, max_pixels // num_frames), int(min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, min_pixels, max_pixels, num_frames, temporal, "video")


def video_grid(num_frames: int, height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a Qwen3-VL video: frames padded to whole temporal patches."""
    h, w = video_resize(num_frames, height, width, cfg)
    return -(-num_frames // cfg.temporal_patch_size), h // cfg.patch_size, w // cfg.patch_size


def group_timestamps(frame_seconds: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group (the processor's `_calculate_timestamps`: the last frame
    repeated to fill the last group, a group's time the mean of its first and last frame's)."""
    seconds = list(frame_seconds)
    seconds += [seconds[-1]] * (-len(seconds) % temporal_patch_size)
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


@dataclass(frozen=True)
class Qwen3VLRouterFace(QwenVLRouterFace):
    """Qwen2-VL's face with Qwen3-VL's video sizing, timestamps and per-group positions."""

    # str -> token ids of a timestamp (the checkpoint's tokenizer; one per tokenizer: no part of equality)
    timestamp_ids: object = field(default=None, compare=False)
    vision_start_id: int = -1
    vision_end_id: int = -1
    video_grid = staticmethod(video_grid)

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> Qwen3VLRouterFace:
        from transformers import AutoTokenizer

        return cls(model_type=config.model_type, preprocess=read_preprocess_config(model_dir),
                   image_token_id=int(config.image_token_id), video_token_id=int(config.video_token_id),
                   tokens_per_second=None, timestamp_ids=_TimestampTokens(AutoTokenizer.from_pretrained(model_dir)),
                   vision_start_id=int(config.vision_start_token_id), vision_end_id=int(config.vision_end_token_id))

    def expand(self, item: MediaItem, max_pixels: int) -> ItemExpansion:
        if item.kind is MediaKind.IMAGE:
            return super().expand(item, max_pixels)
        layout = self.layout(item, max_pixels)
        t, h, w = layout.grid
        per_group = h * w // (self.preprocess.merge_size ** 2)
        tokens, is_embed = [], []
        for seconds in group_timestamps(item.frame_seconds, self.preprocess.temporal_patch_size):
            stamp = self.timestamp_ids(f"<{seconds:.1f} seconds>")
            tokens += [*stamp, self.vision_start_id, *[self.video_token_id] * per_group, self.vision_end_id]
            is_embed += [False] * (len(stamp) + 1) + [True] * per_group + [False]
        return ItemExpansion(tuple(tokens), tuple(is_embed), cost=t * per_group, layout=layout)

    def position_plan(self, token_ids: Sequence[int], ranges: Sequence[PlaceholderRange],
                      expansions: Sequence[ItemExpansion]) -> PositionPlan:
        """Every image and every temporal group of a video is one `(1, h, w)` grid at its run of
        embedding slots; the tokens between (timestamps, vision start/end) are text."""
        if not ranges:
            return LinearPositions(rows=3)
        runs: list[PlaceholderRange] = []
        grids: list[tuple[int, int, int]] = []
        for rng, expansion in zip(ranges, expansions):
            _, h, w = expansion.layout.grid
            for start, length in _embed_runs(rng):
                runs.append(PlaceholderRange(rng.offset + start, length))
                grids.append((1, h, w))
        return ExplicitPositions(*mrope_positions(len(token_ids), runs, grids, self.preprocess.merge_size))


def _embed_runs(rng: PlaceholderRange) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive embedding slots in `rng`, from its start."""
    runs = [[slot for _, slot in run] for _, run in itertools.groupby(enumerate(rng.embed_slots()),
                                                                      lambda pair: pair[1] - pair[0])]
    return [(run[0], len(run)) for run in runs]


class _TimestampTokens:
    """Token ids of a timestamp string, as the processor's tokenizer writes it between special
    tokens (memoised: a video repeats few distinct times)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        if text not in self._cache:
            self._cache[text] = tuple(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._cache[text]


ROUTER_FACE = Qwen3VLRouterFace
