"""Continuous-batching scheduler: which sequences run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llm_service.config import EngineConfig
from llm_service.engine.block_manager import BlockManager
from llm_service.engine.sequence import Sequence, Status
from llm_service.hybrid.state_slots import StateSlotManager
from llm_service.hybrid.state_snapshots import SnapshotManager


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
    longest cached prompt prefix and is computed from there. A model with recurrent state (its
    `snapshots` given) takes them only up to the deepest block whose prefix has a state snapshot,
    and its slot starts from that snapshot (`Sequence.resume_snapshot`); its prefill chunks stop
    at the sequence's snapshot points (`Sequence.next_stop`), so that the state exists there.
    """

    def __init__(self, token_budget: int, blocks: BlockManager, chunked: bool, batch_empty: bool,
                 prefix_caching: bool = False, slots: StateSlotManager | None = None,
                 snapshots: SnapshotManager | None = None):
        self.token_budget, self._blocks, self._chunked, self._batch_empty = token_budget, blocks, chunked, batch_empty
        self._prefix_caching = prefix_caching and (slots is None or snapshots is not None)
        self._slots, self._snapshots = slots, snapshots

    def try_add(self, seq: Sequence) -> ScheduledSeq | None:
        """The share of `seq` that fits (None: nothing does; stop admitting, FIFO)."""
        bs = self._blocks.block_size
        cached: list[int] = []
        if self._prefix_caching and not seq.block_table:
            hashes = seq.block_hashes(bs)
            cached = self._blocks.cached_prefix(hashes)
            if seq.ready is not None:  # leave the first chunk something to compute
                cached = cached[:(seq.ready_end - 1) // bs]
            if self._snapshots is not None:  # K/V alone cannot resume the recurrent state (cut last:
                cached = cached[:self._snapshots.deepest(hashes[:len(cached)])]  # it must end on a snapshot)
        start = len(cached) * bs if cached else seq.num_computed
        pending = chunk_end(seq, start, bs, self._snapshots) - start
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
            if self._snapshots is not None:
                seq.resume_snapshot = self._snapshots.resume(seq.block_hashes(bs)[len(cached) - 1])
        elif not self._blocks.can_allocate(seq.block_table, seq.num_computed + n):
            return None
        self._blocks.allocate(seq.block_table, seq.num_computed + n)
        if needs_slot:
            seq.state_slot = self._slots.allocate()
        self.token_budget -= n
        self._batch_empty = False
        return ScheduledSeq(seq, n)


def chunk_end(seq: Sequence, start: int, block_size: int, snapshots: SnapshotManager | None) -> int:
    """Where a chunk starting at `start` may end: the end of the tokens, or with state snapshots
    the sequence's next snapshot point; never past the tokens whose inputs are present."""
    end = seq.next_stop(start, block_size) if snapshots is not None else seq.num_tokens
    return min(end, seq.ready_end)


class Scheduler:
    """Waiting and running queues, and the bookkeeping of the pools the model runner holds (ids
    only): the KV blocks of `num_blocks` (`blocks`), for models with recurrent state its
    `num_slots` state slots (`slots`) and, with prefix caching, its `num_snapshots` state snapshot
    rows after them (`snapshots`: dropped with the KV block their prefix ends at).

    Each step: every running sequence gets its pending tokens (1 for a decode, a chunk for a
    prefill in progress, none while it waits for media rows), oldest first; when the pool cannot
    hold them the youngest running sequence is preempted (recomputed later, first in line). Then
    waiting sequences are admitted FIFO while `max_num_seqs`, the token budget, the pool and the
    state slots allow. Invariant: a sequence holds a state slot exactly while it is running.

    Once a step is launched, `computed` advances its sequences, offers their full prompt blocks
    to the prefix cache and says which slots to copy into snapshot rows (`take_snapshots`).
    """

    def __init__(self, config: EngineConfig, num_blocks: int, num_slots: int = 0, num_snapshots: int = 0,
                 release: Callable[[Sequence], None] | None = None):
        self.config = config
        self.release = release  # told when a sequence stops running (the runner's batch row goes back)
        self.slots = StateSlotManager(num_slots) if num_slots else None
        self.snapshots = (SnapshotManager(num_snapshots, first_row=num_slots)
                          if num_snapshots and config.enable_prefix_caching else None)
        self.blocks = BlockManager(num_blocks, config.block_size, self.snapshots.drop if self.snapshots else None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether a step would compute anything (sequences waiting for media rows would not)."""
        return any(seq.runnable for seq in self.waiting) or any(seq.runnable for seq in self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted, kept, queue = [], [], list(self.running)
        while queue:
            seq = queue.pop(0)
            pending = chunk_end(seq, seq.num_computed, self.blocks.block_size, self.snapshots) - seq.num_computed
            n = min(pending, budget) if self.config.enable_chunked_prefill else pending
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
                                 self.config.enable_prefix_caching, self.slots, self.snapshots)
            for seq in list(self.waiting):  # FIFO; a sequence still waiting for media rows is passed over
                if len(self.running) >= self.config.max_num_seqs or adder.token_budget <= 0:
                    break
                if not seq.runnable:
                    continue
                item = adder.try_add(seq)
                if item is None:
                    break
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                scheduled.append(item)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def computed(self, scheduled: tuple[ScheduledSeq, ...]) -> list[tuple[int, int]]:
        """The step's tokens are computed (its forward launched): the full prompt blocks they
        complete are offered to later requests (prefix caching), `num_computed` advances; returns
        `take_snapshots`' copies."""
        bs = self.blocks.block_size
        for seq, n in scheduled:
            if self.config.enable_prefix_caching:
                hashes = seq.block_hashes(bs)
                for i in range(seq.num_computed // bs, min((seq.num_computed + n) // bs, len(hashes))):
                    self.blocks.register(seq.block_table[i], hashes[i])
            seq.num_computed += n
            seq.resume_snapshot = None  # restored by this forward
        return self.take_snapshots(scheduled)

    def take_snapshots(self, scheduled: tuple[ScheduledSeq, ...]) -> list[tuple[int, int]]:
        """After a step (its blocks registered, `num_computed` advanced): `(slot, snapshot row)`
        copies that keep the state of every sequence that stopped at one of its snapshot points
        whose prefix has none yet (rows distinct: a row reused within the step goes to the last)."""
        if self.snapshots is None:
            return []
        bs = self.blocks.block_size
        copies: dict[int, int] = {}
        for seq, _ in scheduled:
            if seq.num_computed in seq.snapshot_points(bs):
                prefix = seq.block_hashes(bs)[seq.num_computed // bs - 1]
                if self.blocks.is_cached(prefix) and (row := self.snapshots.save(prefix)) is not None:
                    copies[row] = seq.state_slot
        return [(slot, row) for row, slot in copies.items()]

    def _free(self, seq: Sequence) -> None:
        if self.release is not None:
            self.release(seq)
        self.blocks.free(seq.block_table)
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
        seq.resume_snapshot = seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
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
