"""State-snapshot bookkeeping (prefix caching of models with linear-attention layers), CPU only, no
model: the scheduler, block manager, slot and snapshot managers as the engine drives them, with
each state row simulated by the prompt prefix it has folded in. A snapshot holds exactly the
state of its prefix (never one of a diverging prefix: other tokens, or the same tokens of another
image), never outlives the KV block its prefix ends at, and no row leaks, across admission,
resume, chunked prefill, preemption, abort, finish and eviction."""

import dataclasses

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llm_service.config import EngineConfig
from llm_service.engine.scheduler import Scheduler
from llm_service.engine.sequence import LLMRequest, Sequence, Status
from llm_service.hybrid.state_snapshots import SnapshotManager
from llm_service.sampling import SamplingParams
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import PlaceholderRange

BLOCK = 4
SYSTEMS = ((), (7, 7, 8, 9, 7), (7, 7, 8, 9, 7, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13))
IMAGE_LEN = 6
IMAGE_TOKEN = 99


def _request(i: int, system: tuple[int, ...], image: str | None, question: tuple[int, ...]) -> LLMRequest:
    ids, media = list(system), ()
    if image is not None:
        rng = PlaceholderRange(len(ids), IMAGE_LEN)
        media = ((rng, ItemEmbedding((torch.zeros(IMAGE_LEN, 1),), key=image)),)
        ids += [IMAGE_TOKEN] * IMAGE_LEN
    ids += question
    return LLMRequest(f"r{i}", tuple(ids), SamplingParams(max_tokens=1000), media=media,
                      snapshot_boundaries=(len(system),) if system else ())


def _identity(seq: Sequence) -> list[tuple]:
    """What each token contributes to the state: its id and, for image tokens, which image row."""
    out = [(t, None) for t in seq.tokens]
    for rng, emb in seq.request.media:
        for j in range(rng.length):
            out[rng.offset + j] = (seq.tokens[rng.offset + j], emb.key, j)
    return out


def test_snapshot_manager_is_an_lru_of_rows_dropped_with_their_blocks():
    snaps = SnapshotManager(2, first_row=5)
    assert snaps.save(10) == 5 and snaps.save(11) == 6 and snaps.save(10) is None  # 10 used again
    assert snaps.save(12) == 6  # full: 11 was the least recently used
    assert snaps.row_of(11) is None and snaps.deepest([10, 11, 12]) == 3 and snaps.deepest([11]) == 0
    assert snaps.resume(10) == 5 and snaps.num_resumed == 1
    snaps.drop(12)
    snaps.drop(12)  # a block without a snapshot (or one already dropped): nothing to do
    assert snaps.num_used == 1 and snaps.num_free == 1 and snaps.deepest([10, 11, 12]) == 1


def test_snapshot_points_are_block_boundaries_of_the_system_prompt_media_and_prompt_end():
    seq = Sequence(_request(0, SYSTEMS[2], "x", (1, 2, 3, 4, 5)), lambda e: None, 0)  # 9 + 6 + 5 = 20 tokens
    assert len(seq.block_hashes(BLOCK)) == 4  # the last prompt token is never cached
    assert seq.snapshot_points(BLOCK) == (8, 12, 16)  # system ends at 9, image at 15, hashed prompt at 16
    assert [seq.next_stop(s, BLOCK) for s in (0, 8, 9, 16)] == [8, 12, 12, 20]
    odd = Sequence(dataclasses.replace(seq.request, snapshot_boundaries=(-3, 2, 99)), lambda e: None, 2)
    assert odd.snapshot_points(BLOCK) == (12, 16)  # out-of-range boundaries: none, or the prompt end
    unkeyed = _request(1, SYSTEMS[2], "", (1,))
    assert Sequence(unkeyed, lambda e: None, 1).snapshot_points(BLOCK) == ()  # media without a key: no caching


def _config(**kw) -> EngineConfig:
    return EngineConfig(block_size=BLOCK, enable_prefix_caching=True, **kw)


def test_a_request_resumes_from_the_deepest_snapshot_of_its_cached_prefix():
    scheduler = Scheduler(_config(max_num_batched_tokens=64), 32, 4, 8)
    blocks, snaps = scheduler.blocks, scheduler.snapshots
    first = Sequence(_request(0, SYSTEMS[3], "x", (1, 2, 3)), lambda e: None, 0)  # 13 + 6 + 3 = 22 tokens
    scheduler.add(first)
    stops = []
    while first.num_computed < first.num_prompt_tokens:
        scheduler.computed(scheduler.schedule().scheduled)
        stops.append(first.num_computed)
    assert stops == [12, 16, 20, 22] and snaps.num_used == 3  # chunks end at every snapshot point
    scheduler.finish(first)
    same_system = Sequence(_request(1, SYSTEMS[3], "y", (1, 2, 3)), lambda e: None, 1)  # another image
    scheduler.add(same_system)
    (item,) = scheduler.schedule().scheduled
    assert same_system.num_computed == 12 and item.num_tokens == 4  # from the system-prompt snapshot
    assert same_system.resume_snapshot == snaps.row_of(first.block_hashes(BLOCK)[2])
    same_image = Sequence(_request(2, SYSTEMS[3], "x", (9, 9, 9, 9, 9)), lambda e: None, 2)
    scheduler.add(same_image)
    (item,) = scheduler.schedule().scheduled[1:]
    assert same_image.num_computed == 16 and snaps.num_resumed == 2  # after the image (block 16..20 differs)
    assert blocks.num_cached_tokens == 12 + 16


class SnapshotMachine(RuleBasedStateMachine):
    """Random requests sharing system prompts and images, steps (chunked prefills, resumes,
    decodes, preemptions, evictions from a small pool), aborts and finishes; `rows` simulates
    the state pool: each slot and snapshot row holds the token identities folded into it."""

    @initialize(num_blocks=st.integers(6, 20), num_slots=st.integers(1, 4), num_snapshots=st.integers(1, 6),
                budget=st.integers(1, 24), max_seqs=st.integers(1, 6), chunked=st.booleans())
    def setup(self, num_blocks, num_slots, num_snapshots, budget, max_seqs, chunked):
        config = _config(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked)
        self.scheduler = Scheduler(config, num_blocks, num_slots, num_snapshots)
        self.snaps, self.blocks, self.slots = self.scheduler.snapshots, self.scheduler.blocks, self.scheduler.slots
        self.blocks._on_evict = self._evicted  # the scheduler's hook (`snaps.drop`), seen by the test first
        self.rows: dict[int, list[tuple]] = {}
        self.prefix_of: dict[int, list[tuple]] = {}  # prefix hash -> the token identities it stands for
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.capacity = num_blocks * BLOCK
        self.count = 0

    def _evicted(self, prefix_hash):
        if self.snaps.row_of(prefix_hash) is not None:
            event("a snapshot dropped with its KV block")
        self.snaps.drop(prefix_hash)

    @rule(system=st.sampled_from(SYSTEMS), image=st.sampled_from([None, "x", "y"]),
          question=st.lists(st.integers(1, 3), min_size=1, max_size=5))
    def add(self, system, image, question):
        seq = Sequence(_request(self.count, system, image, tuple(question)), lambda e: None, self.count)
        if seq.num_prompt_tokens >= self.capacity:  # the engine rejects it before the scheduler sees it
            return
        self.count += 1
        identity = _identity(seq)
        for k, h in enumerate(seq.block_hashes(BLOCK), 1):
            assert self.prefix_of.setdefault(h, identity[:k * BLOCK]) == identity[:k * BLOCK]  # no collision
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        out = self.scheduler.schedule()
        for seq in out.preempted:
            assert seq.state_slot is None and seq.num_computed == 0 and seq.resume_snapshot is None
        for seq, n in out.scheduled:  # the runner: fresh slots zeroed, resumed ones restored, then run
            assert seq.state_slot is not None
            if seq.num_computed == 0:
                self.rows[seq.state_slot] = []
            elif seq.resume_snapshot is not None:
                event("a sequence resumed from a snapshot")
                self.rows[seq.state_slot] = list(self.rows[seq.resume_snapshot])
            assert self.rows[seq.state_slot] == _identity(seq)[:seq.num_computed]  # the state it continues
            self.rows[seq.state_slot] += _identity(seq)[seq.num_computed:seq.num_computed + n]
        copies = self.scheduler.computed(out.scheduled)  # the engine: register the full blocks, advance, snapshot
        assert len({row for _, row in copies}) == len(copies)
        for slot, row in copies:
            self.rows[row] = list(self.rows[slot])
        for seq, _ in out.scheduled:
            if seq.num_computed == seq.num_tokens:  # caught up: one more token
                seq.tokens.append(0)
                if seq.num_tokens >= self.capacity:  # the engine ends it at the pool's size
                    self._end(seq)

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
    def snapshots_hold_their_prefix_and_die_with_its_block(self):
        if not hasattr(self, "scheduler"):
            return
        held = dict(self.snaps._by_hash)
        assert len(set(held.values())) == len(held) == self.snaps.num_used  # never shared
        assert self.snaps.num_used + self.snaps.num_free == self.snaps.num_snapshots  # never leaked
        assert all(self.snaps.first_row <= r < self.snaps.first_row + self.snaps.num_snapshots for r in held.values())
        for h, row in held.items():
            assert self.blocks.is_cached(h)  # no snapshot outlives the KV block it ends at
            assert self.rows[row] == self.prefix_of[h]  # the state of exactly that prefix
        for seq in list(self.scheduler.waiting) + self.finished:
            assert seq.state_slot is None and seq.resume_snapshot is None
        running = self.scheduler.running
        assert len({s.state_slot for s in running}) == len(running) == self.slots.num_used_slots
        held_blocks = [b for s in self.live for b in s.block_table]  # shared prefixes: a block in several
        assert all(self.blocks.ref_counts[b] == held_blocks.count(b) for b in range(self.blocks.num_blocks))

    def teardown(self):
        if hasattr(self, "scheduler"):
            for seq in list(self.live):
                self._end(seq)
            assert self.slots.num_free_slots == self.slots.num_slots
            assert self.blocks.num_free_blocks == self.blocks.num_blocks


SnapshotMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=80, deadline=None)
test_snapshot_bookkeeping = SnapshotMachine.TestCase


@pytest.mark.parametrize("share, snapshots", [(0.1, 10), (0.0, 0)])
def test_pool_sizes_take_snapshots_from_the_budget(share, snapshots):
    from llm_service.model.kv_cache import pool_sizes

    config = EngineConfig(kv_cache_bytes=1000, state_snapshot_share=share, max_num_seqs=4)
    sizes = pool_sizes(config, block_bytes=50, slot_bytes=10, device=torch.device("cpu"))
    assert sizes == ((1000 - 40 - snapshots * 10) // 50, 4, snapshots)
    assert pool_sizes(config, 100, 0, torch.device("cpu")).snapshots == 0  # no state layers
    off = EngineConfig(kv_cache_bytes=1000, enable_prefix_caching=False)
    assert pool_sizes(off, 100, 10, torch.device("cpu")).snapshots == 0
