"""Per-row device state of the running sequences: what a step's inputs and its sampler read from
the device instead of rebuilding it from Python lists every step.

A sequence holds one row while it runs (`Sequence.batch_row`, like a state slot): from its first
scheduled step until it finishes or is preempted. The row keeps its last sampled token (the next
decode's input id: with overlapped steps the host learns it a step late), its sampling settings
(written once, when the row is taken), and for models serving requests with penalties, counts of
its output tokens and which tokens its prompt or output holds (updated on the device from each
sampled id). For decode steps it also keeps its block table (entries written as blocks are
added), how many of its tokens are computed and the positions of the next one: a decode step's
inputs are gathered from the rows on the device (`decode_inputs`) and the rows advanced there,
so the host sends only the rows' indices and new block-table entries. A step computed from
packed host inputs (prefill chunks) writes its rows' counts and positions back (`write_back`).
A row, like a KV block or a state slot, can be given back while a step that uses it is still
running on the device: every later write to it is enqueued on the same stream after that
step's, so it is never reused early.
"""

from __future__ import annotations

import torch

from llm_service.model.transfer import ints, to_device
from llm_service.sampling import SamplingRows, needs_settings, sampling_rows, settings_columns


class BatchState:
    """The rows' device tensors and which rows are free (ids only, like `StateSlotManager`).

    Attributes:
        num_rows: rows (the engine's `max_num_seqs`: a sequence holds one while running); one more
            row, `pad_row`, is what padding rows of a decode graph read (its table: the scratch block).
        last_token: `(num_rows + 1,)` int64, each row's last sampled token.
        block_tables: `(num_rows + 1, width)` int32, each row's KV block ids (`width` blocks: the
            longest context); `computed` `(num_rows + 1,)` int32 its tokens with K/V in the pool;
            `next_positions` `(num_rows + 1, position rows)` int64 the positions of its next token.
        settings: `(num_rows, 7)` float64, each row's sampling settings (`settings_columns`).
        output_counts: `(num_rows, vocab)` int32, each row's output-token counts; None until a
            request with penalties is admitted (then kept for every row).
        seen: `(num_rows, vocab)` bool, tokens each row's prompt or output holds (with the counts).
    """

    def __init__(self, num_rows: int, vocab: int, device: torch.device, width: int = 1, position_rows: int = 1,
                 block_size: int = 16, scratch_block: int = 0):
        self.num_rows, self.vocab, self.device, self.block_size = num_rows, vocab, device, block_size
        self.pad_row = num_rows
        self.last_token = torch.zeros(num_rows + 1, dtype=torch.long, device=device)
        self.block_tables = torch.full((num_rows + 1, width), scratch_block, dtype=torch.int32, device=device)
        self.computed = torch.zeros(num_rows + 1, dtype=torch.int32, device=device)
        self.next_positions = torch.zeros(num_rows + 1, position_rows, dtype=torch.long, device=device)
        self._written = [0] * num_rows  # block-table entries written, per row
        self.settings = torch.zeros(num_rows, 7, dtype=torch.float64, device=device)
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest row first

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def admit(self, seq) -> None:
        """Give `seq` a row and write its settings (and its counts, when penalties are on):
        `seq.tokens` must hold all its tokens (a sequence re-admitted after preemption has read
        every token it sampled before it runs again)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_rows} batch rows are held")
        row = seq.batch_row = self._free.pop()
        self._written[row] = 0
        params = seq.request.sampling
        self.settings[row] = to_device(torch.tensor(settings_columns([params])[0], dtype=torch.float64), self.device)
        if params.has_penalties and self.output_counts is None:
            self.output_counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.num_rows, self.vocab, dtype=torch.bool, device=self.device)
        if self.output_counts is not None:
            self.output_counts[row] = 0
            self.seen[row] = False
            self.seen[row, ints(seq.request.prompt_token_ids, self.device)] = True
            if generated := seq.generated:
                out = ints(generated, self.device)
                self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
                self.seen[row, out] = True
        if seq.tokens:
            self.last_token[row] = seq.tokens[-1]  # a scalar fill: no copy

    def release(self, seq) -> None:
        """Give `seq`'s row back (none held: nothing to do)."""
        if seq.batch_row is not None:
            self._free.append(seq.batch_row)
            seq.batch_row = None

    def index(self, seqs) -> torch.Tensor:
        return ints([s.batch_row for s in seqs], self.device)

    def sampling_rows(self, seqs, index: torch.Tensor, dtype: torch.dtype) -> SamplingRows:
        """The settings (and penalty tensors) of `seqs`, whose rows are `index`, gathered on the device."""
        params = [s.request.sampling for s in seqs]
        counts = seen = settings = None
        if self.output_counts is not None and any(p.has_penalties for p in params):
            counts, seen = self.output_counts[index], self.seen[index]
        if needs_settings(params):
            settings = self.settings[index].to(dtype)
        return sampling_rows(params, [s.generator for s in seqs], settings, counts, seen)

    def _stage(self, values: list[int], seqs) -> torch.Tensor:
        """`values` on the device, in one host-to-device copy with the block-table entries of
        `seqs` not written yet, which are written."""
        rows, cols, blocks = [], [], []
        for seq in seqs:
            row, table, written = seq.batch_row, seq.block_table, self._written[seq.batch_row]
            rows += [row] * (len(table) - written)
            cols += range(written, len(table))
            blocks += table[written:]
            self._written[row] = len(table)
        staged = ints(values + rows + cols + blocks, self.device)
        if rows:
            at = staged[len(values):].view(3, -1)
            self.block_tables[at[0], at[1]] = at[2].to(torch.int32)
        return staged[:len(values)]

    def stage_decode(self, seqs, padded: int | None = None) -> torch.Tensor:
        """The rows of a decode step of `seqs` as a device index (padded with `pad_row` to
        `padded`), their new block-table entries written first: one host-to-device copy."""
        index = [s.batch_row for s in seqs]
        return self._stage(index + [self.pad_row] * ((padded or len(index)) - len(index)), seqs)

    def decode_inputs(self, index: torch.Tensor):
        """(ids, positions `(rows, B)`, pool slots, context lengths, block tables) of a decode step
        of rows `index`, gathered on the device."""
        computed, tables, bs = self.computed[index], self.block_tables[index], self.block_size
        block = tables.gather(1, (computed // bs).long().unsqueeze(1)).squeeze(1)
        slots = block.long() * bs + (computed % bs).long()
        return self.last_token[index], self.next_positions[index].T, slots, computed + 1, tables

    def advance(self, index: torch.Tensor) -> None:
        """Rows `index` computed one more token (a decode step)."""
        self.computed[index] += 1
        self.next_positions[index] += 1

    def write_back(self, scheduled) -> None:
        """With a step of packed host inputs: each scheduled row's computed count after it and
        the positions of its next token, from the host (and its new block-table entries)."""
        rows, counts, positions = [], [], []
        for seq, n in scheduled:
            k = seq.num_computed + n
            rows.append(seq.batch_row)
            counts.append(k)
            positions += seq.positions(k, k + 1)[:, 0].tolist()
        staged = self._stage(rows + counts + positions, [s.seq for s in scheduled])
        n = len(rows)
        self.computed[staged[:n]] = staged[n:2 * n].to(torch.int32)
        self.next_positions[staged[:n]] = staged[2 * n:].view(n, -1)

    def record(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows `index` sampled `tokens` (on the device): the next decode's ids, the counts."""
        self.last_token[index] = tokens
        if self.output_counts is not None:
            self.output_counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
            # a device tensor, not `= True`: a Python scalar is copied from the host, which waits
            self.seen.index_put_((index, tokens), torch.ones_like(tokens, dtype=torch.bool))
