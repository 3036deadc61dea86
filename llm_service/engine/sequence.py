"""Requests as the engine sees them: the request, the tokens so far, its KV blocks."""

from __future__ import annotations

import bisect
import hashlib
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from llm_service.sampling import SamplingParams
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import PlaceholderRange
from mmserve.inputs.positions import PositionPlan


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA adapter a request runs under: `name` identifies it (loaded once, shared by the
    requests that name it: `llm_service.model.lora.LoraSet`), `path` is its PEFT directory."""

    name: str
    path: str


@dataclass(frozen=True)
class LLMRequest:
    """A prompt ready for the LM: token ids, media embeddings at their ranges, the position plan.

    `positions` is the family's plan for every token, prompt and generated (opaque here); None
    means the model's plan for plain text (`LanguageModel.text_positions`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    positions: PositionPlan | None = None
    # each media item's prompt range (embedding slots marked) and encoder output; the output's
    # key (content + encoder identity) is what makes two prompts' media tokens equal for prefix
    # caching (an output without a key is never cached)
    media: tuple[tuple[PlaceholderRange, ItemEmbedding], ...] = ()
    # prompt offsets after which the recurrent state of a hybrid model is worth keeping for later
    # requests, beyond the ends of the media items and of the prompt, which the engine knows
    # itself: the router puts the end of the system prompt here (`RequestPlan.snapshot_boundaries`)
    snapshot_boundaries: tuple[int, ...] = ()
    # its place in `sampling.grammar` (`llm_service.grammar.Matcher`, made off the engine's thread and
    # any event loop by `GrammarCompiler.matchers`; None: the engine makes one), and how many of the
    # prompt's last tokens were generated under the grammar already (a stream resumed on this
    # replica after its first replica was lost)
    matcher: object | None = None
    grammar_prefix: int = 0
    lora: LoraRequest | None = None  # the LoRA adapter it runs under (None: the base model)


class TokenEvent(NamedTuple):
    """One generated token, or the end of the stream (`finish_reason` set), or a failure.

    `logprob` / `top_logprobs` are set when the request asked for logprobs: the log-probability
    of `token_id` and the `(token_id, logprob)` pairs of the most likely tokens, from the raw
    model distribution (before temperature, penalties and filters, as vLLM reports them).
    """

    token_id: int | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (then `error` says why)
    # the failure, as the exception the caller raises: `InvalidRequest` (the request cannot be
    # served), `Overloaded` (out of device memory) or `EngineError` (a failed step)
    error: Exception | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # milliseconds per stage of this request: the engine puts {"prefill_queue_ms"} on a sequence's
    # first event; the LLM deployment puts every stage it saw on the last (usage.stage_ms)
    stages: dict[str, float] | None = None
    choice: int = 0  # which of a request's `n` choices (set by the LLM deployment)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    `tokens` is prompt + generated ids; `num_computed` how many of them have K/V in the pool
    (the blocks of `block_table`) and, for models with linear-attention layers, are folded into
    the recurrent state of `state_slot` (held while running, None otherwise). Preemption drops
    the blocks and the slot and sets `num_computed` to 0: the sequence is recomputed from its
    tokens (media embeddings kept) when it runs again. `resume_snapshot` is the state snapshot
    row a sequence admitted from a cached prefix starts its slot from (until its first step).

    With overlapped steps the host learns a sampled token one step late: `num_unread` tokens
    (0 or 1 when a step is scheduled) were sampled on the device and are not in `tokens` yet;
    they count in `num_tokens` (the scheduler runs them: their ids come from the sequence's
    `batch_row` on the device), never in `tokens`.
    """

    request: LLMRequest
    emit: Callable[[TokenEvent], None]
    arrival: int
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    resume_snapshot: int | None = None
    status: Status = Status.WAITING
    num_preemptions: int = 0
    num_unread: int = 0
    batch_row: int | None = None  # its row of the runner's `BatchState`, held while running
    _block_hashes: list[int] | None = None
    _embed_slots: list[list[int]] | None = None
    _snapshot_points: tuple[int, ...] | None = None
    # prompt tokens whose inputs are present (None: all of them): a streamed video's embedding
    # rows arrive group by group, and the prompt is prefilled no further than they have
    ready: int | None = None
    added_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # its first step (the end of its prefill queue)
    matcher: object | None = None  # its place in its grammar (`llm_service.grammar.Matcher`), if it has one
    holds_lora: bool = False  # it counts as a holder of its adapter (`LoraSet.hold`) until it finishes
    _sent: bool = False

    def __post_init__(self):
        self.tokens = list(self.request.prompt_token_ids)

    def send(self, event: TokenEvent) -> None:
        """`emit(event)`; the first event carries how long the sequence waited for its first step."""
        if not self._sent:
            self._sent = True
            if self.scheduled_at is not None:
                event = event._replace(stages={"prefill_queue_ms": (self.scheduled_at - self.added_at) * 1000})
        self.emit(event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, the unread ones included."""
        return len(self.tokens) + self.num_unread

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        """The generated tokens the host has read."""
        return self.tokens[self.num_prompt_tokens:]

    @property
    def ready_end(self) -> int:
        """How far the tokens can be computed now: all of them, or up to `ready`; with every
        token it may generate sampled (some still unread), not the last one (nothing samples
        after it)."""
        end = self.num_tokens if self.ready is None else min(self.ready, self.num_tokens)
        if self.num_unread and self.num_generated >= self.request.sampling.max_tokens:
            end = min(end, self.num_tokens - 1)
        return end

    @property
    def runnable(self) -> bool:
        """Whether a step could compute any of its tokens now (not waiting for media rows)."""
        return self.ready_end > self.num_computed

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Positions `(rows, end - start)` of tokens `start..end`, from the request's plan."""
        return self.request.positions.positions(start, end)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the full prompt blocks, last prompt token excluded (it must run to
        give logits): block i's hash covers every token id before its end, for image/video
        tokens which item and which of its rows they are, and the LoRA adapter (name and path)
        the request runs under. Equal hashes, equal K/V."""
        if self._block_hashes is None:
            req = self.request
            self._block_hashes = []
            if not all(emb.key for _, emb in req.media):
                return self._block_hashes
            prev = b"" if req.lora is None else f"lora:{req.lora.name}:{req.lora.path}".encode()
            for i in range((self.num_prompt_tokens - 1) // block_size):
                lo, hi = i * block_size, (i + 1) * block_size
                h = hashlib.blake2b(prev, digest_size=16)
                h.update(array("q", req.prompt_token_ids[lo:hi]).tobytes())
                for rng, emb in req.media:
                    if rng.offset < hi and rng.offset + rng.length > lo:
                        h.update(f"{emb.key}@{lo - rng.offset}".encode())
                prev = h.digest()
                self._block_hashes.append(int.from_bytes(prev, "little"))
        return self._block_hashes

    def snapshot_points(self, block_size: int) -> tuple[int, ...]:
        """Where a hybrid model's prefill stops to snapshot its recurrent state (ascending token
        counts): the last block boundary at or before the end of each of the request's
        `snapshot_boundaries` (the system prompt), of each media item and of the prompt, within
        the hashed blocks (`block_hashes`: the last prompt token always runs)."""
        if self._snapshot_points is None:
            hashed = len(self.block_hashes(block_size)) * block_size
            ends = (*self.request.snapshot_boundaries, *(r.offset + r.length for r, _ in self.request.media), hashed)
            points = {min(e, hashed) // block_size * block_size for e in ends}
            self._snapshot_points = tuple(sorted(p for p in points if p > 0))
        return self._snapshot_points

    def next_stop(self, start: int, block_size: int) -> int:
        """The first snapshot point after `start`, else the end of the tokens."""
        points = self.snapshot_points(block_size)
        i = bisect.bisect_right(points, start)
        return points[i] if i < len(points) else self.num_tokens

    def chunk_media(self, start: int, end: int) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """For every media item with embedding slots in tokens `start..end`: the slots' indices
        in the chunk and the item's output parts sliced to those slots' rows."""
        if self._embed_slots is None:
            self._embed_slots = [rng.embed_slots() for rng, _ in self.request.media]
        out = []
        for (rng, emb), slots in zip(self.request.media, self._embed_slots):
            if rng.offset >= end or rng.offset + rng.length <= start:
                continue
            lo = bisect.bisect_left(slots, start - rng.offset)
            hi = bisect.bisect_left(slots, end - rng.offset)
            if lo < hi:
                index = torch.tensor(slots[lo:hi], dtype=torch.long) + (rng.offset - start)
                out.append((index, tuple(part[lo:hi] for part in emb.parts)))
        return out
