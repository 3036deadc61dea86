"""A fake vision encoder for pool tests: item bytes say its id and size; outputs encode where they came from."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from encoder_service.cache import EncoderIdentity
from encoder_service.families.qwen2_vl import QwenVLEncoderFace
from encoder_service.runtime import PreparedItem
from mmserve.errors import InvalidRequest
from mmserve.media import MediaItem, MediaKind

MERGE = 2


def fake_item(item_id: int, tokens_per_temporal: int, num_temporal: int = 1) -> MediaItem:
    kind = MediaKind.IMAGE if num_temporal == 1 else MediaKind.VIDEO
    return MediaItem(kind, (f"{item_id}:{num_temporal}:{tokens_per_temporal}".encode(),))


def corrupt_item(tag: int = 0) -> MediaItem:
    return MediaItem(MediaKind.IMAGE, (f"corrupt{tag}".encode(),))


def expected_output(item_id: int, tokens_per_temporal: int, num_temporal: int = 1) -> torch.Tensor:
    rows = [item_id * 1000 + t for t in range(num_temporal) for _ in range(tokens_per_temporal)]
    return torch.tensor(rows, dtype=torch.float64).unsqueeze(1)


class FakeEncoder:
    """Grid (t, 2, 2n) per item -> n tokens per temporal patch; every output row is id*1000 + t.

    `batches` records the (item id, first temporal index, num temporal) of every piece per forward.
    """

    identity = EncoderIdentity("fake", "weights", "preprocess", "float64")

    def __init__(self, forward_s: float = 0.0, fail_forward_ids: frozenset[int] = frozenset()):
        self.forward_s = forward_s
        self.fail_forward_ids = fail_forward_ids
        self.batches: list[list[tuple[int, int, int]]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _parse(item: MediaItem) -> tuple[int, int, int]:
        try:
            item_id, t, n = (int(x) for x in item.frames[0].decode().split(":"))
        except ValueError:
            raise InvalidRequest("cannot decode image: corrupt") from None
        return item_id, t, n

    def estimate_tokens(self, item: MediaItem) -> int:
        _, t, n = self._parse(item)
        return t * n

    def preprocess(self, item: MediaItem) -> PreparedItem:
        item_id, t, n = self._parse(item)
        rows = torch.tensor([item_id * 1000 + k for k in range(t) for _ in range(4 * n)], dtype=torch.float64)
        return PreparedItem(rows.unsqueeze(1), (t, 2, 2 * n))

    def num_tokens(self, prepared: PreparedItem) -> int:
        return prepared.num_patches // (MERGE * MERGE)

    def cost(self, prepared: PreparedItem, unit: str) -> int:
        return self.num_tokens(prepared) if unit == "tokens" else prepared.num_patches

    def split(self, prepared: PreparedItem, groups: Sequence[tuple[int, int]]) -> list[PreparedItem]:
        face = QwenVLEncoderFace("qwen2_vl")
        return [PreparedItem(*face.temporal_slice(prepared.pixel_values, prepared.grid, a, b)) for a, b in groups]

    def forward(self, prepared: Sequence[PreparedItem]) -> list[torch.Tensor]:
        pieces = []
        for p in prepared:
            first = int(p.pixel_values[0, 0].item())
            pieces.append((first // 1000, first % 1000, p.grid[0]))
        with self._lock:
            self.batches.append(pieces)
        if any(item_id in self.fail_forward_ids for item_id, _, _ in pieces):
            raise RuntimeError("device error")
        if self.forward_s:
            time.sleep(self.forward_s)
        return [p.pixel_values.reshape(-1, MERGE * MERGE).mean(dim=1, keepdim=True) for p in prepared]
