"""Sampling parameters and the batched sampler (one call per engine step, on the logits' device)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Resolved per-request sampling settings (validated at the edge, never mutated).

    `temperature == 0` means greedy. `top_k <= 0`, `top_p == 1`, `min_p == 0`,
    `repetition_penalty == 1` and zero frequency/presence penalties disable those. Penalties
    follow vLLM: repetition over prompt + output tokens, frequency/presence over output tokens.
    `seed` makes sampling reproducible whatever else runs beside the request. `logprobs`: None
    for none, else how many top alternatives to report beside the sampled token's logprob.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random stream (None: greedy, or unseeded: the engine's shared stream)."""
    if params.greedy or params.seed is None:
        return None
    # any integer seed works: reduced to the 64 bits torch takes (negative int64 seeds unchanged)
    return torch.Generator(device=device).manual_seed(params.seed & (2**64 - 1))


class SampleInput(NamedTuple):
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[tuple[tuple[int, float], ...] | None]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, dtype=torch.int32, device=device)
    for i, ids in enumerate(rows):
        if ids:
            t = torch.tensor(list(ids), dtype=torch.long, device=device)
            counts[i].index_add_(0, t, torch.ones_like(t, dtype=torch.int32))
    return counts


def apply_penalties(logits: torch.Tensor, inputs: Sequence[SampleInput]) -> torch.Tensor:
    vocab = logits.shape[-1]
    out = _counts([x.output_ids for x in inputs], vocab, logits.device)
    seen = (_counts([x.prompt_ids for x in inputs], vocab, logits.device) + out) > 0
    rep = _column([x.params.repetition_penalty for x in inputs], logits).expand_as(logits)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - _column([x.params.frequency_penalty for x in inputs], logits) * out
    return logits - _column([x.params.presence_penalty for x in inputs], logits) * (out > 0)


def filter_logits(logits: torch.Tensor, inputs: Sequence[SampleInput]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf), row by row in one batch."""
    params = [x.params for x in inputs]
    logits = logits / _column([max(p.temperature, 1e-6) for p in params], logits)
    vocab = logits.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = _column([p.top_p for p in params], probs)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        sorted_logits = sorted_logits.masked_fill(torch.cumsum(probs, -1) - probs >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        floor = _column([p.min_p for p in params], probs) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: torch.Tensor, inputs: Sequence[SampleInput], max_logprobs: int = 20) -> SampleResult:
    """Next token of every row of `logits` `(N, vocab)`; row i follows `inputs[i]`.

    Random rows draw by the exponential race (`argmax(probs / q)`, `q ~ Exp(1)`), each seeded
    row from its own generator, so its tokens do not depend on the rest of the batch.
    """
    raw = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logits = raw
    if any(x.params.has_penalties for x in inputs):
        logits = apply_penalties(logits, inputs)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, x in enumerate(inputs) if not x.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = torch.softmax(filter_logits(logits[rows], [inputs[i] for i in random_rows]), dim=-1)
        q = torch.empty_like(probs)
        shared = [j for j, i in enumerate(random_rows) if inputs[i].generator is None]
        if shared:
            q[shared] = torch.empty_like(q[shared]).exponential_()
        for j, i in enumerate(random_rows):
            if inputs[i].generator is not None:
                q[j].exponential_(generator=inputs[i].generator)
        tokens[rows] = (probs / q).argmax(dim=-1)
    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * len(inputs)
    tops: list[tuple[tuple[int, float], ...] | None] = [None] * len(inputs)
    wanted = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]
    if wanted:
        rows = torch.tensor(wanted, device=raw.device)
        lp = torch.log_softmax(raw[rows].double(), dim=-1)
        chosen = lp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        n = min(max(inputs[i].params.logprobs for i in wanted), max_logprobs, lp.shape[-1])
        top_v, top_i = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], lp[:, :0].long())
        for j, i in enumerate(wanted):
            k = min(inputs[i].params.logprobs, n)
            logprobs[i] = chosen[j]
            tops[i] = tuple(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
    return SampleResult(token_list, logprobs, tops)
