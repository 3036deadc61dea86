"""A fake vision encoder for pool tests: item bytes say its id and size; outputs encode where they came from."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from encoder_service.batching import temporal_groups
from encoder_service.cache import EncoderIdentity
from encoder_service.families.base import PreparedItem
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind

MERGE = 2


def fake_item(item_id: int, tokens_per_temporal: int, num_temporal: int = 1) -> EncodeItem:
    kind = MediaKind.IMAGE if num_temporal == 1 else MediaKind.VIDEO
    item = MediaItem(kind, (f"{item_id}:{num_temporal}:{tokens_per_temporal}".encode(),))
    return EncodeItem(item, (num_temporal, tokens_per_temporal), num_temporal * tokens_per_temporal)


def corrupt_item(tag: int = 0) -> EncodeItem:
    return EncodeItem(MediaItem(MediaKind.IMAGE, (f"corrupt{tag}".encode(),)), None, 0)


def expected_output(item_id: int, tokens_per_temporal: int, num_temporal: int = 1) -> torch.Tensor:
    rows = [item_id * 1000 + t for t in range(num_temporal) for _ in range(tokens_per_temporal)]
    return torch.tensor(rows, dtype=torch.float64).unsqueeze(1)


def _prepared(rows: torch.Tensor, grid: tuple[int, int, int]) -> PreparedItem:
    t, h, w = grid
    return PreparedItem((rows,), grid, t * h * w // (MERGE * MERGE), t * h * w)


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

    def preprocess(self, item: EncodeItem) -> PreparedItem:
        item_id, t, n = self._parse(item.item)
        rows = torch.tensor([item_id * 1000 + k for k in range(t) for _ in range(4 * n)], dtype=torch.float64)
        return _prepared(rows.unsqueeze(1), (t, 2, 2 * n))

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        t, h, w = prepared.layout
        rows = prepared.tensors[0]
        groups = temporal_groups(t, prepared.cost(unit) // t, budget) if t > 1 else [(0, 1)]
        return [_prepared(rows[a * h * w:b * h * w], (b - a, h, w)) for a, b in groups]

    def forward(self, prepared: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        pieces = []
        for p in prepared:
            first = int(p.tensors[0][0, 0].item())
            pieces.append((first // 1000, first % 1000, p.layout[0]))
        with self._lock:
            self.batches.append(pieces)
        if any(item_id in self.fail_forward_ids for item_id, _, _ in pieces):
            raise RuntimeError("device error")
        if self.forward_s:
            time.sleep(self.forward_s)
        return [(p.tensors[0].reshape(-1, MERGE * MERGE).mean(dim=1, keepdim=True),) for p in prepared]
