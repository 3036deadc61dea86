"""Runs one engine step: a single packed forward of the decoder over every scheduled sequence."""

from __future__ import annotations

import logging

import torch

from llm_service import attention
from llm_service.attention import AttentionBatch
from llm_service.block_manager import BlockManager
from llm_service.config import EngineConfig
from llm_service.kv_cache import allocate_pool, bytes_per_block, num_blocks_for
from llm_service.model import LanguageModel
from llm_service.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the tensors: the model, the KV pool, the per-step inputs (and CUDA graphs).

    `execute` packs the scheduled chunks into one `(1, T, hidden)` sequence with per-token
    positions from each request's plan (shaped for the decoder by the family's LM face), runs the `transformers` decoder once with an `AttentionBatch`
    as its mask (see `llm_service.attention`), and returns the logits of the last token of each
    sequence that has caught up with its tokens (the ones that sample this step).
    """

    def __init__(self, model: LanguageModel, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = model.device
        attention.register()
        decoder = model.modules.decoder
        decoder.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        text = model.text_config
        attn = decoder.layers[0].self_attn
        self.num_layers = len(decoder.layers)
        self.num_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        block_bytes = bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, config.block_size, model.dtype)
        self.num_blocks = num_blocks_for(config, block_bytes, self.device)
        self.kv_pool = allocate_pool(self.num_layers, self.num_blocks, config.block_size, self.num_kv_heads,
                                     self.head_dim, model.dtype, self.device)
        self.scratch_block = self.num_blocks
        self.backend = attention.choose_backend(self.device, model.dtype, config.block_size)
        self.windows = attention.sliding_windows(decoder)
        if self.windows and self.backend != "sdpa":
            raise ValueError(
                f"{type(decoder).__name__} has sliding-window attention layers (window {self.windows}) "
                f"but the {self.backend!r} attention backend cannot honor them; serve it in float32/float64 "
                "or on CPU (masked SDPA path)"
            )
        self.num_forwards = 0
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs and self.backend != "sdpa":
            from llm_service.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)

    def new_block_manager(self) -> BlockManager:
        return BlockManager(self.num_blocks, self.config.block_size)

    @torch.inference_mode()
    def execute(self, scheduled: tuple[ScheduledSeq, ...]) -> tuple[torch.Tensor, list[int]]:
        """Logits `(N, vocab)` and the indices into `scheduled` of the N sequences that sample."""
        sample_rows = [i for i, s in enumerate(scheduled) if s.seq.num_computed + s.num_tokens == s.seq.num_tokens]
        if self.graphs is not None and all(s.num_tokens == 1 for s in scheduled) and self.graphs.fits(len(scheduled)):
            logits = self.graphs.run(scheduled)
        else:
            embeds, positions, batch, last = self.prepare(scheduled)
            logits = self.forward(embeds, positions, batch, last[sample_rows])
        self.num_forwards += 1
        return logits, sample_rows

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                rows: torch.Tensor) -> torch.Tensor:
        """The one model forward: decoder over `(T, hidden)` at `(rows, T)` positions, lm_head on `rows`."""
        out = self.model.modules.decoder(
            inputs_embeds=embeds.unsqueeze(0),
            position_ids=self.model.face.position_ids(positions),
            paged_batch=batch,
            use_cache=False,
        )
        return self.model.modules.lm_head(out.last_hidden_state[0, rows])

    def prepare(self, scheduled: tuple[ScheduledSeq, ...]):
        bs = self.config.block_size
        ids: list[int] = []
        positions, slots, media = [], [], []
        q_lens, ctx_lens, slot_tables = [], [], []
        for seq, n in scheduled:
            start, end = seq.num_computed, seq.num_computed + n
            media += [(index + len(ids), parts) for index, parts in seq.chunk_media(start, end)]
            ids += seq.tokens[start:end]
            positions.append(seq.positions(start, end))
            table = torch.tensor(seq.block_table, dtype=torch.long)
            ctx_slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:end]
            slots.append(ctx_slots[start:end])
            slot_tables.append(ctx_slots)
            q_lens.append(n)
            ctx_lens.append(end)
        dev = self.device
        embeds = self.model.modules.decoder.embed_tokens(torch.tensor(ids, dtype=torch.long, device=dev))
        self.model.face.inject(embeds, media)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = torch.full((len(scheduled), max_blocks), self.scratch_block, dtype=torch.int32)
        for i, s in enumerate(scheduled):
            tables[i, :len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.int32)
        cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch = AttentionBatch(
            kv_pool=self.kv_pool,
            slot_mapping=torch.cat(slots).to(dev),
            cu_seqlens_q=cu_q.to(dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(q_lens),
            max_context_len=max(ctx_lens),
            backend=self.backend,
        )
        if self.backend == "sdpa":
            batch.gather_slots, batch.mask = attention.sdpa_metadata(q_lens, ctx_lens, slot_tables, dev)
            batch.window_masks = attention.sdpa_window_masks(q_lens, ctx_lens, self.windows, dev)
        last = (cu_q[1:] - 1).to(torch.long).to(dev)
        return embeds, torch.cat(positions, dim=1).to(dev), batch, last
