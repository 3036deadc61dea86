"""The LLM engine: a step loop on its own thread serving any number of concurrent requests.

`add_request` admits a request; each `step` prefills the newly admitted requests and decodes
one token for every running one, emitting `TokenEvent`s through each request's callback.
Every request owns its KV cache, so concurrent requests never see each other's state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llm_service.model import LanguageModel
from llm_service.sampling import Sampler, SamplingParams
from mmserve.media import PlaceholderRange
from mmserve.mrope import decode_position

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMRequest:
    """A prompt ready for the LM: token ids, media embeddings at their ranges, 3-D positions.

    `positions` is `(3, len(prompt_token_ids))`, or None for a text-only prompt (then
    `arange` on every axis and `mrope_delta == 0`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    positions: torch.Tensor | None = None
    mrope_delta: int = 0
    media: tuple[tuple[PlaceholderRange, torch.Tensor], ...] = ()


class TokenEvent(NamedTuple):
    """One generated token, or the end of the stream (`finish_reason` set), or a failure."""

    token_id: int | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None


@dataclass
class _Sequence:
    request: LLMRequest
    emit: Callable[[TokenEvent], None]
    sampler: Sampler
    cache: object = None
    generated: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model: LanguageModel):
        self.model = model
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._aborted: set[str] = set()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.num_forwards = 0

    # -- public API (any thread) -------------------------------------------------------------
    def add_request(self, request: LLMRequest, emit: Callable[[TokenEvent], None]) -> None:
        seq = _Sequence(request, emit, Sampler(request.sampling, self.model.device))
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborted.add(request_id)
            self._cv.notify()

    @property
    def num_requests(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._running)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self._waiting or self._running or self._aborted)
                if self._stopped:
                    return
            self.step()

    def step(self) -> None:
        """Prefill newly admitted requests, then decode one token for each running request."""
        with self._cv:
            new, self._waiting = self._waiting, []
            aborted, self._aborted = self._aborted, set()
        for seq in [s for s in self._running + new if s.request.request_id in aborted]:
            seq.emit(TokenEvent(None, "abort"))
        self._running = [s for s in self._running if s.request.request_id not in aborted]
        new = [s for s in new if s.request.request_id not in aborted]
        running, self._running = self._running, []
        for seq in new:
            self._advance(seq, self._prefill)
        for seq in running:
            self._advance(seq, self._decode)

    def _advance(self, seq: _Sequence, forward: Callable[[_Sequence], torch.Tensor]) -> None:
        try:
            logits = forward(seq)
            self.num_forwards += 1
            token = seq.sampler(logits)
        except Exception as e:  # one bad request must not take the engine down
            logger.exception("request %s failed", seq.request.request_id)
            seq.emit(TokenEvent(None, "error", f"{type(e).__name__}: {e}"))
            return
        finish = self._finish_reason(seq, token)
        if finish != "stop":
            seq.generated.append(token)
            seq.emit(TokenEvent(token, finish))
        else:
            seq.emit(TokenEvent(None, finish))
        if finish is None:
            self._running.append(seq)

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model.eos_token_ids):
            return "stop"
        if len(seq.generated) + 1 >= p.max_tokens:
            return "length"
        return None

    def _prefill(self, seq: _Sequence) -> torch.Tensor:
        req = seq.request
        positions = req.positions
        if positions is None:
            positions = torch.arange(len(req.prompt_token_ids)).expand(3, -1)
        embeds = self.model.prompt_embeddings(req.prompt_token_ids, req.media)
        seq.cache = self.model.new_cache()
        return self.model.forward(embeds, positions, seq.cache)

    def _decode(self, seq: _Sequence) -> torch.Tensor:
        req = seq.request
        step = len(seq.generated) - 1
        pos = decode_position(len(req.prompt_token_ids), req.mrope_delta, step)
        embeds = self.model.token_embedding(seq.generated[-1])
        return self.model.forward(embeds, torch.full((3, 1), pos), seq.cache)
