"""Sampling parameters and the batched sampler (one call per engine step, on the logits' device)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from llm_service.model.transfer import ints


@dataclass(frozen=True)
class Grammar:
    """What the output must be (OpenAI's `response_format`): `json_object`, any JSON object, or
    `json_schema`, a JSON value valid against `schema` (the JSON Schema's text as the client sent it:
    its property order is the output's); `lark`: `schema` is a grammar in llguidance's Lark dialect
    (a forced tool call, `mmserve.request.tools`). Compiled on the LLM replica (`llm_service.grammar`)."""

    kind: Literal["json_object", "json_schema", "lark"]
    schema: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Resolved per-request sampling settings (validated at the edge, never mutated).

    `temperature == 0` means greedy. `top_k <= 0`, `top_p == 1`, `min_p == 0`,
    `repetition_penalty == 1` and zero frequency/presence penalties disable those. Penalties
    follow vLLM: repetition over prompt + output tokens, frequency/presence over output tokens.
    `seed` makes sampling reproducible whatever else runs beside the request. `logprobs`: None
    for none, else how many top alternatives to report beside the sampled token's logprob.
    `grammar`: tokens outside it are masked before sampling, and the sequence stops once it is
    complete.
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
    grammar: Grammar | None = None

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


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[tuple[tuple[int, float], ...] | None]


class SamplingRows(NamedTuple):
    """One step's sampling rows on the logits' device: each row's settings as `(N, 1)` columns
    (`top_k` `(N,)`, 0: off; all None when every row is greedy without penalties: nothing reads
    them), and where a row has penalties, its output-token counts `(N, vocab)` and which tokens
    its prompt or output holds `(N, vocab)` bool. `params` and `generators` stay on the host: they
    decide which paths run, never a value read back from the device."""

    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None


class DeviceSample(NamedTuple):
    """What `sample_rows` picked, still on the device (nothing read back): token ids `(N,)`, and
    when a row asked for logprobs, the chosen token's `(N,)` and the top `(N, k)` ids and values
    (rows that did not ask hold values too; the host keeps what each asked for)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None

    def to_host(self, rows: SamplingRows) -> SampleResult:
        """The result on the host (a synchronisation)."""
        params = rows.params
        logprobs: list[float | None] = [None] * len(params)
        tops: list[tuple[tuple[int, float], ...] | None] = [None] * len(params)
        if self.logprobs is not None:
            chosen, top_i, top_v = self.logprobs.tolist(), self.top_ids.tolist(), self.top_values.tolist()
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    logprobs[i] = chosen[i]
                    tops[i] = tuple(zip(top_i[i][:p.logprobs], top_v[i][:p.logprobs]))
        return SampleResult(self.token_ids.tolist(), logprobs, tops)


def settings_columns(params: Sequence[SamplingParams]) -> list[list[float]]:
    """Each row's numeric settings, in `SamplingRows`' column order (temperature .. presence)."""
    return [[p.temperature, p.top_p, float(p.top_k), p.min_p, p.repetition_penalty, p.frequency_penalty,
             p.presence_penalty] for p in params]


def needs_settings(params: Sequence[SamplingParams]) -> bool:
    """Whether sampling these rows reads their settings (some row samples or has penalties)."""
    return any(not p.greedy or p.has_penalties for p in params)


def sampling_rows(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  settings: torch.Tensor | None, output_counts: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None) -> SamplingRows:
    """`SamplingRows` over `settings` `(N, 7)` (`settings_columns` order, the logits' dtype;
    None: greedy rows without penalties)."""
    if settings is None:
        return SamplingRows(tuple(params), tuple(generators))
    col = settings.unsqueeze(-1)
    return SamplingRows(tuple(params), tuple(generators), col[:, 0], col[:, 1], col[:, 2, 0].long(), col[:, 3],
                        col[:, 4], col[:, 5], col[:, 6], output_counts, seen)


def settings_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype the sampler reads settings in: the logits', widened from half precision."""
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def apply_penalties(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    out, seen = rows.output_counts, rows.seen
    rep = rows.repetition_penalty.to(logits.dtype).expand_as(logits)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty.to(logits.dtype) * out
    return logits - rows.presence_penalty.to(logits.dtype) * (out > 0)


def filter_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf), row by row in one batch."""
    params = rows.params
    logits = logits / rows.temperature.to(logits.dtype).clamp_min(1e-6)
    vocab = logits.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        k = torch.where(rows.top_k > 0, rows.top_k, vocab)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        sorted_logits = sorted_logits.masked_fill(torch.cumsum(probs, -1) - probs >= rows.top_p.to(probs.dtype),
                                                  float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        floor = rows.min_p.to(probs.dtype) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _subset(rows: SamplingRows, index: list[int]) -> SamplingRows:
    at = ints(index, rows.temperature.device)
    pick = [tuple(rows.params[i] for i in index), tuple(rows.generators[i] for i in index)]
    return SamplingRows(*pick, *(None if t is None else t[at] for t in rows[2:]))  # type: ignore[arg-type]


def sample_rows(logits: torch.Tensor, rows: SamplingRows, max_logprobs: int = 20) -> DeviceSample:
    """Next token of every row of `logits` `(N, vocab)`, on the device, with no synchronisation.

    Random rows draw by the exponential race (`argmax(probs / q)`, `q ~ Exp(1)`), each seeded
    row from its own generator, so its tokens do not depend on the rest of the batch.
    """
    params = rows.params
    logits = raw = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, rows)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        subset = _subset(rows, random_rows)
        at = ints(random_rows, logits.device)
        probs = torch.softmax(filter_logits(logits[at], subset), dim=-1)
        q = torch.empty_like(probs)
        shared = [j for j, g in enumerate(subset.generators) if g is None]
        if shared:
            at_shared = ints(shared, q.device)
            q[at_shared] = torch.empty_like(q[at_shared]).exponential_()
        for j, g in enumerate(subset.generators):
            if g is not None:
                q[j].exponential_(generator=g)
        tokens[at] = (probs / q).argmax(dim=-1)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return DeviceSample(tokens)
    lp = torch.log_softmax(raw.double(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    n = min(max(wanted), max_logprobs, lp.shape[-1])
    top_v, top_i = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], lp[:, :0].long())
    return DeviceSample(tokens, chosen, top_i, top_v)
