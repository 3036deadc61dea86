"""The LLM engine: continuous batching on its own thread.

`step()` is schedule -> run -> postprocess: the scheduler picks the running decodes plus the
prefills that fit the token budget and the KV pool, the model runner runs them in one packed
forward, the sampler picks one token per sequence that caught up, and finished or aborted
requests give their KV blocks (and state slots, for models with linear-attention layers) back
at once. Events leave through each request's callback. With prefix caching, models with
linear-attention layers also keep state snapshots at prompt block boundaries
(`llm_service.hybrid.state_snapshots`): the step's sequences that stopped at one are copied there.

With `async_scheduling` steps overlap (docs/attention.md#overlapped-steps): the host launches
step N+1 before it reads and postprocesses step N, so stop ids and EOS apply a step late and a
sequence that finished at step N drops its token of step N+1, never sent (`max_tokens` is known
ahead: a sequence with all its tokens sampled is not scheduled again). Everything the device
does stays in stream order, so blocks, slots and rows freed while a step that used them is in
flight are only reused by work queued after it. Constrained rows: `StepMasks.sample`.
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
from llm_service.engine.scheduler import ScheduledSeq, Scheduler
from llm_service.engine.sequence import LLMRequest, Sequence, TokenEvent
from llm_service.engine.step_timing import StepClock, StepTimes
from llm_service.grammar import GrammarCompiler, StepMasks
from llm_service.model.language_model import LanguageModel
from llm_service.model.lora import AdapterError
from llm_service.model.model_runner import ModelRunner, StepInputs
from llm_service.sampling import (DeviceSample, SamplingParams, SamplingRows, new_generator, sample_rows,
                                  settings_dtype)
from mmserve.errors import EngineError, InvalidRequest, Overloaded, ReplicaLost

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


class _Launched(NamedTuple):
    """A step whose sampled ids are on their way to the host."""

    seqs: list[Sequence]  # the sequences that sampled, in row order
    rows: SamplingRows
    sample: DeviceSample  # host tensors, filled by non-blocking copies
    done: torch.cuda.Event | None  # recorded after the copies (None off CUDA)
    began: torch.cuda.Event | None  # before the forward (step timing only: `StepClock.device_start`)


class LLMEngine:
    """Serves any number of concurrent requests from one model replica (thread-safe API)."""

    def __init__(self, model: LanguageModel, config: EngineConfig | None = None):
        self.model = model
        self.runner = ModelRunner(model, config or EngineConfig())
        self.config = self.runner.config  # as this model runs it (prefix caching of recurrent state: snapshots)
        self._new_scheduler()
        self._new: list[Sequence] = []
        self._aborted: set[str] = set()
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.lost: str | None = None  # why a tensor-parallel replica can serve no more
        self._in_step: list[Sequence] = []  # the sequences of the step being run
        self._launched: _Launched | None = None  # overlap: the step launched, not read yet
        overlap = self.config.async_scheduling
        # never under tensor parallelism: every rank's inputs leave the host before its forward
        self.overlap = self.runner.tp is None and (model.device.type == "cuda" if overlap is None else overlap)
        self.clock = StepClock()
        self.last_progress = time.monotonic()  # a step started or finished, or work arrived while idle
        self._idle = True  # waiting for work (or only for media rows): no step is owed
        self.num_steps = self.num_generated = 0
        self.grammar_compiler: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # the mask fill's threads, set here (default: the replica's torch threads, `replica_env.set_cpu_threads`)
        self.masks = StepMasks(self.model.vocab_size, self.config.grammar_threads or torch.get_num_threads())

    @property
    def step_log(self) -> list[StepTimes] | None:
        """Each step's `StepTimes` while this is a list (set one to record them; None: off)."""
        return self.clock.log

    @step_log.setter
    def step_log(self, log: list[StepTimes] | None) -> None:
        self.clock.log = log

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of `response_format` grammars for this model's tokenizer (made on first use)."""
        with self._grammars_lock:
            if self.grammar_compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model.model_dir)
                self.grammar_compiler = GrammarCompiler(tokenizer, self.model.vocab_size, self.model.eos_token_ids,
                                                        timeout_s=self.config.grammar_compile_timeout_s,
                                                        max_roots=self.masks.threads)
            return self.grammar_compiler

    def _new_scheduler(self) -> None:
        r = self.runner
        self.scheduler = Scheduler(self.config, r.num_blocks, r.num_slots, r.num_snapshots, r.batch.release)

    def load_loras(self, adapters) -> None:
        """Before `start()`: load each `LoraRequest` of `adapters` once (the last `max_loras` stay
        loaded), so that a bad adapter stops the replica at start, naming it and the field."""
        for adapter in adapters:
            if not self._loras(adapter).hold(adapter):
                raise AdapterError(f"LoRA adapter {adapter.name!r}: no free place (max_loras is "
                                   f"{self.runner.loras.capacity})")
            self.runner.loras.release(adapter.name)

    def _loras(self, adapter):
        if self.runner.loras is None:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: this engine serves none (max_loras is 0)")
        return self.runner.loras

    def prepare_lora(self, adapter) -> None:
        """From any thread (Serve's multiplexed loader, `deployments.serve.llm`): read the
        `LoraRequest`'s adapter ahead, so that its request's admission on the engine thread only
        installs it (`LoraSet.prepare`); `forget_lora(name)` drops it if it was never installed."""
        self._loras(adapter).prepare(adapter)

    def forget_lora(self, name: str) -> None:
        if self.runner.loras is not None:
            self.runner.loras.forget(name)

    def warm_up(self, num_prompt_tokens: int = 24, max_tokens: int = 3) -> None:
        """Before `start()`: run a greedy and a sampled request through the real steps in the calling
        thread, so that the first client request finds everything warm; then forget them (`stats()`
        reads as a fresh engine's)."""
        if self._thread is not None:
            raise RuntimeError("warm_up() runs before start()")
        ids = tuple(i % self.model.vocab_size for i in range(1, num_prompt_tokens + 1))
        sampled = SamplingParams(max_tokens, temperature=1.0, top_p=0.9, top_k=16, seed=0, ignore_eos=True)
        ends: list[TokenEvent] = []

        def on_event(event: TokenEvent) -> None:
            if event.finish_reason:
                ends.append(event)

        for n, sampling in enumerate((SamplingParams(max_tokens, ignore_eos=True), sampled)):
            self.add_request(LLMRequest(f"warm-up-{n}", ids, sampling), on_event)
        for _ in range(8 * max_tokens + 8):
            if len(ends) == 2 and self._launched is None:
                break
            self.step()
        else:
            raise RuntimeError(f"the warm-up requests did not finish: {ends}")
        if failed := [e.error for e in ends if e.error is not None]:
            raise RuntimeError(f"the warm-up request failed: {failed[0]!r}") from failed[0]
        self._new_scheduler()
        self.num_steps = self.num_generated = self.runner.num_forwards = 0
        self.runner.expert_load.reset(num_forwards=0)
        self.last_progress = time.monotonic()

    # -- public API (any thread) -------------------------------------------------------------
    def add_request(self, request: LLMRequest, emit: Callable[[TokenEvent], None], ready: int | None = None) -> None:
        """Queue `request`; `ready`: its prompt inputs are present up to that token only (its media
        rows are still being filled: `extend` says when more are)."""
        if self.lost:
            raise ReplicaLost(self.lost)
        if request.positions is None:
            request = dataclasses.replace(request, positions=self.model.face.text_positions())
        seq = Sequence(request, emit, next(self._arrivals), new_generator(request.sampling, self.model.device),
                       ready=ready)
        if request.sampling.grammar is not None:  # InvalidRequest for a bad schema, raised here
            prompt = request.prompt_token_ids
            seq.matcher = request.matcher or self.grammars.copies(self.grammars.compile(request.sampling.grammar), 1,
                                                                  prompt[len(prompt) - request.grammar_prefix:])[0]
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
        s, blocks, snaps = self.scheduler, self.scheduler.blocks, self.scheduler.snapshots
        num_snapshots = snaps.num_used if snaps else 0
        return EngineStats(len(s.running), len(s.waiting) + len(self._new), blocks.num_used_blocks,
                           blocks.num_blocks, s.num_preemptions, self.num_steps, self.num_forwards,
                           self.num_generated, blocks.num_cached_tokens, num_snapshots,
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
        if self.lost:
            return self.lost
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
        if not self.lost and (self._thread is None or not self._thread.is_alive()):
            try:
                self.runner.stop_ranks()  # a tensor-parallel replica's other ranks end with it
            except Exception:  # a rank already gone: nothing to stop there
                logger.warning("stopping the tensor-parallel ranks failed", exc_info=True)

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                # idle: nothing to run, or only requests whose media rows are still on their way
                self._idle = not (self._new or self._aborted or self.scheduler.has_work() or self._launched)
                self._cv.wait_for(lambda: self._stopped or self._new or self._aborted or self.scheduler.has_work()
                                  or self._launched is not None)
                self._idle = False
                if self._stopped:
                    return
            try:
                self.step()
            except Exception as e:  # a failed step fails its sequences, never the waiting ones nor the replica
                logger.exception("engine step failed")
                if self.runner.group_broken:  # the ranks are out of step: the replica serves no more
                    self._lose_replica(e)
                    return
                if isinstance(e, torch.OutOfMemoryError):  # resource exhaustion, not a bug
                    event = TokenEvent(None, "error", Overloaded("the language model ran out of device memory"))
                else:
                    event = TokenEvent(None, "error", EngineError(f"generation failed: {type(e).__name__}: {e}"))
                # failed before a batch was chosen (admission, scheduling): nothing tells which
                # sequences the state is still good for, so all fail
                failed = self._in_step or list(self._by_id.values())
                if self._launched is not None:  # the step in flight is lost with it
                    failed = [*failed, *self._launched.seqs]
                    self._launched = None
                for seq in failed:
                    self._finish(seq, event)
                self._in_step = []

    def _lose_replica(self, e: Exception) -> None:
        """A tensor-parallel step failed (a rank died, or a collective broke): every request here
        fails with `ReplicaLost`, which the router resubmits elsewhere; the thread ends, so
        `health` fails the replica as a whole."""
        self.lost = f"tensor-parallel group broken: {type(e).__name__}: {e}"
        with self._cv:
            new, self._new = self._new, []
        event = TokenEvent(None, "error", ReplicaLost(self.lost))
        for seq in new:  # not admitted yet
            seq.send(event)
        for seq in dict.fromkeys([*self._by_id.values(), *self._in_step]):
            self._finish(seq, event)

    def step(self) -> None:
        """Admit and abort, schedule -> launch (one forward, the sampler) -> read the sampled ids
        (with overlap, those of the step launched before this one, unless this step's constrained
        rows read them first) -> postprocess them; `clock` times it (`step_log`)."""
        self.clock.start()
        self.last_progress = time.monotonic()
        scheduled = self._schedule()
        launched = self._launch(scheduled) if scheduled else None
        previous, self._launched = (self._launched, launched) if self.overlap else (launched, None)
        if previous is not None:
            self._read(previous)
        self.num_steps += bool(scheduled)
        self._in_step = []
        self.last_progress = time.monotonic()
        self.clock.stop(scheduled)

    def _schedule(self) -> tuple[ScheduledSeq, ...]:
        """Admit and abort, then the scheduler's pick; a sequence preempted alone in the pool and
        still too long for it ends with `length` (it can never run again)."""
        self._in_step = []
        self._admit()
        out = self.scheduler.schedule()
        self._in_step = [item.seq for item in out.scheduled]
        now = time.monotonic()
        for seq in self._in_step:
            if seq.scheduled_at is None:
                seq.scheduled_at = now
        blocks = self.scheduler.blocks
        for seq in out.preempted:
            if blocks.blocks_for(seq.num_tokens) > blocks.num_blocks:
                self._finish(seq, TokenEvent(None, "length"))
        return out.scheduled

    def _launch(self, scheduled: tuple[ScheduledSeq, ...]) -> _Launched | None:
        """Prepare, run and sample one step (None: no sequence samples)."""
        self.clock.enter("prepare")
        step = self.runner.prepare(scheduled)
        self.clock.enter("launch")
        began = self.clock.device_start(self.model.device)
        logits = self.runner.run(step)
        self.clock.enter("sample")
        self.runner.save_snapshots(self.scheduler.computed(scheduled))
        launched = self._sample(step, logits, began) if step.sample_rows else None
        self.clock.enter(None)
        return launched

    def _sample(self, step: StepInputs, logits: torch.Tensor, began: torch.cuda.Event | None) -> _Launched:
        """Sample the step's rows (the constrained ones masked: `StepMasks.sample`); the sampled ids
        stay on the device (and in the rows' state) and start their copy to the host."""
        seqs = [step.scheduled[i].seq for i in step.sample_rows]
        batch, cuda = self.runner.batch, self.model.device.type == "cuda"
        with torch.inference_mode():
            # a decode samples every row, in order: its staged rows are the index
            index = step.decode_index[:len(seqs)] if step.decode_index is not None else batch.index(seqs)
            rows = batch.sampling_rows(seqs, index, settings_dtype(logits))
            result = self.masks.sample(logits, seqs, lambda: sample_rows(logits, rows, self.config.max_logprobs),
                                       read_before=self._read_in_flight)
            batch.record(index, result.token_ids)
            host = DeviceSample(*(t if t is None else
                                  torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda).copy_(t, non_blocking=True)
                                  for t in result))
        done = None
        if cuda:
            done = torch.cuda.Event(enable_timing=began is not None)
            done.record()
        for seq in seqs:
            seq.num_unread += 1
        return _Launched(seqs, rows, host, done, began)

    def _read_in_flight(self) -> None:
        """Read the step in flight now (its constrained rows' matchers need its tokens)."""
        if self._launched is not None:
            self._read(self._launched)
            self._launched = None

    def _read(self, launched: _Launched) -> None:
        resume = self.clock.enter("readback")
        if launched.done is not None:
            launched.done.synchronize()
        self.clock.enter("postprocess")
        result = launched.sample.to_host(launched.rows)
        for j, seq in enumerate(launched.seqs):
            seq.num_unread -= 1
            if not seq.finished:  # else finished (or aborted) after this step was launched
                self._postprocess(seq, result.token_ids[j], result.logprobs[j], result.top_logprobs[j])
        self.runner.expert_load.collect(self.runner.num_forwards)
        self.clock.read(launched.began, launched.done, resume)

    def _admit(self) -> None:
        """New requests join the scheduler, but one whose LoRA adapter cannot be loaded yet (every
        place held by running requests) waits among the new ones."""
        with self._cv:
            new, self._new = self._new, []
            aborted, self._aborted = self._aborted, set()
        held_back = []
        for seq in new:
            if error := self._reject_reason(seq) or (seq.request_id not in aborted and self._hold_lora(seq)):
                seq.send(TokenEvent(None, "error", InvalidRequest(error)))
            elif seq.request_id in aborted:
                seq.send(TokenEvent(None, "abort"))
            elif seq.request.lora is not None and not seq.holds_lora:
                held_back.append(seq)
            else:
                self._by_id[seq.request_id] = seq
                self.scheduler.add(seq)
        if held_back:
            with self._cv:
                self._new[:0] = held_back
        for request_id in aborted:
            if (seq := self._by_id.get(request_id)) is not None:
                self._finish(seq, TokenEvent(None, "abort"))

    def _hold_lora(self, seq: Sequence) -> str | None:
        """Load and hold `seq`'s LoRA adapter if it names one (`seq.holds_lora`: False while every
        place is held); why the adapter cannot be served, if it cannot."""
        if seq.request.lora is not None:
            try:
                seq.holds_lora = self.runner.loras.hold(seq.request.lora)
            except AdapterError as e:
                return str(e)
        return None

    def _reject_reason(self, seq: Sequence) -> str | None:
        req = seq.request
        if not req.prompt_token_ids:
            return "empty prompt"
        if req.lora is not None and self.runner.loras is None:
            return f"LoRA adapter {req.lora.name!r} requested, but this engine serves none (max_loras is 0)"
        for rng, emb in req.media:
            if emb.rows.shape != (rng.num_embeds, self.model.text_config.hidden_size):
                return f"embedding of shape {tuple(emb.rows.shape)} does not fit {rng.num_embeds} embedding slots"
        if seq.request_id in self._by_id:
            return f"request id {seq.request_id!r} is already running"
        prompt_len, max_tokens, limit = len(req.prompt_token_ids), req.sampling.max_tokens, self.runner.max_model_len
        if prompt_len + max_tokens > limit:  # the router refuses these first (400)
            return f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceed max_model_len {limit}"
        capacity = self.scheduler.blocks.num_blocks * self.config.block_size
        if prompt_len >= capacity:
            return f"prompt of {prompt_len} tokens exceeds the KV cache capacity of {capacity} tokens"
        return None

    def _postprocess(self, seq: Sequence, token: int, logprob, top) -> None:
        p, matcher = seq.request.sampling, seq.matcher
        if matcher is not None and not matcher.accept(token):  # the mask left no token: the grammar cannot go on
            self._finish(seq, TokenEvent(None, "error", InvalidRequest(
                f"response_format: after {len(seq.generated)} tokens the grammar allows none this model can produce")))
            return
        complete = matcher is not None and matcher.complete  # the output is whole: only a stop token could follow
        if token in p.stop_token_ids or ((complete or not p.ignore_eos) and token in self.model.eos_token_ids):
            self._finish(seq, TokenEvent(None, "stop"))
            return
        seq.tokens.append(token)
        self.num_generated += 1
        if complete:  # its last token, sent with the end (no step spent on the stop token)
            self._finish(seq, TokenEvent(token, "stop", None, logprob, top))
        elif len(seq.tokens) - seq.num_prompt_tokens >= p.max_tokens:
            self._finish(seq, TokenEvent(token, "length", None, logprob, top))
        else:
            seq.send(TokenEvent(token, None, None, logprob, top))

    def _finish(self, seq: Sequence, event: TokenEvent) -> None:
        if not seq.finished:
            self.scheduler.finish(seq)
            self._by_id.pop(seq.request_id, None)
            if seq.holds_lora:
                self.runner.loras.release(seq.request.lora.name)
                seq.holds_lora = False
            seq.send(event)
