"""The LLM engine: continuous batching on its own thread.

`step()` is schedule -> run -> postprocess: the scheduler picks the running decodes plus the
prefills that fit the token budget and the KV pool, the model runner runs them in one packed
forward, the sampler picks one token per sequence that caught up, and finished or aborted
requests give their KV blocks (and state slots, for models with linear-attention layers) back
at once. Events leave through each request's callback. With prefix caching, models with
linear-attention layers also keep state snapshots at prompt block boundaries
(`llm_service.state_snapshots`): the step's sequences that stopped at one are copied there.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from llm_service.config import EngineConfig
from llm_service.model import LanguageModel
from llm_service.model_runner import ModelRunner
from llm_service.sampling import SampleInput, new_generator, sample
from llm_service.scheduler import Scheduler
from llm_service.sequence import LLMRequest, Sequence, Status, TokenEvent
from mmserve.errors import EngineError, InvalidRequest, Overloaded

__all__ = ["EngineStats", "LLMEngine", "LLMRequest", "TokenEvent"]
logger = logging.getLogger(__name__)


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_steps: int
    num_forwards: int
    num_generated: int
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (and state, for hybrid models)
    num_snapshots: int = 0  # state snapshots held (hybrid models with prefix caching)
    snapshot_bytes: int = 0  # bytes those snapshots fill (of the rows reserved: `LLMEngine.runner.states`)
    num_snapshot_resumes: int = 0  # sequences admitted from a state snapshot so far
    num_waiting_media: int = 0  # sequences held that cannot run until more of their media rows are in


class LLMEngine:
    """Serves any number of concurrent requests from one model replica (thread-safe API)."""

    def __init__(self, model: LanguageModel, config: EngineConfig | None = None):
        self.model = model
        self.runner = ModelRunner(model, config or EngineConfig())
        self.config = self.runner.config  # as this model runs it (prefix caching of recurrent state: snapshots)
        self.snapshots = self.runner.new_snapshot_manager()  # None unless state layers + prefix caching
        self.blocks = self.runner.new_block_manager(self.snapshots.drop if self.snapshots else None)
        self.slots = self.runner.new_slot_manager()  # None unless the LM face declares state layers
        self.scheduler = Scheduler(self.config, self.blocks, self.slots, self.snapshots)
        self._new: list[Sequence] = []
        self._aborted: set[str] = set()
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._in_step: list[Sequence] = []  # the sequences of the step being run
        self.last_progress = time.monotonic()  # a step started or finished, or work arrived while idle
        self._idle = True  # waiting for work (or only for media rows): no step is owed
        self.num_steps = 0
        self.num_generated = 0
        self.step_times: list[float] = []

    # -- public API (any thread) -------------------------------------------------------------
    def add_request(self, request: LLMRequest, emit: Callable[[TokenEvent], None], ready: int | None = None) -> None:
        """Queue `request`; `ready`: its prompt inputs are present up to that token only (its media
        rows are still being filled: `extend` says when more are)."""
        if request.positions is None:
            request = dataclasses.replace(request, positions=self.model.face.text_positions())
        seq = Sequence(request, emit, next(self._arrivals), new_generator(request.sampling, self.model.device),
                       ready=ready)
        with self._cv:
            if not self._new and not self._by_id:  # idle until now: the stall clock starts here
                self.last_progress = time.monotonic()
            self._new.append(seq)
            self._cv.notify()

    def extend(self, request_id: str, ready: int | None) -> None:
        """More of a request's prompt inputs are present (its media rows, filled in place up to
        token `ready`; None: all of them): its prefill may go that far."""
        with self._cv:
            seq = self._by_id.get(request_id) or next((s for s in self._new if s.request_id == request_id), None)
            if seq is not None:
                seq.ready = ready
                self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborted.add(request_id)
            self._cv.notify()

    @property
    def num_requests(self) -> int:
        with self._cv:
            return len(self._new) + len(self._by_id)

    @property
    def num_forwards(self) -> int:
        return self.runner.num_forwards

    def stats(self) -> EngineStats:
        s, snaps = self.scheduler, self.snapshots
        num_snapshots = snaps.num_used if snaps else 0
        return EngineStats(len(s.running), len(s.waiting) + len(self._new), self.blocks.num_used_blocks,
                           self.blocks.num_blocks, s.num_preemptions, self.num_steps, self.num_forwards,
                           self.num_generated, self.blocks.num_cached_tokens, num_snapshots,
                           num_snapshots * self.runner.states.row_bytes if snaps else 0,
                           snaps.num_resumed if snaps else 0,
                           sum(not seq.runnable for seq in [*s.waiting, *s.running]))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()

    def health(self, stall_timeout_s: float) -> str | None:
        """Why this engine cannot serve (its thread is dead, or it holds work and no step started
        or finished within `stall_timeout_s`), or None when it is healthy."""
        if self._stopped:
            return "the engine was shut down"
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread is dead"
        idle_for = time.monotonic() - self.last_progress
        if self.num_requests and not self._idle and idle_for > stall_timeout_s:
            return f"the engine holds {self.num_requests} requests and made no step in {idle_for:.0f}s"
        return None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread and wait for its step to end: a process that exits while the
        thread is inside a torch op aborts ("terminate called without an active exception")."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                # idle: nothing to run, or only requests whose media rows are still on their way
                self._idle = not (self._new or self._aborted or self.scheduler.has_work())
                self._cv.wait_for(lambda: self._stopped or self._new or self._aborted or self.scheduler.has_work())
                self._idle = False
                if self._stopped:
                    return
            try:
                self.step()
            except Exception as e:  # a failed step fails its sequences, never the waiting ones nor the replica
                logger.exception("engine step failed")
                if isinstance(e, torch.OutOfMemoryError):  # resource exhaustion, not a bug
                    event = TokenEvent(None, "error", Overloaded("the language model ran out of device memory"))
                else:
                    event = TokenEvent(None, "error", EngineError(f"generation failed: {type(e).__name__}: {e}"))
                # failed before a batch was chosen (admission, scheduling): nothing tells which
                # sequences the state is still good for, so all fail
                for seq in self._in_step or list(self._by_id.values()):
                    self._finish(seq, event)
                self._in_step = []

    def step(self) -> None:
        """Admit and abort, then schedule -> one forward -> sample -> emit."""
        self.last_progress = time.monotonic()
        self._in_step = []
        self._admit()
        out = self.scheduler.schedule()
        self._in_step = [item.seq for item in out.scheduled]
        now = time.monotonic()
        for seq in self._in_step:
            if seq.scheduled_at is None:
                seq.scheduled_at = now
        for seq in out.preempted:  # alone in the pool and still too long: it can never run again
            if self.blocks.blocks_for(seq.num_tokens) > self.blocks.num_blocks:
                self._finish(seq, TokenEvent(None, "length"))
        if not out.scheduled:
            return
        start = time.perf_counter()
        logits, rows = self.runner.execute(out.scheduled)
        for item in out.scheduled:
            self._register_full_blocks(item.seq, item.seq.num_computed, item.seq.num_computed + item.num_tokens)
            item.seq.num_computed += item.num_tokens
            item.seq.resume_snapshot = None  # restored by this forward
        self.runner.save_snapshots(self.scheduler.take_snapshots(out.scheduled))
        if rows:
            seqs = [out.scheduled[i].seq for i in rows]
            inputs = [SampleInput(s.request.sampling, s.generator, s.request.prompt_token_ids, s.generated) for s in seqs]
            result = sample(logits, inputs, self.config.max_logprobs)
            for j, seq in enumerate(seqs):
                self._postprocess(seq, result.token_ids[j], result.logprobs[j], result.top_logprobs[j])
        self.num_steps += 1
        self._in_step = []
        self.last_progress = time.monotonic()
        self.step_times.append(time.perf_counter() - start)
        del self.step_times[:-1000]

    def _register_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Offer the prompt blocks this step completed to later requests (prefix caching)."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.blocks.block_size
        hashes = seq.block_hashes(bs)
        for i in range(start // bs, min(end // bs, len(hashes))):
            self.blocks.register(seq.block_table[i], hashes[i])

    def _admit(self) -> None:
        with self._cv:
            new, self._new = self._new, []
            aborted, self._aborted = self._aborted, set()
        for seq in new:
            if error := self._reject_reason(seq):
                seq.send(TokenEvent(None, "error", InvalidRequest(error)))
            elif seq.request_id in aborted:
                seq.send(TokenEvent(None, "abort"))
            else:
                self._by_id[seq.request_id] = seq
                self.scheduler.add(seq)
        for request_id in aborted:
            if (seq := self._by_id.get(request_id)) is not None:
                self._finish(seq, TokenEvent(None, "abort"))

    def _reject_reason(self, seq: Sequence) -> str | None:
        req = seq.request
        if not req.prompt_token_ids:
            return "empty prompt"
        for rng, emb in req.media:
            if emb.rows.shape != (rng.num_embeds, self.model.text_config.hidden_size):
                return f"embedding of shape {tuple(emb.rows.shape)} does not fit {rng.num_embeds} embedding slots"
        if seq.request_id in self._by_id:
            return f"request id {seq.request_id!r} is already running"
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(req.prompt_token_ids) >= capacity:
            return f"prompt of {len(req.prompt_token_ids)} tokens exceeds the KV cache capacity of {capacity} tokens"
        return None

    def _postprocess(self, seq: Sequence, token: int, logprob, top) -> None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model.eos_token_ids):
            self._finish(seq, TokenEvent(None, "stop"))
            return
        seq.tokens.append(token)
        self.num_generated += 1
        if seq.num_generated >= p.max_tokens:
            self._finish(seq, TokenEvent(token, "length", None, logprob, top))
        else:
            seq.send(TokenEvent(token, None, None, logprob, top))

    def _finish(self, seq: Sequence, event: TokenEvent) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq)
            self._by_id.pop(seq.request_id, None)
            seq.send(event)
