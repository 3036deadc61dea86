"""Encoder face of Qwen2-VL / Qwen2.5-VL: the vision tower, its processors, its packed forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from encoder_service.batching import temporal_groups
from encoder_service.families.base import EncoderFace, PreparedItem, image_uint8, run_processor, video_uint8
from encoder_service.vit_attention import use_packed_attention
from mmserve.checkpoint import strip_prefix
from mmserve.families import qwen2_vl as router
from mmserve.inputs.media import MediaItem, MediaKind

# Legacy checkpoints (every released Qwen2-VL) name the tower `visual.*`; transformers >= 4.52
# in-memory layout is `model.visual.*`.
VISION_PREFIXES = ("visual.", "model.visual.")


class QwenVLEncoderFace(EncoderFace):
    """Images and videos as flat patches, one packed varlen forward (`cu_seqlens`, no padding).

    An item waits for the device as its decoded uint8 frames, `(3, H, W)` for an image and
    `(T, 3, H, W)` for a video, with its patch grid as `layout`; `forward` runs the processors on
    the tower's device. A video is resized to its grid's size (then processed with
    `do_resize=False`), as its processor resizes the whole video: a streamed group or a split piece
    of frames is sized as the whole video, not as those frames alone would be (Qwen3-VL's size
    depends on the number of frames).
    """

    video_grid = staticmethod(router.video_grid)  # the video processor's sizing (Qwen3-VL's differs)

    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        super().__init__(model_dir, config, dtype)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.sizes = router.read_preprocess_config(model_dir)  # the processors' sizing rules
        self.graphs = None  # encoder_service.vit_graphs.TowerGraphs, once captured
        self.qwen2 = config.model_type in ("qwen2_vl", "qwen2_5_vl")  # packed attention, adapters, graphs
        if self.qwen2:
            self.lora_stages = ("blocks.", "merger.")

    def rename(self, key: str) -> str | None:
        return strip_prefix(key, VISION_PREFIXES)

    def tower_class(self) -> type[nn.Module]:
        if self.config.model_type == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

            return Qwen2VisionTransformerPretrainedModel
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel

    def build(self) -> nn.Module:
        from transformers.initialization import no_init_weights

        with no_init_weights():
            tower = self.tower_class()._from_config(self.config.vision_config, dtype=self.dtype)
        return use_packed_attention(tower) if self.qwen2 else tower  # one attention call per layer over the batch

    def _prepared(self, frames: torch.Tensor, grid: tuple[int, int, int]) -> PreparedItem:
        t, h, w = grid
        return PreparedItem((frames,), grid, t * h * w // (self.merge * self.merge), t * h * w)

    def preprocess(self, item: MediaItem, layout) -> PreparedItem:
        """Decode (EXIF orientation applied) to uint8. The grid is the router's (`layout`: a
        streamed group's carries the whole video's frame size) or, without one, the processors'
        sizing of the decoded frames; an image's is checked against its decoded size."""
        if item.kind is MediaKind.IMAGE:
            frames = image_uint8(item.frames[0])
            grid = router.image_grid(frames.shape[1], frames.shape[2], self.sizes)
            if layout is not None and grid != layout.grid:  # the router sized it from the header
                raise RuntimeError(f"decoded image's grid {grid} differs from the router's {layout.grid}")
            return self._prepared(frames, grid)
        frames = video_uint8(item)
        count, _, height, width = frames.shape
        if layout is None:
            return self._prepared(frames, self.video_grid(count, height, width, self.sizes))
        if layout.grid[0] != -(-count // self.sizes.temporal_patch_size):
            raise RuntimeError(f"{count} frames for the router's grid {layout.grid}")
        return self._prepared(frames, layout.grid)

    def pixel_values(self, batch: Sequence[PreparedItem], device: torch.device) -> torch.Tensor:
        """The batch's patches as the processors make them (float32), packed in order, on `device`."""
        return torch.cat([self._patches(p, device) for p in batch])

    def _patches(self, prepared: PreparedItem, device: torch.device) -> torch.Tensor:
        frames, grid = prepared.tensors[0].to(device), prepared.layout
        if frames.ndim == 3:
            out = run_processor(self.image_processor, device, images=[frames])
            patches, made = out["pixel_values"], out["image_grid_thw"]
        else:
            patch = self.video_processor.patch_size
            frames = resized_frames(self.video_processor, frames, grid[1] * patch, grid[2] * patch)
            out = run_processor(self.video_processor, device, videos=[frames], do_resize=False,
                                do_sample_frames=False)
            patches, made = out["pixel_values_videos"], out["video_grid_thw"]
        if tuple(made[0].tolist()) != grid:
            raise RuntimeError(f"processor grid {tuple(made[0].tolist())} differs from the planned {grid}")
        return patches

    def lora_rows(self, batch: Sequence[PreparedItem]) -> dict[str, list[int]]:
        """The blocks see an item's patches, the merger's MLP its merged tokens, each in a row and
        items in batch order: Qwen2.5-VL's window order permutes rows within an item only."""
        return {"blocks.": [p.num_patches for p in batch], "merger.": [p.num_tokens for p in batch]}

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        device = next(module.parameters()).device
        pixels = self.pixel_values(batch, device).to(self.dtype)
        eager = self.graphs is None or any(p.lora is not None for p in batch)  # graphs hold no adapter
        merged = None if eager else self.graphs.run(pixels, [p.layout for p in batch])
        if merged is None:  # eager: no graphs, an adapter, or no graph holds this batch
            grid_thw = torch.tensor([p.layout for p in batch], dtype=torch.long, device=device)
            merged = module(pixels, grid_thw=grid_thw).pooler_output
        return [(out,) for out in torch.split(merged, [p.num_tokens for p in batch])]

    def capture_graphs(self, tower: nn.Module, max_cost: int, unit: str, capture: bool = True,
                       max_patches: int | None = None) -> str:
        """Qwen2-VL and Qwen2.5-VL towers (`encoder_service.vit_graphs`); checked against the eager
        tower on a batch of two items before use."""
        from encoder_service.vit_graphs import TowerGraphs, budget_ladder

        if not self.qwen2:
            return f"no CUDA graphs for {self.config.model_type} (its tower derives more from grid_thw)"
        unit_patches = self.merge * self.merge
        top = max_cost * (1 if unit == "patches" else unit_patches)
        budgets = budget_ladder(min(top, max_patches or top), unit_patches)
        embed = tower.patch_embed
        in_features = embed.in_channels * embed.temporal_patch_size * embed.patch_size ** 2
        grids = [(1, 4 * self.merge, 4 * self.merge), (2, 2 * self.merge, 3 * self.merge)]
        device = next(tower.parameters()).device
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), in_features, generator=generator)
        self.graphs, what = TowerGraphs.capture(tower, budgets, in_features, (pixels.to(device, self.dtype), grids),
                                                capture=capture)
        return what

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Groups of whole temporal patches (`temporal_patch_size` frames each, the last one padded
        by the processor as in the whole video): the ViT attends only within a temporal patch, so
        the groups' outputs concatenated equal the whole item's (rows are temporal-patch-major)."""
        t, h, w = prepared.layout
        if t < 2:
            return [prepared]
        frames, per_patch = prepared.tensors[0], self.sizes.temporal_patch_size
        groups = temporal_groups(t, prepared.cost(unit) // t, budget)
        return [self._prepared(frames[a * per_patch:b * per_patch], (b - a, h, w)) for a, b in groups]


def resized_frames(processor, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`frames` (T, 3, H, W) uint8 resized to (T, 3, height, width) by the video processor's own
    resize op, as its `_preprocess` resizes a whole video to the size it computed."""
    from transformers.image_utils import SizeDict

    resize = super(type(processor), processor).resize
    return resize(image=frames[None], size=SizeDict(height=height, width=width), resample=processor.resample)[0]


ENCODER_FACE = QwenVLEncoderFace
