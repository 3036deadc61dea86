"""Per-sequence recurrent state of linear-attention layers: the preallocated slot pool beside the
KV pool (and the state snapshots of prefix caching after the slots), and the per-step view the
decoder's state layers read and write.

A hybrid decoder (Qwen3.5 / Qwen3-Next / MiniCPM-V 4.6's LM: Gated-DeltaNet layers between
full-attention layers) declares its state layers through `LMFace.state_layers()`. Each such layer
keeps, per sequence, the last inputs of its short causal convolution and a recurrent matrix.
The tensors live here, one row per slot; which sequence holds which slot is
`llm_service.hybrid.state_slots.StateSlotManager`'s business (ids only).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field

import torch

from llm_service.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateSpec:
    """What one state layer keeps per sequence.

    `conv_shape` `(channels, width)`: the last `width` inputs of its causal convolution (kernel
    size - 1), in the model dtype. `recurrent_shape`: its recurrent state (Gated-DeltaNet:
    `(value heads, key dim, value dim)`), in `recurrent_dtype` (float32, as `transformers` keeps it).
    """

    layer_idx: int
    conv_shape: tuple[int, int]
    recurrent_shape: tuple[int, ...]
    recurrent_dtype: torch.dtype = torch.float32

    def nbytes(self, dtype: torch.dtype) -> int:
        recurrent = math.prod(self.recurrent_shape) * self.recurrent_dtype.itemsize
        return math.prod(self.conv_shape) * dtype.itemsize + recurrent


def slot_bytes(specs: tuple[StateSpec, ...], dtype: torch.dtype) -> int:
    """Bytes of one slot: every state layer's convolution window and recurrent state."""
    return sum(s.nbytes(dtype) for s in specs)


def resolve_config(config: EngineConfig, specs: tuple[StateSpec, ...], num_snapshots: int = 0) -> EngineConfig:
    """`config` as a model with state layers `specs` can run it (unchanged without any): prefix
    caching only with state snapshots (a cached KV block alone cannot restore the recurrent state
    of its prefix; `num_snapshots` rows fit the budget, `StatePool` logs them), CUDA decode graphs
    off (they do not capture the state updates). Says so in the log."""
    if not specs:
        return config
    layers = [s.layer_idx for s in specs]
    prefix_caching = config.enable_prefix_caching and num_snapshots > 0
    if config.enable_prefix_caching and not prefix_caching:
        logger.info("prefix caching is off: linear-attention layers %s keep a recurrent state per sequence "
                    "that cached KV blocks cannot restore, and no state snapshot fits (state_snapshot_share "
                    "%s, num_state_snapshots %s)", layers, config.state_snapshot_share, config.num_state_snapshots)
    if config.cuda_graphs:
        logger.info("CUDA decode graphs are off: they do not capture the recurrent-state updates of "
                    "linear-attention layers %s (decode runs eagerly)", layers)
    return dataclasses.replace(config, enable_prefix_caching=prefix_caching, cuda_graphs=False)


class StatePool:
    """The preallocated state tensors: `conv[layer]` `(rows, channels, width)` and
    `recurrent[layer]` `(rows, *recurrent_shape)`, keyed by decoder layer index. Rows
    `0 .. num_slots - 1` are the running sequences' slots; the `num_snapshots` rows after them
    hold state snapshots (`llm_service.hybrid.state_snapshots`), copied from and into slots."""

    def __init__(self, specs: tuple[StateSpec, ...], num_slots: int, dtype: torch.dtype, device: torch.device,
                 num_snapshots: int = 0):
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        rows = num_slots + num_snapshots
        self.conv = {s.layer_idx: torch.zeros(rows, *s.conv_shape, dtype=dtype, device=device) for s in specs}
        self.recurrent = {s.layer_idx: torch.zeros(rows, *s.recurrent_shape, dtype=s.recurrent_dtype,
                                                   device=device) for s in specs}
        self.row_bytes = slot_bytes(specs, dtype)
        logger.info("recurrent state: %d slots (%d linear-attention layers, %.1f MiB on %s): at most %d "
                    "sequences run at once", num_slots, len(specs), num_slots * self.row_bytes / 2**20, device,
                    num_slots)
        if num_snapshots:
            logger.info("prefix caching with state snapshots: %d snapshots of %.1f KiB (%.1f MiB on %s) at "
                        "prompt block boundaries (system prompt, media items, prompt end)", num_snapshots,
                        self.row_bytes / 2**10, self.snapshot_bytes / 2**20, device)

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.row_bytes

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the rows of `slots` (sequences that start from their first token)."""
        for t in (*self.conv.values(), *self.recurrent.values()):
            t.index_fill_(0, slots, 0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows `dst` take the contents of rows `src` (`dst` distinct, disjoint from `src`):
        a slot saved to a snapshot, or a snapshot restored into a slot."""
        for t in (*self.conv.values(), *self.recurrent.values()):
            t.index_copy_(0, dst, t.index_select(0, src))


@dataclass
class StateBatch:
    """One step's view of the pool: the slot of each scheduled sequence, in packing order, and
    how many tokens each brings (`q_lens`, host ints: the packed rows of sequence i are
    `cu_seqlens[i]:cu_seqlens[i + 1]`). State layers read their rows at `slots` and write them
    back. `layouts` caches index tensors derived from `q_lens`, shared by every layer of the step."""

    pool: StatePool
    slots: torch.Tensor  # (B,) int64 on the pool's device
    q_lens: tuple[int, ...]
    layouts: dict = field(default_factory=dict)

    @property
    def cu_seqlens(self) -> list[int]:
        return list(itertools.accumulate(self.q_lens, initial=0))
