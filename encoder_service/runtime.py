"""The vision encoder: only the vision tower of a checkpoint, the checkpoint's own processors."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from encoder_service.cache import EncoderIdentity
from encoder_service.families import encoder_face
from encoder_service.vit_attention import use_packed_attention
from mmserve.checkpoint import load_tensors, read_config, resolve_dtype
from mmserve.errors import InvalidRequest
from mmserve.families import family_of, router_face
from mmserve.media import MediaItem, MediaKind, decode_image

logger = logging.getLogger(__name__)


class PreparedItem(NamedTuple):
    """An item after decode/resize/normalize/patchify: flat patches and their (t, h, w) grid."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def weights_fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """Hash of every tensor's name, dtype, shape and bytes (stable across processes)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class VisionEncoder:
    """Loads the vision tower of `model_dir` and encodes media items.

    `encode(items)` returns one `(num_tokens, hidden)` CPU tensor per item, from one packed
    forward over all of them. Thread-safe: forwards are serialised.
    """

    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "cpu"):
        from transformers import AutoConfig, AutoProcessor

        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.family = family_of(model_dir)
        self.dtype = resolve_dtype(dtype, read_config(model_dir))
        self.device = torch.device(device)
        self._face = encoder_face(self.family)
        self._router_face = router_face(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        processor = AutoProcessor.from_pretrained(model_dir)
        self._image_processor = processor.image_processor
        self._video_processor = processor.video_processor

        loaded = load_tensors(model_dir, self._face.rename, self.dtype)
        tower = self._face.build_tower(config, self.dtype)
        tower.load_state_dict(loaded.state_dict, strict=True)
        self.tower = use_packed_attention(tower.to(self.device).eval().requires_grad_(False))
        self.keys_read = loaded.keys_read
        self.merge_size = config.vision_config.spatial_merge_size
        preprocess = self._image_processor.to_json_string() + self._video_processor.to_json_string()
        self.identity = EncoderIdentity(
            model_id=self.model_dir.name,
            weights_fingerprint=weights_fingerprint(loaded.state_dict),
            preprocess_fingerprint=hashlib.blake2b(preprocess.encode(), digest_size=16).hexdigest(),
            dtype=str(self.dtype),
        )
        del loaded
        self._lock = threading.Lock()
        logger.info(
            "vision tower of %s loaded: %d tensors, %.1fM params, %s on %s in %.1fs",
            self.model_dir.name, len(self.keys_read), self.num_parameters / 1e6, self.dtype,
            self.device, time.perf_counter() - start,
        )

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.tower.parameters())

    def preprocess(self, item: MediaItem) -> PreparedItem:
        """Decode (EXIF orientation applied) and run the checkpoint's image/video processor."""
        frames = [decode_image(data) for data in item.frames]
        if item.kind is MediaKind.IMAGE:
            out = self._image_processor(images=frames, return_tensors="pt")
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        else:
            if len({f.size for f in frames}) != 1:
                raise InvalidRequest("all frames of a video must have the same size")
            out = self._video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        return PreparedItem(pixels, tuple(int(x) for x in grid[0].tolist()))

    def estimate_tokens(self, item: MediaItem) -> int:
        """Output tokens of `item` from its header(s) alone (what the router computed)."""
        return self._router_face.layout(item, max_pixels=1 << 62).num_tokens

    def num_tokens(self, prepared: PreparedItem) -> int:
        return prepared.num_patches // (self.merge_size * self.merge_size)

    def cost(self, prepared: PreparedItem, unit: str) -> int:
        """Batch-budget cost of `prepared`: output tokens or input patches."""
        return self.num_tokens(prepared) if unit == "tokens" else prepared.num_patches

    def split(self, prepared: PreparedItem, groups: Sequence[tuple[int, int]]) -> list[PreparedItem]:
        """Pieces of `prepared` over `[start, end)` ranges of temporal patches.

        Encoding the pieces and concatenating their outputs in order equals encoding the whole
        item: the ViT attends only within a temporal patch.
        """
        return [PreparedItem(*self._face.temporal_slice(prepared.pixel_values, prepared.grid, a, b)) for a, b in groups]

    @torch.inference_mode()
    def forward(self, prepared: Sequence[PreparedItem]) -> list[torch.Tensor]:
        """One packed varlen forward (no padding) over `prepared`; outputs on CPU, one per item."""
        if not prepared:
            return []
        pixels = torch.cat([p.pixel_values for p in prepared]).to(self.device, self.dtype)
        with self._lock:
            outs = self._face.forward(self.tower, pixels, [p.grid for p in prepared])
        return [o.to("cpu") for o in outs]

    def encode(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        return self.forward([self.preprocess(item) for item in items])
