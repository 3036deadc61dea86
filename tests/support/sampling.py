"""The sampler over host lists (each row's settings, generator, prompt and output ids, counted
every call): what the tests sample with directly, and compare the engine's device rows to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from llm_service.model.transfer import to_device
from llm_service.sampling import (SampleResult, SamplingParams, SamplingRows, sample_rows, sampling_rows,
                                  settings_columns, settings_dtype)


class SampleInput(NamedTuple):
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def _counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, dtype=torch.int32, device=device)
    for i, ids in enumerate(rows):
        if ids:
            t = torch.tensor(list(ids), dtype=torch.long, device=device)
            counts[i].index_add_(0, t, torch.ones_like(t, dtype=torch.int32))
    return counts


def rows_from_lists(logits: torch.Tensor, inputs: Sequence[SampleInput]) -> SamplingRows:
    """`SamplingRows` from host lists (prompt and output ids counted here, every call)."""
    dtype = settings_dtype(logits)
    settings = to_device(torch.tensor(settings_columns([x.params for x in inputs]), dtype=dtype), logits.device)
    counts = seen = None
    if any(x.params.has_penalties for x in inputs):
        vocab = logits.shape[-1]
        counts = _counts([x.output_ids for x in inputs], vocab, logits.device)
        seen = (_counts([x.prompt_ids for x in inputs], vocab, logits.device) + counts) > 0
    return sampling_rows([x.params for x in inputs], [x.generator for x in inputs], settings, counts, seen)


def sample(logits: torch.Tensor, inputs: Sequence[SampleInput], max_logprobs: int = 20) -> SampleResult:
    """`sample_rows` over host lists (each row follows `inputs[i]`), read back to the host."""
    rows = rows_from_lists(logits, inputs)
    return sample_rows(logits, rows, max_logprobs).to_host(rows)
