"""The encoder face of a model family: its vision tower, its preprocessing, its forward.

`VisionEncoder` (encoder_service.runtime) is generic: it reads the checkpoint, asks the face to
build the tower (+ projector) and name the tensors to load, and runs the face's preprocessing and
forward. The face owns everything family-specific; the router face's `layout` of an item arrives
with the item, so the encoder never re-reads headers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.media import MediaItem


@dataclass(frozen=True, eq=False)
class PreparedItem:
    """An item after decode + preprocessing, ready for the tower; opaque outside its face.

    tensors: the face's inputs (several where the family needs them), on CPU.
    layout: the face's description of them (e.g. a patch grid).
    num_tokens: output rows of the item (its embedding slots).
    num_patches: input units of the tower (the alternative batch cost).
    """

    tensors: tuple[torch.Tensor, ...]
    layout: object
    num_tokens: int
    num_patches: int

    def cost(self, unit: str) -> int:
        return self.num_tokens if unit == "tokens" else self.num_patches

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class EncoderFace(ABC):
    """One family's vision side. Built once per encoder process (processors loaded here)."""

    @abstractmethod
    def __init__(self, model_dir: str, config, dtype: torch.dtype):
        """`config`: the checkpoint's `transformers` config."""

    @abstractmethod
    def rename(self, key: str) -> str | None:
        """Checkpoint tensor name -> name in `build()`'s module; None for tensors it does not need."""

    @abstractmethod
    def build(self) -> nn.Module:
        """The tower (+ projector) with uninitialised weights; the runtime loads them strictly."""

    @abstractmethod
    def preprocess(self, item: MediaItem, layout: object) -> PreparedItem:
        """Decode and preprocess; InvalidRequest for media that cannot be decoded."""

    @abstractmethod
    def forward(self, module: nn.Module, batch: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        """One forward over `batch` (packed or stacked as the tower allows); per item, its parts
        (`parts[0]`: `(num_tokens, hidden)` rows for the LM; more for per-layer features)."""

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        """Sub-items within `budget` whose outputs, concatenated in order, equal the item's own;
        `[prepared]` where the family cannot split (the item then runs alone)."""
        return [prepared]

    @abstractmethod
    def preprocess_fingerprint(self) -> str:
        """The preprocessing settings (part of the cache identity of every output)."""
