"""One media item's encoder output, as the encoder cache, both transports and the LLM see it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mmserve.inputs.encode_timing import EncodeTiming


@dataclass(frozen=True, eq=False)
class ItemEmbedding:
    """An item's output: `parts[0]` holds the rows injected at the item's embedding slots, in
    order; further parts (Qwen3-VL DeepStack features) have the same rows and travel with it.

    `key` identifies the output: content hash + encoder identity (model, weights fingerprint,
    preprocessing, dtype). Equal keys, equal tensors: the encoder cache and the LLM prefix cache
    key on it, so an encoder upgrade never reuses stale embeddings or KV. Shared: read-only.
    """

    parts: tuple[torch.Tensor, ...]
    key: str
    timing: EncodeTiming | None = field(default=None, repr=False)  # one call's view (`encode_timing`)

    def __post_init__(self):
        if not self.parts or any(p.shape[0] != self.parts[0].shape[0] for p in self.parts):
            raise ValueError("an item embedding needs one or more parts with the same number of rows")

    @property
    def rows(self) -> torch.Tensor:
        return self.parts[0]

    @property
    def num_rows(self) -> int:
        return self.parts[0].shape[0]

    @property
    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    @classmethod
    def concat(cls, pieces: Sequence[tuple[torch.Tensor, ...]], key: str) -> ItemEmbedding:
        """The whole item from the outputs of its sub-items (e.g. video temporal groups), in order."""
        if len(pieces) == 1:
            return cls(tuple(pieces[0]), key)
        return cls(tuple(torch.cat(part) for part in zip(*pieces)), key)

    def to_wire(self) -> torch.Tensor:
        """One tensor for the gRPC wire and result store: the rows, or the parts stacked on dim 0."""
        return self.parts[0] if len(self.parts) == 1 else torch.stack(self.parts)

    @classmethod
    def from_wire(cls, tensor: torch.Tensor, key: str) -> ItemEmbedding:
        return cls((tensor,) if tensor.dim() == 2 else tuple(tensor.unbind(0)), key)
