"""CUDA graphs for decode-only steps, so small-batch decode is not bound by kernel launches.

One graph per padded batch size (1, 2, 4, 8, 16, 24, ... up to `max_graph_batch_size`), captured
lazily on first use over static input buffers. A step of B decodes copies its inputs into the
buffers of the smallest graph >= B; padding rows write their K/V into the pool's scratch block
and attend over one token of it. Attention inside the graph is the varlen kernel over the paged
pool with `max_context_len` fixed to the model's context, so every replay has the same shapes.
Written for CUDA and not run on CPU (tests marked `gpu`).
"""

from __future__ import annotations

import logging

import torch

from llm_service.attention import AttentionBatch

logger = logging.getLogger(__name__)


def graph_batch_sizes(limit: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, limit + 1, 8))
    return [b for b in sizes if b <= limit]


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        cfg = runner.config
        self.sizes = graph_batch_sizes(min(cfg.max_graph_batch_size, cfg.max_num_seqs))
        self.max_len = runner.model.max_model_len
        self.max_blocks = -(-self.max_len // cfg.block_size)
        n, dev = self.sizes[-1], runner.device
        hidden = runner.model.text_config.hidden_size
        self.embeds = torch.zeros(n, hidden, dtype=runner.model.dtype, device=dev)
        self.positions = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), runner.scratch_block, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._failed = False

    def fits(self, batch_size: int) -> bool:
        return not self._failed and batch_size <= self.sizes[-1]

    def _batch(self, b: int) -> AttentionBatch:
        return AttentionBatch(
            kv_pool=self.runner.kv_pool, slot_mapping=self.slots[:b], cu_seqlens_q=self.cu_q[:b + 1],
            context_lens=self.context_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            max_context_len=self.max_len, backend=self.runner.backend,
        )

    def _capture(self, b: int):
        rows = torch.arange(b, device=self.runner.device)
        forward = self.runner.forward
        batch = self._batch(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (allocator, lazy kernel init) outside the graph
                forward(self.embeds[:b], self.positions[:, :b], batch, rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward(self.embeds[:b], self.positions[:, :b], batch, rows)
        self._pool = graph.pool()
        return graph, logits

    @torch.inference_mode()
    def run(self, scheduled) -> torch.Tensor:
        """Logits `(len(scheduled), vocab)` of a decode-only step, by graph replay."""
        b = len(scheduled)
        padded = next(s for s in self.sizes if s >= b)
        runner, bs = self.runner, self.runner.config.block_size
        ids, pos, slots, lens = [], [], [], []
        self.block_tables[:padded].fill_(runner.scratch_block)
        for i, (seq, _) in enumerate(scheduled):
            n = seq.num_computed
            ids.append(seq.tokens[n])
            pos.append(seq.positions(n, n + 1))
            slots.append(seq.block_table[n // bs] * bs + n % bs)
            lens.append(n + 1)
            self.block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        dev = runner.device
        self.embeds[:b] = runner.model.modules.decoder.embed_tokens(torch.tensor(ids, device=dev))
        self.positions[:, :b] = torch.cat(pos, dim=1).to(dev)
        self.slots[:padded] = runner.scratch_block * bs
        self.slots[:b] = torch.tensor(slots, device=dev)
        self.context_lens[:padded] = 1
        self.context_lens[:b] = torch.tensor(lens, dtype=torch.int32, device=dev)
        if padded not in self._graphs:
            try:
                self._graphs[padded] = self._capture(padded)
                logger.info("captured decode CUDA graph for batch %d", padded)
            except Exception:
                logger.exception("CUDA graph capture failed; decode runs eagerly")
                self._failed = True
                embeds, positions, batch, last, extra = runner.prepare(scheduled)
                return runner.forward(embeds, positions, batch, last, **extra)
        graph, logits = self._graphs[padded]
        graph.replay()
        return logits[:b]
