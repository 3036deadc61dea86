"""Position plans: a prompt's rotary positions and the rule for every token after it.

A plan is made by the family's router face and read by the LLM engine, which never looks inside:
it asks for the positions of token indices `start..end` and gets a `(rows, end - start)` int64
tensor, prompt or generated tokens alike. Only the family knows how many rows there are (1 for
plain RoPE, 3 for M-RoPE) and what a decode delta is; its LM face turns rows into the decoder's
`position_ids`. Because a plan answers for any index, a prompt extended by already generated
tokens (a resumed stream) uses the same plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class PositionPlan(ABC):
    """Positions of a request's tokens; immutable and picklable (it travels router -> LLM)."""

    @abstractmethod
    def positions(self, start: int, end: int) -> torch.Tensor:
        """int64 `(rows, end - start)`: positions of token indices `start..end` (0 <= start <= end)."""


@dataclass(frozen=True)
class LinearPositions(PositionPlan):
    """Token `i` at position `i` on each of `rows` axes (plain RoPE, or M-RoPE text)."""

    rows: int = 1

    def positions(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.long).expand(self.rows, -1)


@dataclass(frozen=True)
class ExplicitPositions(PositionPlan):
    """The prompt's positions given row by row; token `i >= len(prompt)` at `i + delta` on every row."""

    prompt: torch.Tensor  # (rows, num_prompt_tokens), int64
    delta: int

    def positions(self, start: int, end: int) -> torch.Tensor:
        n = self.prompt.shape[1]
        head = self.prompt[:, start:min(end, n)]
        if end <= n:
            return head
        tail = (torch.arange(max(start, n), end, dtype=torch.long) + self.delta).expand(self.prompt.shape[0], -1)
        return torch.cat([head, tail], dim=1) if start < n else tail
