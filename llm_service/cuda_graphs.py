"""CUDA graphs for decode-only steps, so small-batch decode is not bound by kernel launches.

`DecodeGraphs.capture(runner)` runs at replica start: one graph per padded batch size
(1, 2, 4, 8, 16, 24, ... up to `max_graph_batch_size`), captured largest first into one shared
memory pool (smaller graphs reuse the largest one's activations). A failed capture logs why and
returns None: the replica serves eagerly. Every graph reads one static int32 device buffer —
token ids, M-RoPE positions, pool slots, context lengths and block tables of the rows — which a
step fills with a single host-to-device copy from a pinned staging buffer; padding rows write
their K/V into the pool's scratch block and attend over one token of it. Attention inside the
graphs is the Triton paged kernel (one query per sequence, so shapes are fixed per size).
Written for CUDA; exercised by the tests marked `gpu`.
"""

from __future__ import annotations

import logging
import time

import torch

from llm_service.attention import AttentionBatch

logger = logging.getLogger(__name__)


def graph_batch_sizes(limit: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, limit + 1, 8))
    return [b for b in sizes if b <= limit]


class DecodeGraphs:
    """Captured decode steps of `runner` and their static input buffer.

    Buffer layout (int32, `n` = largest size, `r` = position rows of the family, `w` = block-table
    width): ids `[0, n)`, positions `[n, (1 + r)n)` as `(r, n)`, slots, context lengths (`n` each),
    block tables `(n, w)`.
    """

    def __init__(self, runner):
        cfg = runner.config
        self.runner = runner
        self.sizes = graph_batch_sizes(min(cfg.max_graph_batch_size, cfg.max_num_seqs))
        self.width = -(-runner.model.max_model_len // cfg.block_size)
        self.rows = runner.position_rows
        n, w = self.sizes[-1], self.width
        self.host = torch.zeros(n * (3 + self.rows + w), dtype=torch.int32).pin_memory()
        self.device_buffer = torch.zeros_like(self.host, device=runner.device)
        # row indices and cu_seqlens of every size: graphs read them at replay, so they must live as
        # long as the graphs (a tensor made inside `step_fn` would be freed after capture and reused)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=runner.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def capture(cls, runner) -> DecodeGraphs | None:
        """Graphs for every size, largest first; None (eager decode) if any capture fails."""
        start = time.perf_counter()
        try:
            graphs = cls(runner)
            graphs._fill([])
            graphs.device_buffer.copy_(graphs.host)
            pool = None
            with torch.inference_mode():
                for b in reversed(graphs.sizes):
                    graphs._graphs[b] = graphs._capture_one(b, pool)
                    pool = graphs._graphs[b][0].pool()
            torch.cuda.synchronize(runner.device)
        except Exception as e:  # the replica stays up and decodes eagerly
            logger.warning("CUDA graph capture failed, decode runs without graphs: %s: %s", type(e).__name__, e)
            return None
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs", len(graphs.sizes),
                    graphs.sizes, time.perf_counter() - start)
        return graphs

    def _split(self, buf: torch.Tensor):
        """(ids, positions `(r, n)`, slots, context lengths, block tables `(n, w)`) views of `buf`."""
        n, r, w = self.sizes[-1], self.rows, self.width
        pos_end = (1 + r) * n
        return (buf[:n], buf[n:pos_end].view(r, n), buf[pos_end:pos_end + n], buf[pos_end + n:pos_end + 2 * n],
                buf[pos_end + 2 * n:].view(n, w))

    def _views(self, b: int):
        ids, positions, slots, lens, tables = self._split(self.device_buffer)
        return ids[:b], positions[:, :b], slots[:b], lens[:b], tables[:b]

    def step_fn(self, b: int):
        """The decode step of padded batch size `b` over the static buffer (what a graph captures)."""
        runner = self.runner
        ids, positions, slots, context_lens, tables = self._views(b)
        rows, cu_q = self.arange[:b], self.arange[:b + 1]

        def step() -> torch.Tensor:
            batch = AttentionBatch(
                kv_pool=runner.kv_pool, slot_mapping=slots.long(), cu_seqlens_q=cu_q, context_lens=context_lens,
                block_tables=tables, max_query_len=1, max_context_len=runner.model.max_model_len,
                backend=runner.backend, windows=runner.windows,
            )
            embeds = runner.model.modules.decoder.embed_tokens(ids)
            return runner.forward(embeds, positions, batch, rows)

        return step

    def _capture_one(self, b: int, pool):
        step = self.step_fn(b)
        device = self.runner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()  # warm-up outside the graph: Triton compiles, the allocator settles
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = step()
        return graph, logits

    def fits(self, scheduled) -> bool:
        """A step that graphs can run: decodes past the prompt only, within the captured shapes."""
        return (len(scheduled) <= self.sizes[-1]
                and all(s.seq.num_computed >= s.seq.num_prompt_tokens and len(s.seq.block_table) <= self.width
                        for s in scheduled))

    def _fill(self, scheduled) -> None:
        """Stage the rows of `scheduled` (and padding rows after them) in the pinned host buffer."""
        bs = self.runner.config.block_size
        scratch = self.runner.scratch_block
        ids, positions, slots, lens, tables = (t.numpy() for t in self._split(self.host))
        ids[:] = 0
        positions[:] = 0
        slots[:] = scratch * bs
        lens[:] = 1
        tables[:, 0] = scratch  # padding rows read only their first entry
        for i, (seq, _) in enumerate(scheduled):
            k = seq.num_computed
            ids[i] = seq.tokens[k]
            positions[:, i] = seq.positions(k, k + 1)[:, 0].numpy()
            slots[i] = seq.block_table[k // bs] * bs + k % bs
            lens[i] = k + 1
            tables[i, :len(seq.block_table)] = seq.block_table

    def run(self, scheduled) -> torch.Tensor:
        """Logits `(len(scheduled), vocab)` of a decode-only step, by graph replay.

        The copy is asynchronous from pinned memory: the next step rewrites the host buffer only
        after the sampler has read these logits (a synchronisation), so the copy has landed."""
        b = len(scheduled)
        padded = next(s for s in self.sizes if s >= b)
        self._fill(scheduled)
        used = (3 + self.rows) * self.sizes[-1] + padded * self.width  # block tables last: rows past `padded` stay behind
        self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)  # the step's one copy
        graph, logits = self._graphs[padded]
        graph.replay()
        return logits[:b]
