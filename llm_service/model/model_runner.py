"""Runs one engine step: a single packed forward of the decoder over every scheduled sequence."""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import torch

from llm_service.config import EngineConfig
from llm_service.engine.scheduler import ScheduledSeq
from llm_service.hybrid.state_cache import StateBatch, StatePool, resolve_config, slot_bytes
from llm_service.model import attention, experts, layers, lora
from llm_service.model.attention import AttentionBatch
from llm_service.model.batch_state import BatchState
from llm_service.model.kv_cache import allocate_pool, bytes_per_block, check_holds_a_sequence, pool_sizes
from llm_service.model.language_model import LanguageModel
from llm_service.model.transfer import ints, to_device
from mmserve.checkpoint import resolve_max_model_len

logger = logging.getLogger(__name__)


class StepInputs(NamedTuple):
    """One step ready to launch: `sample_rows` index `scheduled` (the sequences that sample);
    a decode from the rows' device state (`decode_index`, padded to `graph_batch` when a
    captured graph replays it) or the packed inputs of an eager forward (`ModelRunner._pack`)."""

    scheduled: tuple[ScheduledSeq, ...]
    sample_rows: list[int]
    graph_batch: int | None
    packed: tuple | None = None
    host: PackedStep | None = None  # a tensor-parallel step: what the other ranks are sent
    decode_index: torch.Tensor | None = None  # a decode from the rows' device state: their rows
    max_context: int = 0  # its longest context (SDPA's key length)
    lora: tuple = ()  # its LoRA adapters' token rows (`lora.token_groups`)


class StateOps(NamedTuple):
    """A packed step's state slots: `fresh` ones zeroed, `resumed` `(snapshot row, slot)` pairs
    restored, then `slots` (one per sequence) run."""

    fresh: list[int]
    resumed: list[tuple[int, int]]
    slots: list[int]


class PackedStep(NamedTuple):
    """An eager step's inputs on the host (`ModelRunner._pack_host`): what rank 0 sends to the
    other ranks of a tensor-parallel replica, and each rank moves to its device (`_on_device`)."""

    ids: list[int]
    unread_at: list[int]  # packed indices whose id is a row's last sampled token (on the device)
    unread_rows: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]
    tables: torch.Tensor
    slot_tables: list[torch.Tensor]  # SDPA only
    sample_rows: list[int]
    media: list
    states: StateOps | None


class ModelRunner:
    """Owns the tensors: the model, the KV pool, the state pool, the per-step inputs (and CUDA graphs).

    `prepare` packs the scheduled chunks into one `(1, T, hidden)` sequence with per-token
    positions from each request's plan; `run` runs the decoder once with an `AttentionBatch` (and,
    for a model with linear-attention layers, a `StateBatch`) and returns the logits of each
    sequence that samples this step. `config` is the engine config as this model runs it
    (`state_cache.resolve_config`); `loras`: the LoRA adapters loaded (`llm_service.model.lora`).
    With prefix caching, the state pool also holds the state snapshots: restored into slots by
    `prepare`, saved by `save_snapshots`.
    """

    def __init__(self, model: LanguageModel, config: EngineConfig):
        self.model = model
        self.tp = model.tp  # None unless this replica's decoder is split over ranks
        # a tensor-parallel step failed between its message and its last collective: the ranks
        # are out of step and the group cannot run another
        self.tp_broken = False
        self.state_specs = model.state_layers()
        self.device = model.device
        decoder = model.modules.decoder
        attention.install(decoder)
        text = model.text_config
        self.num_layers = len(decoder.layers)
        state_layers = {s.layer_idx for s in self.state_specs}
        attention_layers = [i for i in range(self.num_layers) if i not in state_layers]  # the KV pool's layers
        self.kv_layers = tuple(attention_layers.index(i) if i not in state_layers else None
                               for i in range(self.num_layers)) if state_layers else ()
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = int(decoder.layers[attention_layers[0]].self_attn.head_dim)
        self.backend = attention.choose_backend(config.attention_backend, self.device, model.dtype, self.head_dim)
        block_bytes = bytes_per_block(len(attention_layers), self.num_kv_heads, self.head_dim, config.block_size,
                                      model.dtype)
        self.num_blocks, self.num_slots, self.num_snapshots = pool_sizes(
            config, block_bytes, slot_bytes(self.state_specs, model.dtype), self.device)
        if self.tp is not None:  # every rank the same pools: what the fullest device holds
            self.num_blocks, self.num_slots, self.num_snapshots = self.tp.agree_min(
                (self.num_blocks, self.num_slots, self.num_snapshots))
        self.max_model_len = resolve_max_model_len(text, config.max_model_len)
        if config.num_kv_blocks is None:  # tests' tiny pools are taken as given
            check_holds_a_sequence(self.num_blocks, config.block_size, self.max_model_len)
        self.config = config = resolve_config(config, self.state_specs, self.num_snapshots)
        self.kv_pool = allocate_pool(len(attention_layers), self.num_blocks, config.block_size, self.num_kv_heads,
                                     self.head_dim, model.dtype, self.device)
        self.states = StatePool(self.state_specs, self.num_slots, model.dtype, self.device,
                                self.num_snapshots) if self.num_slots else None
        self.scratch_block = self.num_blocks
        self.windows = attention.layer_windows(text, self.num_layers)
        self.position_rows = model.face.text_positions().positions(0, 1).shape[0]  # the family's, for graph buffers
        logger.info("attention backend %s, block size %d, sliding windows %s", self.backend, config.block_size,
                    sorted({w for w in self.windows if w}) or "none")
        width = -(-self.max_model_len // config.block_size)
        self.batch = BatchState(config.max_num_seqs, model.vocab_size, self.device, width, self.position_rows,
                                config.block_size, self.scratch_block)
        # decode steps from the rows' device state (not with recurrent state, whose slots the
        # packed path handles): the graphs' path too
        # (nor under tensor parallelism: every step is a packed one, sent to the other ranks)
        self.device_decode = self.states is None and self.tp is None
        self.arange = torch.arange(config.max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.num_forwards = 0
        self.loras = None
        if config.max_loras:
            if self.tp is not None:
                raise ValueError("engine.max_loras: LoRA adapters are not supported with tensor parallelism")
            # by slot where the attention is Triton's (CUDA, or its interpreter): the decode graphs capture them
            self.loras = lora.LoraSet(decoder, model.face.rename, config.max_loras, model.dtype, self.device,
                                      config.max_lora_rank, kernels=self.backend == "triton",
                                      max_tokens=max(config.max_num_batched_tokens, config.max_graph_batch_size,
                                                     config.max_num_seqs))
        # the engine's experts path in every MoE layer (the fused kernel where the graphs' Triton
        # attention runs), before any graph captures them
        cuda_triton = self.device.type == "cuda" and self.backend == "triton"
        self.expert_load = experts.ExpertLoad(experts.install(decoder, triton=cuda_triton))
        # the decoder's RMSNorms and SiLU MLPs in fewer kernels, before any graph captures them
        # (the engine's own decoder has them; a `transformers` one is patched)
        self.fused_ops = {}
        if self.device.type == "cuda" and config.fused_ops and self.backend == "triton":
            from llm_service.model.fused_ops import fuse_decoder

            self.fused_ops = decoder.use_kernels() if isinstance(decoder, layers.Decoder) else fuse_decoder(decoder)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs and self.backend == "triton" and self.tp is None:
            from llm_service.model.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self)

    @property
    def group_broken(self) -> bool:
        """A tensor-parallel step failed midway or a collective failed: the ranks are out of step."""
        return self.tp is not None and (self.tp_broken or self.tp.broken)

    def _kv_splits(self, num_seqs: int, max_query_len: int, max_context_len: int) -> int:
        """Key slices of a step's attention, once per step: split-K only for all-decode steps on the
        Triton kernel (`mmserve.kernels.triton_attention.decode_splits`)."""
        if self.backend != "triton" or not self.config.split_kv_decode or max_query_len != 1:
            return 1
        from mmserve.kernels.triton_attention import decode_splits

        return decode_splits(num_seqs, self.num_kv_heads, max_context_len, self.device)

    @torch.inference_mode()
    def save_snapshots(self, copies: list[tuple[int, int]]) -> None:
        """Copy each `(slot, snapshot row)` of `copies` (rows distinct)."""
        if copies and self.tp is not None and self.tp.rank == 0:
            self.tp.broadcast(("snapshots", copies))
        if copies:
            src, dst = zip(*copies)
            self.states.copy(self._index(src), self._index(dst))

    def _index(self, ids) -> torch.Tensor:
        return ints(list(ids), self.device)

    @torch.inference_mode()
    def prepare(self, scheduled: tuple[ScheduledSeq, ...]) -> StepInputs:
        """The step's inputs on the device (rows taken for sequences new to the batch)."""
        for s in scheduled:
            if s.seq.batch_row is None:
                self.batch.admit(s.seq)
        sample_rows = [i for i, s in enumerate(scheduled) if s.seq.num_computed + s.num_tokens == s.seq.num_tokens]
        adapters = [s.seq.request.lora and s.seq.request.lora.name for s in scheduled]
        if self.device_decode and self._decodes_only(scheduled):
            seqs = [s.seq for s in scheduled]
            groups = lora.token_groups(adapters, [1] * len(seqs), self.device)
            graphs = self.graphs is not None and (not groups or self.loras.kernels)
            padded = self.graphs.padded_size(len(seqs)) if graphs else None
            return StepInputs(scheduled, sample_rows, padded, decode_index=self.batch.stage_decode(seqs, padded),
                              max_context=max(s.num_computed for s in seqs) + 1, lora=groups)
        host = self._pack_host(scheduled, sample_rows)
        groups = lora.token_groups(adapters, [s.num_tokens for s in scheduled], self.device)
        return StepInputs(scheduled, sample_rows, None, self._on_device(host), host=host if self.tp else None,
                          lora=groups)

    def _decodes_only(self, scheduled: tuple[ScheduledSeq, ...]) -> bool:
        """Every sequence decodes one token past its prompt (its row's device state is current:
        a packed step wrote it back), within the rows' block tables."""
        width = self.batch.block_tables.shape[1]
        return all(n == 1 and s.num_computed >= s.num_prompt_tokens and len(s.block_table) <= width
                   for s, n in scheduled)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """Launch the step's forward (a graph replay for a staged decode): logits `(N, vocab)` of
        its sampling rows."""
        with self.loras.step(step.lora) if step.lora else contextlib.nullcontext():
            return self._run(step)

    def _run(self, step: StepInputs) -> torch.Tensor:
        if step.decode_index is not None:
            b = len(step.scheduled)
            if step.graph_batch is not None:
                logits = self.graphs.replay(step.graph_batch, b, step.decode_index)
            else:
                logits = self.decode_forward(step.decode_index, step.max_context)
            self.batch.advance(step.decode_index[:b])
        else:
            if self.tp is not None:
                self.tp_broken = True  # until this step's collectives are through on rank 0
                self.tp.broadcast(("step", step.host))
            logits = self._packed_forward(step.packed)
            self.tp_broken = False
            if self.device_decode:
                self.batch.write_back(step.scheduled)
        self.num_forwards += 1
        return logits

    def _packed_forward(self, packed: tuple) -> torch.Tensor | None:
        ids, positions, batch, rows, media, extra = packed
        embeds = self.model.modules.decoder.embed_tokens(ids)
        extra = {**extra, **self.model.face.inject(embeds, media)}
        return self.forward(embeds, positions, batch, rows, **extra)

    @torch.inference_mode()
    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run the steps rank 0 sends (its shard of each
        forward) until it stops the group."""
        while True:
            kind, body = self.tp.broadcast()
            if kind == "step":
                self._packed_forward(self._on_device(body))
                self.num_forwards += 1
            elif kind == "snapshots":
                self.save_snapshots(body)
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel message {kind!r}")

    def stop_ranks(self) -> None:
        """Rank 0: the other ranks leave `follow` (the group ends)."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.broadcast(("stop", None))

    def decode_forward(self, index: torch.Tensor, max_context: int | None = None) -> torch.Tensor:
        """Logits of one decode step of rows `index` (padding rows included), its inputs gathered
        from the rows' device state: what a decode graph captures (the Triton kernel); SDPA
        needs the longest context of the step, `max_context`."""
        ids, positions, slots, context_lens, tables = self.batch.decode_inputs(index)
        b, context = index.shape[0], max_context or self.max_model_len
        batch = AttentionBatch(self.kv_pool, slots, self.arange[:b + 1], context_lens, tables, 1, context, self.backend,
                               self._kv_splits(b, 1, context), self.windows)
        if self.backend == "sdpa":
            batch.decode_slots, batch.masks = attention.sdpa_decode_metadata(
                tables, context_lens, max_context, self.config.block_size, self.windows or (None,))
        embeds = self.model.modules.decoder.embed_tokens(ids)
        return self.forward(embeds, positions, batch, self.arange[:b])

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                rows: torch.Tensor, **extra) -> torch.Tensor | None:
        """The one model forward: decoder over `(T, hidden)` at `(rows, T)` positions, lm_head on
        `rows`; `extra`: the decoder keyword arguments the LM face's `inject` returned."""
        position_ids = self.model.face.position_ids(positions)
        out = self.model.modules.decoder(inputs_embeds=embeds.unsqueeze(0), position_ids=position_ids,
                                         paged_batch=batch, use_cache=False, **extra)
        logits = self.model.modules.lm_head(out.last_hidden_state[0, rows])
        if self.tp is not None:  # each rank's vocabulary slice, whole on rank 0 (None elsewhere)
            return self.tp.gather_vocab(logits, self.model.vocab_size)
        return logits

    def _pack_host(self, scheduled: tuple[ScheduledSeq, ...], sample_rows: list[int]) -> PackedStep:
        """The scheduled chunks packed into one sequence, on the host: what every rank needs. A
        row's last sampled token the host has not read yet (a decode right after the step that
        sampled it) is a placeholder id at `unread_at`, taken from its batch row on the device."""
        bs = self.config.block_size
        ids, unread_at, unread_rows, positions, slots, media = [], [], [], [], [], []
        q_lens, ctx_lens, slot_tables = [], [], []
        width = max(len(s.seq.block_table) for s in scheduled)
        tables = torch.full((len(scheduled), width), self.scratch_block, dtype=torch.int32)
        for i, (seq, n) in enumerate(scheduled):
            start, end, known = seq.num_computed, seq.num_computed + n, len(seq.tokens)
            media += [(index + len(ids), parts) for index, parts in seq.chunk_media(start, end)]
            ids += seq.tokens[start:min(end, known)]
            if end > known:
                if end - max(start, known) != 1 or seq.batch_row is None:
                    raise RuntimeError(f"sequence {seq.request_id} runs {end - known} tokens the host has not read")
                unread_at.append(len(ids))
                unread_rows.append(seq.batch_row)
                ids.append(0)
            positions.append(seq.positions(start, end))
            table = torch.tensor(seq.block_table, dtype=torch.long)
            tables[i, :len(table)] = table
            ctx_slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:end]
            slots.append(ctx_slots[start:end])
            slot_tables.append(ctx_slots)
            q_lens.append(n)
            ctx_lens.append(end)
        if unread_at and self.tp is not None:
            raise RuntimeError("a tensor-parallel step needs every input id on the host (no overlapped steps)")
        states = None
        if self.states is not None:
            if any(s.seq.state_slot is None for s in scheduled):
                raise RuntimeError("a scheduled sequence holds no state slot")
            states = StateOps(fresh=[s.seq.state_slot for s in scheduled if s.seq.num_computed == 0],
                              resumed=[(s.seq.resume_snapshot, s.seq.state_slot) for s in scheduled
                                       if s.seq.resume_snapshot is not None],
                              slots=[s.seq.state_slot for s in scheduled])
        if self.tp is not None:  # sent to the other ranks: media on the host
            media = [(index, tuple(p.cpu() for p in parts)) for index, parts in media]
        return PackedStep(ids, unread_at, unread_rows, torch.cat(positions, dim=1), torch.cat(slots), q_lens,
                          ctx_lens, tables, slot_tables if self.backend == "sdpa" else [], sample_rows, media, states)

    def _on_device(self, p: PackedStep):
        """(ids, positions, `AttentionBatch`, sampling rows, media, decoder keyword arguments) of a
        packed step on this rank's device; state slots reset / restored as it asks."""
        dev = self.device
        extra = {}
        cu_q = torch.tensor([0] + p.q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        max_q, max_ctx = max(p.q_lens), max(p.ctx_lens)
        splits = self._kv_splits(len(p.q_lens), max_q, max_ctx)
        batch = AttentionBatch(self.kv_pool, to_device(p.slots, dev), to_device(cu_q, dev),
                               ints(p.ctx_lens, dev, torch.int32), to_device(p.tables, dev), max_q, max_ctx,
                               self.backend, splits, self.windows, self.kv_layers)
        if p.states is not None:
            extra["state_batch"] = self._state_batch(p.states, p.q_lens)
        if self.backend == "sdpa":
            batch.gather_slots, batch.masks = attention.sdpa_metadata(p.q_lens, p.ctx_lens, p.slot_tables, dev,
                                                                      self.windows)
        rows = to_device((cu_q[1:] - 1).to(torch.long)[p.sample_rows], dev)
        ids = ints(p.ids, dev)  # an unread id: its row's last sampled token, on the device
        if p.unread_at:
            ids[self._index(p.unread_at)] = self.batch.last_token[self._index(p.unread_rows)]
        return ids, to_device(p.positions, dev), batch, rows, p.media, extra

    def _state_batch(self, ops: StateOps, q_lens: list[int]) -> StateBatch:
        """The step's state slots; those of sequences starting from their first token are zeroed,
        those of sequences resuming from a cached prefix take its snapshot."""
        if ops.fresh:
            self.states.reset(self._index(ops.fresh))
        if ops.resumed:
            src, dst = zip(*ops.resumed)
            self.states.copy(self._index(src), self._index(dst))
        return StateBatch(self.states, self._index(ops.slots), tuple(q_lens))


def rank_main(rank: int, size: int, init_method: str, model_dir: str, dtype: str, device: str,
              config: EngineConfig, timeout_s: float | None = None) -> dict:
    """A tensor-parallel rank worker (rank >= 1): join the group, load this rank's shard, follow
    rank 0's steps until it stops the group; returns the group's collective counts."""
    from llm_service.model.tensor_parallel import DEFAULT_TIMEOUT_S, TPGroup

    group = TPGroup(rank, size, init_method, torch.device(device), timeout_s=timeout_s or DEFAULT_TIMEOUT_S)
    try:
        ModelRunner(LanguageModel(model_dir, dtype=dtype, device=device, tp=group), config).follow()
        return dict(group.counts)
    finally:
        group.close()
