"""Requests as the engine sees them: the request, the tokens so far, its KV blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from llm_service.sampling import SamplingParams
from mmserve.media import PlaceholderRange
from mmserve.positions import PositionPlan


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
    media: tuple[tuple[PlaceholderRange, torch.Tensor], ...] = ()
    # content hash of each `media` item: what makes two prompts' image tokens the same for
    # prefix caching (a prompt with media but without keys is never cached)
    media_keys: tuple[str, ...] = ()


class TokenEvent(NamedTuple):
    """One generated token, or the end of the stream (`finish_reason` set), or a failure.

    `logprob` / `top_logprobs` are set when the request asked for logprobs: the log-probability
    of `token_id` and the `(token_id, logprob)` pairs of the most likely tokens, from the raw
    model distribution (before temperature, penalties and filters, as vLLM reports them).
    """

    token_id: int | None
    # "stop" | "length" | "abort" | "error" (the engine failed) | "rejected" (the request cannot be served)
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    `tokens` is prompt + generated ids; `num_computed` how many of them have K/V in the pool
    (the blocks of `block_table`). Preemption drops the blocks and sets `num_computed` to 0:
    the sequence is recomputed from its tokens (media embeddings kept) when it runs again.
    """

    request: LLMRequest
    emit: Callable[[TokenEvent], None]
    arrival: int
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_preemptions: int = 0
    _block_hashes: list[int] | None = None

    def __post_init__(self):
        self.tokens = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V are not in the pool yet (1 for a decode)."""
        return len(self.tokens) - self.num_computed

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Positions `(rows, end - start)` of tokens `start..end`, from the request's plan."""
        return self.request.positions.positions(start, end)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the full prompt blocks, last prompt token excluded (it must run to
        give logits): block i's hash covers every token id before its end and, for image/video
        tokens, which item and which of its rows they are. Equal hashes, equal K/V."""
        if self._block_hashes is None:
            req = self.request
            self._block_hashes = []
            if len(req.media_keys) != len(req.media):
                return self._block_hashes
            prev = b""
            for i in range((self.num_prompt_tokens - 1) // block_size):
                lo, hi = i * block_size, (i + 1) * block_size
                h = hashlib.blake2b(prev, digest_size=16)
                h.update(array("q", req.prompt_token_ids[lo:hi]).tobytes())
                for (rng, _), key in zip(req.media, req.media_keys):
                    if rng.offset < hi and rng.offset + rng.length > lo:
                        h.update(f"{key}@{lo - rng.offset}".encode())
                prev = h.digest()
                self._block_hashes.append(int.from_bytes(prev, "little"))
        return self._block_hashes

    def chunk_media(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """`(offset in the chunk, embedding rows)` of every media item overlapping `start..end`."""
        out = []
        for rng, emb in self.request.media:
            lo, hi = max(rng.offset, start), min(rng.offset + rng.length, end)
            if lo < hi:
                out.append((lo - start, emb[lo - rng.offset:hi - rng.offset]))
        return out
