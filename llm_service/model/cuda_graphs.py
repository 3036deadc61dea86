"""CUDA graphs for decode-only steps, so small-batch decode is not bound by kernel launches
(docs/attention.md#cuda-graphs): one per padded batch size, each capturing `ModelRunner.decode_forward` over
the rows' index (padding rows read the batch state's pad row). With LoRA adapters the graphs hold the slot
kernels (`llm_service.model.lora`). On the CPU the tests run it uncaptured (`capture=False`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from mmserve.kernels.cuda_graph_ladder import capture_ladder

logger = logging.getLogger(__name__)


def graph_batch_sizes(limit: int) -> list[int]:
    return [b for b in (1, 2, 4, 8, *range(16, limit + 1, 8)) if b <= limit]


class DecodeGraphs:
    """Captured decode steps of `runner` and their static input: `index` `(n,)` int64, the rows
    of the step (`n` = largest size). Everything else a graph reads is the runner's own long-lived
    state (the rows, the KV pool, the weights) or memory of the graphs' pool."""

    def __init__(self, runner):
        cfg = runner.config
        self.runner = runner
        self.sizes = graph_batch_sizes(min(cfg.max_graph_batch_size, cfg.max_num_seqs))
        self.index = torch.full((self.sizes[-1],), runner.batch.pad_row, dtype=torch.long, device=runner.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, object]] = {}

    @classmethod
    def capture(cls, runner, capture: bool = True) -> DecodeGraphs | None:
        """Graphs for every size, largest first; None (eager decode) if any capture fails.
        `capture=False`: the step of each size kept uncaptured, run eagerly (tests, any device)."""
        start = time.perf_counter()
        if not capture:
            graphs = cls(runner)
            graphs._graphs = {b: (None, graphs.step_fn(b)) for b in graphs.sizes}
            return graphs
        try:
            graphs = cls(runner)
            with runner.loras.capturing() if runner.loras is not None else contextlib.nullcontext():
                graphs._graphs = capture_ladder(graphs.sizes, graphs.step_fn, runner.device)
        except Exception as e:  # the replica stays up and decodes eagerly
            logger.warning("CUDA graph capture failed, decode runs without graphs: %s: %s", type(e).__name__, e)
            return None
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs", len(graphs.sizes),
                    graphs.sizes, time.perf_counter() - start)
        return graphs

    def step_fn(self, b: int):
        """The decode step of padded batch size `b` over the static index (what a graph captures)."""
        return functools.partial(self.runner.decode_forward, self.index[:b])

    def padded_size(self, b: int) -> int | None:
        """The captured size that runs a decode of `b` rows (None: more rows than any graph)."""
        return next((s for s in self.sizes if s >= b), None)

    def replay(self, padded: int, b: int, index: torch.Tensor) -> torch.Tensor:
        """Logits `(b, vocab)` of the decode of rows `index` (padded to `padded` with the pad row),
        by graph replay (or the uncaptured step)."""
        self.index[:padded].copy_(index)
        graph, out = self._graphs[padded]
        if graph is None:
            return out()[:b]
        graph.replay()
        return out[:b]
