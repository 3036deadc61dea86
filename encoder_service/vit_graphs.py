"""CUDA graphs of the Qwen2-VL / Qwen2.5-VL vision tower, one per patch budget.

The pool already cuts batches by a token budget, so a batch maps onto a graph: its `P` patches run
in the graph of the smallest captured budget `B >= P`. The tail `B - P` rows (zeros) are one
padding segment of their own, in the full-attention layers and in Qwen2.5-VL's windows, so no
real item attends to them and the merger never mixes them in (`B - P` is a whole number of merge
blocks): the real items' outputs are the first `P / merge²` rows, as the eager forward gives them.

What the tower derives from `grid_thw` with host work (`cu_seqlens`, the rotary position ids,
Qwen2.5-VL's window order and windows) is computed here per batch, padded, and copied into buffers
the graphs own; `transformers` takes them precomputed through the forward's kwargs
(`transformers.vision_utils`). Segment tables have a fixed length per budget: unused entries
repeat the last boundary (zero-length segments), and the attention's longest segment is the
budget. A batch with more attention segments than `max_segments` (frames of long videos, many
small images) or more patches than the largest budget runs eagerly.

`TowerGraphs.capture` runs at replica start, largest budget first into one memory pool. A failed
capture, or graphs whose output differs from the eager forward on a check batch, log why and leave
the encoder eager. `capture=False` keeps the same buffers and padded forward, uncaptured: the CPU
tests check the padding with it, and the tests marked `gpu` the graphs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.kernels.cuda_graph_ladder import capture_ladder

logger = logging.getLogger(__name__)

SMALLEST_BUDGET = 1024  # patches: the ladder doubles from here to the pool's budget
MAX_SEGMENTS = 64  # attention segments (images, or a video's temporal patches) per graph batch


def budget_ladder(max_patches: int, unit: int, smallest: int = SMALLEST_BUDGET) -> list[int]:
    """Patch budgets to capture: `smallest`, doubling, then `max_patches` (each a multiple of `unit`)."""
    top = -(-max_patches // unit) * unit
    budgets, b = [], max(unit, smallest // unit * unit)
    while b < top:
        budgets.append(b)
        b *= 2
    return budgets + [top]


@dataclass(frozen=True)
class BatchLayout:
    """One batch's tower metadata, padded to `budget` patches (host tensors)."""

    budget: int
    patches: int
    position_ids: torch.Tensor  # (budget, 2) long
    cu_seqlens: torch.Tensor  # (segments + 1,) int32
    window_index: torch.Tensor | None = None  # (budget / merge²,) long: Qwen2.5-VL
    cu_window_seqlens: torch.Tensor | None = None  # (windows + 1,) int32


def _padded_table(real: torch.Tensor, end: int, length: int) -> torch.Tensor:
    """Cumulative boundaries `real` (ending at the real patch count), then one segment to `end`,
    then zero-length segments up to `length` entries."""
    table = torch.full((length,), end, dtype=torch.int32)
    table[:real.numel()] = real.to(torch.int32)
    return table


class TowerGraphs:
    """Captured (or, with `capture=False`, uncaptured) padded forwards of one Qwen tower."""

    def __init__(self, tower: torch.nn.Module, budgets: Sequence[int], in_features: int,
                 max_segments: int = MAX_SEGMENTS):
        param = next(tower.parameters())
        self.tower, self.device, self.dtype = tower, param.device, param.dtype
        self.merge = int(tower.spatial_merge_size)
        self.unit = self.merge * self.merge
        self.windowed = hasattr(tower, "fullatt_block_indexes")  # Qwen2.5-VL
        self.budgets = sorted(budgets)
        self.max_segments = max_segments
        top = self.budgets[-1]
        self.pixels = torch.zeros((top, in_features), dtype=self.dtype, device=self.device)
        self.position_ids = torch.zeros((top, 2), dtype=torch.long, device=self.device)
        self.window_index = torch.arange(top // self.unit, device=self.device)
        # per budget: its segment tables (their lengths fix the attention's launch shape)
        self.cu_seqlens = {b: torch.zeros(self._segments(b) + 1, dtype=torch.int32, device=self.device)
                           for b in self.budgets}
        self.cu_windows = {b: torch.zeros(b // self.unit + 1, dtype=torch.int32, device=self.device)
                           for b in self.budgets} if self.windowed else {}
        self._grid = torch.ones((1, 3), dtype=torch.long, device=self.device)  # read by nothing: all is precomputed
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.runs = 0  # batches run through the graphs (the rest ran eagerly)

    def _segments(self, budget: int) -> int:
        return min(self.max_segments, budget // self.unit) + 1  # + the padding segment

    # -- the host side: a batch's metadata, padded --------------------------------------------------
    def layout(self, grids: Sequence[tuple[int, int, int]]) -> BatchLayout | None:
        """The batch's metadata padded to its budget; None when no graph holds it (run eagerly)."""
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

        patches = sum(t * h * w for t, h, w in grids)
        budget = next((b for b in self.budgets if b >= patches), None)
        segments = sum(t for t, _, _ in grids)
        if budget is None or segments >= self._segments(budget):
            return None
        grid_thw = torch.tensor(grids, dtype=torch.long)
        position_ids = torch.zeros((budget, 2), dtype=torch.long)
        position_ids[:patches] = get_vision_position_ids(grid_thw, self.merge)
        cu = _padded_table(get_vision_cu_seqlens(grid_thw), budget, self._segments(budget) + 1)
        if not self.windowed:
            return BatchLayout(budget, patches, position_ids, cu)
        from transformers.vision_utils import get_vision_window_index

        index, cu_windows = get_vision_window_index(grid_thw, self.merge, self.tower.window_size, self.tower.patch_size)
        window_index = torch.arange(budget // self.unit)  # the padding's blocks stay where they are
        window_index[:index.numel()] = index
        cu_windows = _padded_table(cu_windows, budget, budget // self.unit + 1)
        return BatchLayout(budget, patches, position_ids, cu, window_index, cu_windows)

    # -- the device side ----------------------------------------------------------------------------
    def _forward(self, budget: int) -> torch.Tensor:
        kwargs = {"cu_seqlens": self.cu_seqlens[budget], "max_seqlen": budget,
                  "position_ids": self.position_ids[:budget]}
        if self.windowed:
            kwargs |= {"window_index": self.window_index[:budget // self.unit],
                       "cu_window_seqlens": self.cu_windows[budget], "max_window_seqlen": budget}
        return self.tower(self.pixels[:budget], grid_thw=self._grid, **kwargs).pooler_output

    def _load(self, pixel_values: torch.Tensor, layout: BatchLayout) -> None:
        b, p = layout.budget, layout.patches
        self.pixels[:p].copy_(pixel_values)
        self.pixels[p:b].zero_()
        self.position_ids[:b].copy_(layout.position_ids, non_blocking=True)
        self.cu_seqlens[b].copy_(layout.cu_seqlens, non_blocking=True)
        if self.windowed:
            self.window_index[:b // self.unit].copy_(layout.window_index, non_blocking=True)
            self.cu_windows[b].copy_(layout.cu_window_seqlens, non_blocking=True)

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor | None:
        """The merged rows of the batch (`P / merge²`, in item order), or None: no graph holds it."""
        layout = self.layout(grids)
        if layout is None or layout.budget not in self._graphs:
            return None
        self._load(pixel_values, layout)
        self.runs += 1
        graph, out = self._graphs[layout.budget]
        if graph is None:
            out = self._forward(layout.budget)
        else:
            graph.replay()
        return out[:layout.patches // self.unit].clone()  # the graph's output buffer is reused

    @classmethod
    def capture(cls, tower: torch.nn.Module, budgets: Sequence[int], in_features: int,
                check: tuple[torch.Tensor, list] | None = None, capture: bool = True,
                max_segments: int = MAX_SEGMENTS) -> tuple[TowerGraphs | None, str]:
        """(graphs, what happened): every budget captured, largest first, then `check` (pixel
        values and grids of a batch) run both ways; (None, why) when any step fails."""
        start = time.perf_counter()
        import importlib.util

        import transformers

        if importlib.util.find_spec("transformers.vision_utils") is None:
            return None, (f"transformers {transformers.__version__} takes no precomputed tower inputs "
                          "(transformers.vision_utils); graphs need a newer one")
        try:
            graphs = cls(tower, budgets, in_features, max_segments)
            if not capture:
                graphs._graphs = {b: (None, None) for b in graphs.budgets}
                return graphs, "uncaptured (eager padded forwards)"
            graphs._graphs = capture_ladder(graphs.budgets, lambda b: functools.partial(graphs._forward, b),
                                            graphs.device, warmups=2)
            if check is not None and (why := graphs._differs(*check)):
                return None, why
            graphs.runs = 0  # served batches only, not the check
        except Exception as e:  # the encoder stays up, eager
            return None, f"capture failed: {type(e).__name__}: {e}"
        return graphs, f"{len(graphs.budgets)} budgets {graphs.budgets} captured in {time.perf_counter() - start:.1f} s"

    def _differs(self, pixel_values: torch.Tensor, grids: list) -> str | None:
        """Why the graphs cannot be trusted on this batch (None: they agree with the eager tower)."""
        with torch.inference_mode():
            got = self.run(pixel_values, grids)
            grid_thw = torch.tensor(grids, dtype=torch.long, device=self.device)
            want = self.tower(pixel_values, grid_thw=grid_thw).pooler_output
        if got is None:
            return "the check batch fits no captured budget"
        tolerance = 1e-2 if self.dtype in (torch.float16, torch.bfloat16) else 1e-4
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
        return None if error <= tolerance else f"graph output differs from eager by {error:.2e} (relative)"
