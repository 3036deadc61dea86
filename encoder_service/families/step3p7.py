"""Encoder face of Step3 (`model_type: step3p7`): one ViT (+ two stride-2 downsamplers) run on each
local crop and on the global view independently, then a linear projector. An image's rows are its
crops' rows (row-major) followed by the global view's (`Step3p7Model.get_image_features`).

Every view is a fixed-size square and the tower attends within a view only, so a crop or the
global view is a sub-item for the token budget: `split` cuts an image into runs of views whose
outputs, concatenated in order, equal the whole image's. A batch stacks all its crops in one
forward and all its global views in another (two fixed shapes).

An image waits for the device decoded, as uint8 `(3, H, W)` (the crop count is the processor's
own `get_number_of_image_patches`); the processor cuts and normalises its views on the tower's
device. The views of an image come from resizing the whole image, so every piece of a split
image holds (and the pool's byte cap counts) the whole uint8 image, and its views are made anew
for each piece: only images over the token budget pay that, and uint8 is still smaller than the
float32 views of one crop run for any image the processor does not scale down (3 bytes a source
pixel against 12 a view pixel).

Checkpoints in the hub layout (what `save_pretrained` writes: `vision_model.transformer.resblocks.*`
with a fused `attn.in_proj_*`, `vit_large_projector.weight`) are converted on load as transformers'
`step3p5_vision` conversion mapping does (rename, unfuse q/k/v, RoPE permutation of q/k); the
in-memory layout (`model.vision_model.*`, `model.multi_modal_projector.*`) loads as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from encoder_service.families.base import EncoderFace, PreparedItem, image_uint8, run_processor
from mmserve.checkpoint import strip_prefix
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import MediaItem, MediaKind

_HUB_VISION_RENAMES = (
    (r"^conv1\.weight", "embeddings.patch_embedding.weight"),
    (r"^positional_embedding", "embeddings.position_embedding.weight"),
    (r"^transformer\.resblocks\.", "layers."),
    (r"^ln_pre\.", "pre_layernorm."),
    (r"^vit_downsampler1\.", "downsampler1."),
    (r"^vit_downsampler2\.", "downsampler2."),
    (r"\.ls_1\.gamma", ".lambda_1"),
    (r"\.ls_2\.gamma", ".lambda_2"),
    (r"\.mlp\.c_fc\.", ".mlp.fc1."),
    (r"\.mlp\.c_proj\.", ".mlp.fc2."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ln_1\.", ".layernorm_before."),
    (r"\.ln_2\.", ".layernorm_after."),
)


def rename(key: str) -> str | None:
    """Checkpoint key -> module key (`tower.*` in either layout, `projector.*`); None otherwise."""
    if (tower := strip_prefix(key, ("model.vision_model.", "vision_model."))) is not None:
        return "tower." + tower
    projector = strip_prefix(key, ("vit_large_projector.", "model.multi_modal_projector."))
    return "projector." + projector if projector in ("weight", "bias") else None


def _permute_for_rope(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' `PermuteForRope` (interleaved -> split halves) on a q or k projection."""
    dim0, rest = tensor.shape[0], tensor.shape[1:]
    return tensor.view(heads, dim0 // heads // 2, 2, *rest).transpose(1, 2).reshape(dim0, *rest)


class Step3VisionEncoder(nn.Module):
    """`tower` (`Step3p7VisionModel`) + `projector`; hub-layout tensors are converted as they load."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        from transformers.initialization import no_init_weights
        from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionModel

        vision = config.vision_config
        with no_init_weights():
            self.tower = Step3p7VisionModel._from_config(vision, dtype=dtype)
            self.projector = nn.Linear(vision.hidden_size * 4, config.text_config.hidden_size,
                                       bias=config.projector_bias, dtype=dtype)
        self.heads = vision.num_attention_heads

    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hub-layout `tower.*` keys -> `Step3p7VisionModel` keys, as they are read (others unchanged)."""
        out = {}
        for key, value in waiting.items():
            if not key.startswith("tower."):
                out[key] = value
                continue
            name = key[len("tower."):]
            for pattern, target in _HUB_VISION_RENAMES:  # an in-memory key matches none
                name = re.sub(pattern, target, name)
            if (match := re.fullmatch(r"(.*)\.self_attn\.in_proj_(weight|bias)", name)) is None:
                out["tower." + name] = value
                continue
            q, k, v = value.chunk(3, dim=0)
            base, kind = match.groups()
            q, k = _permute_for_rope(q, self.heads), _permute_for_rope(k, self.heads)
            for proj, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"tower.{base}.self_attn.{proj}.{kind}"] = tensor.contiguous()
        waiting.clear()
        return out

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`(B, 3, S, S)` views -> `(B, tokens, text_hidden)`."""
        return self.projector(self.tower(pixels).last_hidden_state)


@dataclass(frozen=True)
class Views:
    """A run of one image's views: local crops `first..first + crops` (of the image's, in order),
    then the global view when `has_global`."""

    crops: int
    has_global: bool
    first: int = 0


class Step3EncoderFace(EncoderFace):
    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        super().__init__(model_dir, config, dtype)
        stride = self.image_processor.vision_patch_size * self.image_processor.downsampler_stride
        self.crop_tokens = (self.image_processor.patch_size // stride) ** 2
        self.global_tokens = (self.image_processor.size["height"] // stride) ** 2
        self.crop_patches = (self.image_processor.patch_size // self.image_processor.vision_patch_size) ** 2
        self.global_patches = (self.image_processor.size["height"] // self.image_processor.vision_patch_size) ** 2

    rename = staticmethod(rename)

    def build(self) -> nn.Module:
        return Step3VisionEncoder(self.config, self.dtype)

    def _prepared(self, image: torch.Tensor, views: Views) -> PreparedItem:
        tokens = views.crops * self.crop_tokens + views.has_global * self.global_tokens
        patches = views.crops * self.crop_patches + views.has_global * self.global_patches
        return PreparedItem((image,), views, tokens, patches)

    def preprocess(self, item: MediaItem, layout) -> PreparedItem:
        if item.kind is not MediaKind.IMAGE:
            raise InvalidRequest(f"this model takes images only, not {item.kind.value}")
        image = image_uint8(item.frames[0])
        crops = self.image_processor.get_number_of_image_patches(image.shape[1], image.shape[2])
        if layout is not None and crops != layout.num_crops:  # the router planned it from the header
            raise RuntimeError(f"processor makes {crops} crops, the router planned {layout.num_crops}")
        return self._prepared(image, Views(crops, True))

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Runs of whole views (crops in order, then the global view), each within `budget` where a
        single view fits."""
        image, views = prepared.tensors[0], prepared.layout
        crop_cost = self.crop_tokens if unit == "tokens" else self.crop_patches
        global_cost = self.global_tokens if unit == "tokens" else self.global_patches
        pieces, start, used = [], views.first, 0
        end = views.first + views.crops
        for index in range(views.first, end):
            if used and used + crop_cost > budget:
                pieces.append(self._prepared(image, Views(index - start, False, start)))
                start, used = index, 0
            used += crop_cost
        if views.has_global and used and used + global_cost > budget:
            pieces.append(self._prepared(image, Views(end - start, False, start)))
            start = end
        pieces.append(self._prepared(image, Views(end - start, views.has_global, start)))
        return pieces

    def pixel_values(self, batch: Sequence[PreparedItem], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(crops, global views) of the batch's pieces, in order, float32 `(n, 3, S, S)` as the
        processor makes them, on `device` (one processor call over the batch's images)."""
        out = run_processor(self.image_processor, device, images=[p.tensors[0].to(device) for p in batch])
        size = self.image_processor.patch_size
        crops = [torch.empty((0, 3, size, size), device=device)]
        image_first = 0  # index of the current image's first crop in the processor's output
        for p, made in zip(batch, out["num_local_patches"]):
            if p.layout.crops:
                first = image_first + p.layout.first
                crops.append(out["pixel_values_local"][first:first + p.layout.crops])
            image_first += int(made)
        global_views = out["pixel_values"][[i for i, p in enumerate(batch) if p.layout.has_global]]
        return torch.cat(crops), global_views

    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        """All crops of the batch in one forward, all global views in another; an item's rows are
        its crops' rows then its global view's."""
        views = self.pixel_values(batch, next(module.parameters()).device)
        crop_rows, global_rows = (module(v.to(self.dtype)) if v.shape[0] else v for v in views)
        crops = crop_rows.split([p.layout.crops for p in batch])
        global_views = global_rows.split([int(p.layout.has_global) for p in batch])
        return [(torch.cat([t.reshape(-1, t.shape[-1]) for t in parts if t.shape[0]]),)
                for parts in zip(crops, global_views)]


ENCODER_FACE = Step3EncoderFace
