"""Token-budget batch selection: which queued items form the next packed ViT forward.

Pure bookkeeping (costs and skip counts, no tensors, no clocks), so the policy is tested on its
own; `encoder_service.pool` runs it against a live queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from mmserve.settings import check_fields, setting

CostUnit = Literal["tokens", "patches"]


@dataclass(frozen=True)
class BatchConfig:
    """How the encoder pool forms batches (settings of the app's `encoder_pool`, `mmserve.settings`)."""

    max_batch_tokens: int = setting(16384, "budget of one ViT forward (cost_unit); an item over it runs alone, a "
                                    "video over it in groups of temporal patches that fit", ge=1)
    max_batch_items: int = setting(64, "items (pieces) per ViT forward, whatever their cost", ge=1)
    batch_wait_ms: float = setting(5.0, "longest time the oldest queued item waits for its batch to fill", ge=0)
    cost_unit: CostUnit = setting("tokens", "what max_batch_tokens counts: output tokens (embeddings, like vLLM's "
                                  "encoder budget) or patches (ViT input)")
    skip_ahead: bool = setting(False, "later, smaller items may fill the budget the items ahead of them leave unused")
    max_skips: int = setting(4, "skip-ahead fairness: batches that may overtake one item before it blocks them", ge=0)

    def __post_init__(self):
        check_fields(self)


class Selection(NamedTuple):
    """Queue indices (ascending) of the next batch; `full` when waiting longer cannot grow it."""

    indices: list[int]
    cost: int
    full: bool


def select_batch(costs: Sequence[int], skips: Sequence[int], config: BatchConfig) -> Selection:
    """The next batch from a FIFO queue with item `costs` and per-item `skips` (times overtaken).

    FIFO: the longest prefix whose summed cost fits `max_batch_tokens` (at most `max_batch_items`);
    a head item over the budget runs alone. Skip-ahead: after the prefix, later items that still fit
    join, but never past an item already overtaken `max_skips` times. The caller increments the
    skip count of every unselected item that precedes a selected one (see `overtaken`).
    """
    if not costs:
        return Selection([], 0, False)
    budget, cap = config.max_batch_tokens, config.max_batch_items
    if costs[0] >= budget:
        return Selection([0], costs[0], True)
    chosen: list[int] = []
    total = 0
    for i, cost in enumerate(costs):
        if len(chosen) == cap:
            return Selection(chosen, total, True)
        if total + cost <= budget:
            chosen.append(i)
            total += cost
        elif not config.skip_ahead or skips[i] >= config.max_skips:
            return Selection(chosen, total, True)
    return Selection(chosen, total, total == budget or len(chosen) == cap)


def overtaken(selection: Selection, queue_len: int) -> list[int]:
    """Indices of unselected items that some selected item overtook (they were ahead of it)."""
    chosen = set(selection.indices)
    return [i for i in range(min(max(chosen, default=0), queue_len)) if i not in chosen]


def temporal_groups(num_temporal: int, cost_per_temporal: int, budget: int) -> list[tuple[int, int]]:
    """Split `num_temporal` temporal patches into consecutive `[start, end)` groups within `budget`.

    Each group holds as many whole temporal patches as fit (at least one, even if one alone is
    over the budget); one group when the whole item fits.
    """
    per_group = max(1, budget // max(1, cost_per_temporal))
    return [(start, min(start + per_group, num_temporal)) for start in range(0, num_temporal, per_group)]
