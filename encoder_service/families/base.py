"""The encoder face of a model family: its vision tower, its preprocessing, its forward.

`VisionEncoder` (encoder_service.runtime) is generic: it reads the checkpoint, asks the face to
build the tower (+ projector) and name the tensors to load, and runs the face's preprocessing and
forward. The face owns everything family-specific; the router face's `layout` of an item arrives
with the item, so the encoder never re-reads headers.

Pixels stay uint8 until the device: `preprocess` (CPU threads) only decodes, to the uint8
channels-first tensor `transformers`' torchvision processors make of a decoded image, and
`forward` runs the checkpoint's processor (resize, rescale, normalize, patchify) on the tower's
device, then the tower. The processor's ops are the same on CPU and GPU, so one code path serves
both, and the pool queues (and bounds) 3 bytes a pixel instead of the float32 patches' 12 or more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mmserve.inputs.media import AdapterRef, MediaItem, decode_image, video_frames


@dataclass(frozen=True, eq=False)
class PreparedItem:
    """An item after decode + preprocessing, ready for the tower; opaque outside its face.

    tensors: the face's inputs (several where the family needs them), on CPU: decoded uint8
        pixels where the face runs its processor on the device (see the module docstring).
    layout: the face's description of them (e.g. a patch grid).
    num_tokens: output rows of the item (its embedding slots).
    num_patches: input units of the tower (the alternative batch cost).
    lora: the LoRA adapter the tower applies to it (`encoder_service.lora`), None for none; set
        by the runtime, kept by its pieces.
    """

    tensors: tuple[torch.Tensor, ...]
    layout: object
    num_tokens: int
    num_patches: int
    lora: AdapterRef | None = None

    def cost(self, unit: str) -> int:
        return self.num_tokens if unit == "tokens" else self.num_patches

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class EncoderFace(ABC):
    """One family's vision side. Built once per encoder process (processors loaded here).

    `lora_stages`: prefixes of the tower's module names whose linears take LoRA adapters, one per
    stage of the packed forward whose rows `lora_rows` counts (empty: no vision-tower adapters).
    """

    lora_stages: tuple[str, ...] = ()

    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        """`config`: the checkpoint's `transformers` config; the checkpoint's processors loaded here."""
        from transformers import AutoProcessor

        self.config, self.dtype = config, dtype
        processor = AutoProcessor.from_pretrained(model_dir)
        self.image_processor = processor.image_processor
        self.video_processor = getattr(processor, "video_processor", None)

    @abstractmethod
    def rename(self, key: str) -> str | None:
        """Checkpoint tensor name -> name in `build()`'s module; None for tensors it does not need."""

    @abstractmethod
    def build(self) -> nn.Module:
        """The tower (+ projector) with uninitialised weights; the runtime loads them strictly."""

    @abstractmethod
    def preprocess(self, item: MediaItem, layout: object) -> PreparedItem:
        """Decode and preprocess; InvalidRequest for media that cannot be decoded."""

    def pixel_values(self, batch: Sequence[PreparedItem], device: torch.device):
        """What `forward` feeds the tower for `batch`: the checkpoint's processor output (one tensor,
        or one per input the tower takes), made on `device` from the queued uint8 pixels."""
        raise NotImplementedError

    @abstractmethod
    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        """One forward over `batch` (packed or stacked as the tower allows); per item, its parts
        (`parts[0]`: `(num_tokens, hidden)` rows for the LM; more for per-layer features)."""

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Sub-items within `budget` whose outputs, concatenated in order, equal the item's own;
        `[prepared]` where the family cannot split (the item then runs alone)."""
        return [prepared]

    def lora_rows(self, batch: Sequence[PreparedItem]) -> dict[str, list[int]]:
        """Per stage of `lora_stages`, each item's rows in the packed forward there, in batch order
        (an item's rows consecutive, items in batch order): the rows an item's adapter applies to."""
        raise NotImplementedError

    def capture_graphs(self, tower: nn.Module, max_cost: int, unit: str, capture: bool = True,
                       max_patches: int | None = None) -> str:
        """Capture the tower's forward per budget up to the pool's `max_cost` (`unit`s) and
        `max_patches`, for `forward` to replay; returns what happened (graphs or why none)."""
        return f"no CUDA graphs for {type(self).__name__}"

    def preprocess_fingerprint(self) -> str:
        """The preprocessing settings (part of the cache identity of every output): the processors'."""
        return "".join(p.to_json_string() for p in (self.image_processor, self.video_processor) if p is not None)


def image_uint8(data: bytes) -> torch.Tensor:
    """(3, H, W) uint8 of an encoded image, decoded with its EXIF orientation applied: the tensor a
    torchvision `transformers` processor makes of the decoded RGB image before its first op."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(decode_image(data)).transpose(2, 0, 1)))


def video_uint8(item: MediaItem) -> torch.Tensor:
    """(T, 3, H, W) uint8 of a video item's frames (decoded on the server, or frame images)."""
    frames = video_frames(item)
    array = frames if isinstance(frames, np.ndarray) else np.stack([np.asarray(f) for f in frames])
    return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2)))  # a copy: the input may be read-only


def run_processor(processor, device: torch.device, **inputs):
    """`processor` (a torchvision-backend `transformers` image or video processor) over uint8
    channels-first `inputs` (`images=` or `videos=`, lists), on `device`: the processor's own
    resize, rescale, normalize and patchify ops, so the output equals what it makes on CPU of the
    decoded images. Channels-first is stated, not inferred (a 3-pixel-high image is ambiguous)."""
    return processor(**inputs, device=device, input_data_format="channels_first", return_tensors="pt")
