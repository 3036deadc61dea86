"""M-RoPE (3-D rotary) positions of the Qwen2-VL family, computed by the router.

Rule (the one `transformers` >= 5 `get_rope_index` applies, which the served output must match):
text gets `arange(n) + cur` on all three axes and advances `cur` by `n`; a media item with LLM grid
`(t, h, w)` (spatial dims divided by the merge size) gets `(floor(t_idx * t_factor), h_idx, w_idx)
+ cur` and advances `cur` by `max(h, w)`. `delta = max(positions) + 1 - len(tokens)`; decode step
`s` uses `len(tokens) + delta + s` on every axis (`mmserve.inputs.positions.ExplicitPositions`).

For images `cur + max(h, w)` equals `max(previous positions) + 1`; the two differ only for videos
whose temporal extent `(t - 1) * t_factor` reaches their spatial extent, where `transformers` 4.x
and vLLM continue from `max + 1` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.inputs.media import PlaceholderRange


def video_t_factor(second_per_grid_t: float, tokens_per_second: float) -> torch.Tensor:
    """Qwen2.5-VL's temporal position step, computed in float32 as the model does.

    The step stays fractional (positions are truncated after the multiply), as in Qwen's own
    code and in `transformers` 5.23 (checked). `transformers` 5.17 truncates `second_per_grid_t`
    first (`int(0.5)` = 0 at 4 fps), so its `generate` differs from this for such videos."""
    return torch.tensor(second_per_grid_t, dtype=torch.float32) * tokens_per_second


def mrope_positions(num_tokens: int, ranges: Sequence[PlaceholderRange], grids: Sequence[tuple[int, int, int]],
                    merge_size: int, t_factors: Sequence[float | torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, int]:
    """Positions `(3, num_tokens)` (int64) and the decode delta for a prompt with media at `ranges`.

    `grids[i]` is item i's patch grid `(t, h, w)` before merging; `t_factors[i]` its temporal step
    (1 for images and Qwen2-VL videos).
    """
    if len(ranges) != len(grids):
        raise ValueError(f"{len(ranges)} placeholder ranges but {len(grids)} grids")
    t_factors = t_factors if t_factors is not None else [1] * len(grids)
    pieces: list[torch.Tensor] = []
    cur = prev_end = 0
    for rng, (t, h, w), t_factor in zip(ranges, grids, t_factors):
        if rng.offset < prev_end:
            raise ValueError("placeholder ranges must be sorted and disjoint")
        llm_t, llm_h, llm_w = t, h // merge_size, w // merge_size
        if llm_t * llm_h * llm_w != rng.length:
            raise ValueError(f"grid {(t, h, w)} gives {llm_t * llm_h * llm_w} tokens, range has {rng.length}")
        text_len = rng.offset - prev_end
        pieces.append(torch.arange(text_len).expand(3, -1) + cur)
        cur += text_len
        t_idx = (torch.arange(llm_t) * t_factor).long()
        tt, hh, ww = torch.meshgrid(t_idx, torch.arange(llm_h), torch.arange(llm_w), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(llm_h, llm_w)
        prev_end = rng.offset + rng.length
    if prev_end > num_tokens:
        raise ValueError("placeholder range past the end of the prompt")
    pieces.append(torch.arange(num_tokens - prev_end).expand(3, -1) + cur)
    positions = torch.cat(pieces, dim=1).to(torch.long)
    return positions, (int(positions.max()) + 1 - num_tokens if num_tokens else 0)

