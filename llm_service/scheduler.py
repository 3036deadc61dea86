"""Continuous-batching scheduler: which sequences run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from llm_service.block_manager import BlockManager
from llm_service.config import EngineConfig
from llm_service.sequence import Sequence, Status
from llm_service.state_slots import StateSlotManager


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class PrefillAdder:
    """Admits waiting sequences into one step while the token budget and the KV pool allow (and,
    for models with recurrent state, a free state slot: a sequence is admitted with both or not
    at all).

    With prefix caching, a sequence starting from scratch first takes the cached blocks of its
    longest cached prompt prefix and is computed from there.
    """

    def __init__(self, token_budget: int, blocks: BlockManager, chunked: bool, batch_empty: bool,
                 prefix_caching: bool = False, slots: StateSlotManager | None = None):
        self.token_budget = token_budget
        self._blocks = blocks
        self._chunked = chunked
        self._batch_empty = batch_empty
        self._prefix_caching = prefix_caching
        self._slots = slots

    def try_add(self, seq: Sequence) -> ScheduledSeq | None:
        """The share of `seq` that fits (None: nothing does; stop admitting, FIFO)."""
        cached: list[int] = []
        if self._prefix_caching and not seq.block_table:
            cached = self._blocks.cached_prefix(seq.block_hashes(self._blocks.block_size))
        start = len(cached) * self._blocks.block_size if cached else seq.num_computed
        pending = seq.num_tokens - start
        if self._chunked:
            n = min(pending, self.token_budget)
        elif pending <= self.token_budget or self._batch_empty:
            n = pending  # without chunking, an over-budget prompt runs alone
        else:
            return None
        if n <= 0:
            return None
        needs_slot = self._slots is not None and seq.state_slot is None
        if needs_slot and not self._slots.can_allocate():
            return None
        if cached:
            if not self._blocks.can_allocate_after(cached, start + n):
                return None
            self._blocks.take_cached(seq.block_table, cached)
            seq.num_computed = start
        elif not self._blocks.can_allocate(seq.block_table, seq.num_computed + n):
            return None
        self._blocks.allocate(seq.block_table, seq.num_computed + n)
        if needs_slot:
            seq.state_slot = self._slots.allocate()
        self.token_budget -= n
        self._batch_empty = False
        return ScheduledSeq(seq, n)


class Scheduler:
    """Waiting and running queues over one `BlockManager` (and one `StateSlotManager` for models
    with recurrent state).

    Each step: every running sequence gets its pending tokens (1 for a decode, a chunk for a
    prefill in progress), oldest first; when the pool cannot hold them the youngest running
    sequence is preempted (blocks and state slot freed, recomputed later, first in line). Then
    waiting sequences are admitted FIFO while `max_num_seqs`, the token budget, the pool and the
    state slots allow. Invariant: a sequence holds a state slot exactly while it is running.
    """

    def __init__(self, config: EngineConfig, blocks: BlockManager, slots: StateSlotManager | None = None):
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_pending, budget) if self.config.enable_chunked_prefill else seq.num_pending
            if n <= 0 or (n > budget and scheduled):
                kept.append(seq)  # out of budget this step; stays running
                continue
            while not self.blocks.can_allocate(seq.block_table, seq.num_computed + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.allocate(seq.block_table, seq.num_computed + n)
            scheduled.append(ScheduledSeq(seq, n))
            kept.append(seq)
            budget -= n
        self.running = kept
        for victim in reversed(preempted):
            self.waiting.appendleft(victim)
        if not preempted:
            adder = PrefillAdder(budget, self.blocks, self.config.enable_chunked_prefill, not scheduled,
                                 self.config.enable_prefix_caching, self.slots)
            while self.waiting and len(self.running) < self.config.max_num_seqs and adder.token_budget > 0:
                item = adder.try_add(self.waiting[0])
                if item is None:
                    break
                seq = self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                scheduled.append(item)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is and free its KV blocks and state slot at once."""
        self._free(seq)
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
