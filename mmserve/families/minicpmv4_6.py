"""Router face of MiniCPM-V 4.6 (`model_type: minicpmv4_6`, transformers' in-tree descendant of
vLLM's `minicpmv`): an image becomes a source (global) view plus a grid of slices,

    <image_id>N</image_id> <image> <unk>*g </image> (<slice> <unk>*s </slice>)*cols ("\n" row)*rows

(`MiniCPMV4_6Processor.replace_image_token`, `_prepend_local_ids`; `<unk>` stands for the image
token). A video (pre-extracted frames, `do_sample_frames=False`) is its frames in order, each a
source view plus slices, with no newline between frames and one `<image_id>N</image_id>` per video.
N counts images and videos separately within a request (`expand_all`); `use_image_id` (on by
default) comes from the image processor. The slice grid, view sizes and token counts follow
from width and height alone (`MiniCPMV4_6ImageProcessor.get_sliced_grid` / `find_best_resize` /
`get_refine_size`, reproduced here). Positions: plain 1-D (the LM is not served yet).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.families.base import ItemExpansion, RouterFace, StreamGroup
from mmserve.inputs.media import MediaItem, MediaKind, read_image_size

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def _ensure_divide(length: float, divisor: int) -> int:
    return max(round(length / divisor) * divisor, divisor)


def best_resize(height: float, width: float, scale: int, patch: int, merge: int, upscale: bool) -> tuple[int, int]:
    if height * width > scale * scale or upscale:
        aspect = width / height
        height = int(scale / math.sqrt(aspect))
        width = int(height * aspect)
    return _ensure_divide(height, patch * merge), _ensure_divide(width, patch * merge)


def sliced_grid(height: int, width: int, max_slices: int, scale: int) -> tuple[int, int] | None:
    log_ratio = math.log(width / height)
    multiple = min(math.ceil(width * height / (scale * scale)), max_slices)
    if multiple <= 1:
        return None
    grids = [(rows, n // rows) for n in (multiple - 1, multiple, multiple + 1) if 1 < n <= max_slices
             for rows in range(1, n + 1) if n % rows == 0]
    # the closest aspect ratio; of equal ones the first with the most rows
    return min(grids, key=lambda g: (abs(log_ratio - math.log(g[1] / g[0])), -g[0]), default=(1, 1))


@dataclass(frozen=True)
class ViewPlan:
    """One image / frame: its source view's patch grid, the slice grid (0 x 0: none) and the patch
    grid of every slice."""

    source: tuple[int, int]
    rows: int
    cols: int
    slice: tuple[int, int]

    def views(self) -> list[tuple[int, int]]:
        return [self.source] + [self.slice] * (self.rows * self.cols)


def plan_views(height: int, width: int, settings: dict) -> ViewPlan:
    patch, scale = settings["patch_size"], settings["scale_resolution"]
    merge = 2 if settings["downsample_mode"] == "4x" else 4
    grid = sliced_grid(height, width, settings["max_slice_nums"], scale) if settings["slice_mode"] else None
    source_h, source_w = best_resize(height, width, scale, patch, merge, upscale=grid is None)
    if grid is None:
        return ViewPlan((source_h // patch, source_w // patch), 0, 0, (0, 0))
    rows, cols = grid
    refine_h, refine_w = _ensure_divide(height, rows), _ensure_divide(width, cols)
    best_h, best_w = best_resize(refine_h / rows, refine_w / cols, scale, patch, merge, upscale=True)
    return ViewPlan((source_h // patch, source_w // patch), rows, cols, (best_h // patch, best_w // patch))


@dataclass(frozen=True)
class ItemViews:
    """The layout of one item: its frames' plans (one for an image)."""

    frames: tuple[ViewPlan, ...]
    divisor: int  # patches per output token

    def view_tokens(self) -> list[int]:
        return [h * w // self.divisor for plan in self.frames for h, w in plan.views()]


_SETTINGS = ("patch_size", "scale_resolution", "max_slice_nums", "slice_mode", "downsample_mode")
_DEFAULTS = dict(patch_size=14, scale_resolution=448, max_slice_nums=9, slice_mode=True, downsample_mode="16x")


@dataclass(frozen=True)
class MiniCPMVRouterFace(RouterFace):
    tokens: tuple  # (name, id) pairs of the structure tokens
    digits: tuple  # token ids of "0".."9"
    newline: tuple[int, ...]
    image: tuple  # image processor settings, as (name, value) pairs
    video: tuple
    use_image_id: bool
    image_token: str
    video_token: str

    @classmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> MiniCPMVRouterFace:
        from tokenizers import Tokenizer

        processor = json.loads((Path(model_dir) / "processor_config.json").read_text())
        tok_config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        extra = tok_config.get("extra_special_tokens")
        # transformers 5 writes named special tokens at the top level; older versions under extra_special_tokens
        named = {**tok_config, **(extra if isinstance(extra, dict) else {})}
        tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        names = ("image_token", "video_token", "image_start_token", "image_end_token", "slice_start_token",
                 "slice_end_token", "image_id_start_token", "image_id_end_token")
        if missing := [n for n in names if n not in named or tokenizer.token_to_id(named[n]) is None]:
            raise ValueError(f"the tokenizer of {model_dir} lacks MiniCPM-V's tokens {missing}")
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731

        def settings(section: str) -> tuple:
            values = {**_DEFAULTS, **processor.get(section, {})}
            return tuple((k, values[k]) for k in _SETTINGS)

        image = processor.get("image_processor", {})
        return cls(tokens=tuple((n, tokenizer.token_to_id(named[n])) for n in names),
                   digits=tuple(encode(str(d)) for d in range(10)), newline=encode("\n"),
                   image=settings("image_processor"), video=settings("video_processor"),
                   use_image_id=bool(image.get("use_image_id", True)), image_token=named["image_token"],
                   video_token=named["video_token"])

    def _id(self, name: str) -> int:
        return dict(self.tokens)[name]

    def placeholder(self, kind: MediaKind) -> str | None:
        return self.image_token if kind is MediaKind.IMAGE else self.video_token

    def expand(self, item: MediaItem, max_pixels: int, ordinal: int = 0) -> ItemExpansion:
        image = item.kind is MediaKind.IMAGE
        settings = dict(self.image if image else self.video)
        size = read_image_size(item.frames[0], max_pixels) if image else item.frame_size(max_pixels)
        frames = (plan_views(*size, settings),) * (1 if image else item.num_frames)
        layout = ItemViews(frames, 4 if settings["downsample_mode"] == "4x" else 16)
        pad = self._id("image_token" if image else "video_token")
        tokens, embed = [], []

        def plain(ids) -> None:
            tokens.extend(ids)
            embed.extend([False] * len(ids))

        def block(start: str, n: int, end: str) -> None:
            tokens.extend((self._id(start), *(pad,) * n, self._id(end)))
            embed.extend((False, *(True,) * n, False))

        if self.use_image_id:
            plain([self._id("image_id_start_token")])
            for d in str(ordinal):
                plain(self.digits[int(d)])
            plain([self._id("image_id_end_token")])
        counts = iter(layout.view_tokens())
        for plan in frames:
            block("image_start_token", next(counts), "image_end_token")
            for row in range(plan.rows):
                if row:
                    plain(self.newline)
                for _ in range(plan.cols):
                    block("slice_start_token", next(counts), "slice_end_token")
        return ItemExpansion(tuple(tokens), tuple(embed), cost=sum(embed), layout=layout)

    def stream_groups(self, item: MediaItem, layout: ItemViews, frames: int = 1) -> list[StreamGroup] | None:
        """Whole frames per group: each frame is its own views."""
        if item.kind is not MediaKind.VIDEO:
            return None
        n = max(1, frames)
        groups = [ItemViews(layout.frames[i:i + n], layout.divisor) for i in range(0, len(layout.frames), n)]
        return [StreamGroup(len(views.frames), views, sum(views.view_tokens())) for views in groups]

    def expand_all(self, items: Sequence[MediaItem], max_pixels: int) -> list[ItemExpansion]:
        """`<image_id>N</image_id>`: N counts the request's images and its videos separately."""
        kinds = [item.kind for item in items]
        return [self.expand(item, max_pixels, kinds[:i].count(item.kind)) for i, item in enumerate(items)]


ROUTER_FACE = MiniCPMVRouterFace
