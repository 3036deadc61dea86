"""Encoder math of LLaVA (`model_type: llava`): CLIP or SigLIP tower up to the deepest selected
layer, feature select, projector. Input is fixed-size, so a batch is a stack `(B, 3, H, W)` and
every image yields the same number of rows.

The reference is `transformers` 5.x `LlavaModel.get_image_features`:

- The tower runs with hidden states captured: `hidden_states[0]` is the input of encoder layer 0
  (CLIP: embeddings then `pre_layrnorm`; SigLIP: patch + position embeddings) and
  `hidden_states[i]` the output of layer `i - 1`, so there are `num_hidden_layers + 1` of them.
  CLIP and SigLIP capture with `tie_last_hidden_states=False`: `hidden_states[-1]` is the last
  layer's output BEFORE `post_layernorm`.
- `vision_feature_layer` int L: `hidden_states[L]`; a list: each of them, the strategy applied to
  each, concatenated on the feature axis in list order (the projector's `linear_1` takes
  `len(list) * vision_hidden` inputs). Negative indices count from the full tower:
  `L < 0` -> `L + num_hidden_layers + 1`. Layers needed = the deepest absolute index, e.g. a
  4-layer tower with L = -2 selects `hidden_states[3]` = output of layer 2: 3 layers are built.
- Strategy `default`: `h[:, 1:]`: drops the FIRST row whatever the tower (CLIP's CLS; with a
  tower without CLS, such as SigLIP, it drops a real patch and transformers does so too);
  `full`: all rows. `LlavaConfig` admits only these two (no `class`).
- `post_layernorm` is never applied and SigLIP's attention-pooling head is never used; neither is
  loaded here.
- Projector: `linear_2(act(linear_1(features)))`.

Where vLLM's generic rule differs, the class wins (docs/adding-a-family.md#pitfalls-met-on-the-way).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from encoder_service.families.base import EncoderFace, PreparedItem, image_uint8, run_processor
from mmserve.checkpoint import strip_prefix
from mmserve.families import llava as llava_router
from mmserve.inputs.media import MediaItem

# transformers 5.x in-memory layout first, then the saved one (5.x `save_pretrained` writes the
# legacy top-level prefixes); a tower key may also carry 4.x's `vision_model.` (hub llava-*-hf).
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_LEGACY_TOWER_PREFIX = "vision_model."
STRATEGIES = ("default", "full")


def rename(key: str) -> str | None:
    """Checkpoint key -> key in the full vision module (None: not a vision tensor).

    Tower keys come out as the 5.x tower names (`embeddings.*`, `pre_layrnorm.*`,
    `encoder.layers.N.*`, `post_layernorm.*`, `head.*`), projector keys as `projector.*`.
    """
    if (tower := strip_prefix(key, VISION_PREFIXES)) is not None:
        return tower.removeprefix(_LEGACY_TOWER_PREFIX)
    projector = strip_prefix(key, PROJECTOR_PREFIXES)
    return None if projector is None else "projector." + projector


@dataclass(frozen=True)
class FeatureSelect:
    """The config's feature select, resolved against the full tower depth."""

    hidden_state_indices: tuple[int, ...]  # absolute indices into hidden_states, in config order
    strategy: str
    num_layers: int  # encoder layers to build and load: the deepest selected index


def feature_select(config) -> FeatureSelect:
    """Resolve `vision_feature_layer` / `vision_feature_select_strategy` of a `LlavaConfig`."""
    depth = config.vision_config.num_hidden_layers
    layer = config.vision_feature_layer
    layers = [layer] if isinstance(layer, int) else list(layer)
    if not layers:
        raise ValueError("vision_feature_layer is an empty list")
    indices = tuple(index + depth + 1 if index < 0 else index for index in layers)
    if outside := [index for index, absolute in zip(layers, indices) if not 0 <= absolute <= depth]:
        raise ValueError(f"vision_feature_layer {outside[0]} is outside a tower of {depth} layers")
    strategy = config.vision_feature_select_strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not one of {STRATEGIES}")
    return FeatureSelect(indices, strategy, max(indices))


def image_token_count(config) -> int:
    """Encoder rows of one image (the router face's count, see `mmserve.families.llava`)."""
    vision = config.vision_config
    return llava_router.image_token_count(vision.model_type, vision.image_size, vision.patch_size,
                                          config.vision_feature_select_strategy)


class LlavaVisionEncoder(nn.Module):
    """Tower embeddings (+ CLIP's pre-norm), the first `select.num_layers` encoder layers and the
    projector. Parameter names are `rename`'s names with `encoder.layers` -> `layers`."""

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers.initialization import no_init_weights
        from transformers.models.auto.modeling_auto import MODEL_MAPPING
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.select = feature_select(config)
        self.tokens_per_image = image_token_count(config)
        vision = copy.deepcopy(config.vision_config)
        vision.num_hidden_layers = self.select.num_layers
        if hasattr(vision, "vision_use_head"):
            vision.vision_use_head = False
        with no_init_weights():
            tower = MODEL_MAPPING[type(vision)]._from_config(vision, dtype=dtype)
            projector = LlavaMultiModalProjector(config).to(dtype)
        self.embeddings = tower.embeddings
        self.pre_layrnorm = tower.pre_layrnorm if hasattr(tower, "pre_layrnorm") else nn.Identity()
        self.layers = tower.encoder.layers
        self.projector = projector

    def checkpoint_rename(self) -> Callable[[str], str | None]:
        """`rename` restricted to the tensors this module holds (for `load_weights`)."""
        wanted = set(self.state_dict())

        def to_module_key(key: str) -> str | None:
            name = rename(key) or ""
            if name.startswith("encoder.layers."):
                name = name[len("encoder."):]
            return name if name in wanted else None

        return to_module_key

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` -> `(B, tokens_per_image, text_hidden)`."""
        wanted = set(self.select.hidden_state_indices)
        hidden = self.pre_layrnorm(self.embeddings(pixel_values.to(self.projector.linear_1.weight.dtype)))
        kept = {0: hidden} if 0 in wanted else {}
        for index, layer in enumerate(self.layers, start=1):
            hidden = layer(hidden, None)
            if index in wanted:
                kept[index] = hidden
        features = [kept[i] for i in self.select.hidden_state_indices]
        if self.select.strategy == "default":
            features = [f[:, 1:] for f in features]
        return self.projector(torch.cat(features, dim=-1))


class LlavaEncoderFace(EncoderFace):
    """Fixed-size images, stacked `(B, 3, H, W)` (no packing needed: every image costs the same).

    An image waits for the device decoded, as uint8 `(3, H, W)`; the CLIP/SigLIP processor
    (resize, crop, rescale, normalize) runs over the whole batch on the tower's device."""

    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        super().__init__(model_dir, config, dtype)
        self._module = LlavaVisionEncoder(config, dtype)
        self._rename = self._module.checkpoint_rename()

    def rename(self, key: str) -> str | None:
        return self._rename(key)

    def build(self) -> nn.Module:
        return self._module

    def preprocess(self, item: MediaItem, layout: object) -> PreparedItem:
        n = self._module.tokens_per_image
        return PreparedItem((image_uint8(item.frames[0]),), None, n, n)

    def pixel_values(self, batch, device: torch.device) -> torch.Tensor:
        """`(B, 3, S, S)` float32 as the processor makes them, on `device`."""
        images = [p.tensors[0].to(device) for p in batch]
        return run_processor(self.image_processor, device, images=images)["pixel_values"]

    def forward(self, module: nn.Module, batch) -> list[tuple[torch.Tensor, ...]]:
        device = next(module.parameters()).device
        return [(rows,) for rows in module(self.pixel_values(batch, device).to(self.dtype)).unbind(0)]


ENCODER_FACE = LlavaEncoderFace
