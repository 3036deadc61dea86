"""State-slot bookkeeping (models with linear-attention layers), CPU only, no model: a slot is held
by exactly the running sequences, never shared, never leaked, across admission, chunked prefill,
preemption, abort and finish."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llm_service.config import EngineConfig
from llm_service.engine.scheduler import Scheduler
from llm_service.engine.sequence import LLMRequest, Sequence, Status
from llm_service.hybrid.state_slots import StateSlotManager
from llm_service.sampling import SamplingParams

BLOCK = 4


def _seq(i: int, prompt_len: int) -> Sequence:
    request = LLMRequest(f"r{i}", tuple(range(prompt_len)), SamplingParams(max_tokens=1000))
    return Sequence(request, lambda event: None, i)


def test_slot_manager_hands_out_each_slot_once_and_refuses_double_free():
    slots = StateSlotManager(3)
    held = [slots.allocate() for _ in range(3)]
    assert sorted(held) == [0, 1, 2] and not slots.can_allocate()
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(held[1])
    with pytest.raises(ValueError):
        slots.free(held[1])
    assert slots.allocate() == held[1] and slots.num_used_slots == 3


def test_a_waiting_sequence_needs_a_slot_as_well_as_blocks():
    scheduler = Scheduler(EngineConfig(block_size=BLOCK, max_num_batched_tokens=64, enable_prefix_caching=False),
                          64, 2)
    slots = scheduler.slots
    seqs = [_seq(i, 5) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    out = scheduler.schedule()
    assert [item.seq for item in out.scheduled] == seqs[:2]  # blocks for all three, slots for two
    assert seqs[2].state_slot is None and seqs[2].block_table == [] and seqs[2].status is Status.WAITING
    scheduler.finish(seqs[0])
    assert seqs[0].state_slot is None and slots.num_free_slots == 1
    for item in out.scheduled:
        item.seq.num_computed += item.num_tokens
    assert [item.seq for item in scheduler.schedule().scheduled][-1] is seqs[2]
    assert {s.state_slot for s in seqs[1:]} == {0, 1}


class SlotMachine(RuleBasedStateMachine):
    """Random admissions, steps (chunked prefills, decodes, preemptions), aborts and finishes."""

    @initialize(num_blocks=st.integers(4, 16), num_slots=st.integers(1, 4), budget=st.integers(1, 24),
                max_seqs=st.integers(1, 6))
    def setup(self, num_blocks, num_slots, budget, max_seqs):
        config = EngineConfig(block_size=BLOCK, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                              enable_prefix_caching=False)
        self.scheduler = Scheduler(config, num_blocks, num_slots)
        self.blocks, self.slots = self.scheduler.blocks, self.scheduler.slots
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.capacity = num_blocks * BLOCK
        self.count = 0

    @rule(prompt_len=st.integers(1, 40))
    def add(self, prompt_len):
        if prompt_len >= self.capacity:  # the engine rejects it before the scheduler sees it
            return
        seq = _seq(self.count, prompt_len)
        self.count += 1
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        out = self.scheduler.schedule()
        for seq in out.preempted:
            assert seq.state_slot is None and seq.num_computed == 0
        for item in out.scheduled:
            assert item.seq.state_slot is not None
            item.seq.num_computed += item.num_tokens
            if item.seq.num_computed == item.seq.num_tokens:  # caught up: one more token
                item.seq.tokens.append(0)
                if item.seq.num_tokens >= self.capacity:  # the engine ends it at the pool's size
                    self._end(item.seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        self._end(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: any(s.status is Status.RUNNING for s in self.live))
    @rule(data=st.data())
    def finish_running(self, data):
        self._end(data.draw(st.sampled_from([s for s in self.live if s.status is Status.RUNNING])))

    def _end(self, seq):
        self.scheduler.finish(seq)
        self.live.remove(seq)
        self.finished.append(seq)

    @invariant()
    def slots_are_held_by_exactly_the_running_sequences(self):
        if not hasattr(self, "scheduler"):
            return
        running = self.scheduler.running
        held = [s.state_slot for s in running]
        assert None not in held
        assert len(set(held)) == len(held) == self.slots.num_used_slots  # never shared
        assert self.slots.num_used_slots + self.slots.num_free_slots == self.slots.num_slots  # never leaked
        for seq in list(self.scheduler.waiting) + self.finished:
            assert seq.state_slot is None
        assert all(s.status is Status.RUNNING for s in running)
        assert sum(len(s.block_table) for s in self.live) == self.blocks.num_used_blocks

    def teardown(self):
        if hasattr(self, "scheduler"):
            for seq in list(self.live):
                self._end(seq)
            assert self.slots.num_free_slots == self.slots.num_slots
            assert self.blocks.num_free_blocks == self.blocks.num_blocks


SlotMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_slot_bookkeeping = SlotMachine.TestCase
