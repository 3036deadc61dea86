"""LoRA adapters on the vision tower and merger, several in one packed forward (docs/lora.md#on-the-vision-tower):
`TowerLoras` reads an adapter's tower modules (`mmserve.lora.read_pairs`) onto the tower's `nn.Linear`s, and within
`step` a forward hook on each targeted linear adds each adapter's delta to its items' rows (`EncoderFace.lora_rows`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from cachetools import LRUCache
from torch import nn

from mmserve.lora import AdapterError, Delta, fitted_delta, read_pairs, row_groups
from mmserve.inputs.media import AdapterRef


@dataclass(frozen=True, eq=False)
class TowerAdapter:
    ref: AdapterRef
    deltas: dict[str, Delta]  # tower module name (e.g. "blocks.0.attn.qkv") -> its delta


def read_tower_adapter(ref: AdapterRef, tower: nn.Module, rename, stages: tuple[str, ...], dtype: torch.dtype,
                       device: torch.device) -> TowerAdapter:
    """The tower modules of the adapter `ref`, fitted to `tower`; `rename`: the encoder face's
    checkpoint key -> tower key; `stages`: the face's `lora_stages`. AdapterError naming the
    adapter and the field when they do not fit (an adapter without tower modules fits, empty)."""
    rank, scale, pairs = read_pairs(ref.name, ref.path, tower=True)  # the language model's modules left out
    modules = dict(tower.named_modules())
    deltas = {}
    for module, ab in pairs.items():
        if not stages:
            raise AdapterError(f"adapter {ref.name!r}: target {module}: this family's encoder applies no "
                               "vision-tower adapters (Qwen2-VL and Qwen2.5-VL do)")
        key = rename(module + ".weight")
        target = key.removesuffix(".weight") if key is not None else None
        linear = modules.get(target) if target is not None else None
        if not isinstance(linear, nn.Linear) or not target.startswith(stages):
            what = "has no such module" if linear is None else f"has it as a {type(linear).__name__}, not a linear"
            raise AdapterError(f"adapter {ref.name!r}: target_modules: {module}: the vision tower {what} "
                               f"(LoRA applies to the linears under {', '.join(stages)})")
        deltas[target] = fitted_delta(ref.name, module, ab, rank, linear.in_features,
                                      slice(0, linear.out_features), scale, dtype, device)
    return TowerAdapter(ref, deltas)


class TowerLoras:
    """The adapters read for one tower: at most `capacity` (the least recently used dropped), by
    `AdapterRef`. `get` is thread-safe (preprocessing threads check an item's adapter early);
    `step` runs on the forward's thread, under the encoder's lock."""

    def __init__(self, tower: nn.Module, rename, stages: tuple[str, ...], capacity: int, dtype: torch.dtype,
                 device: torch.device):
        self.tower, self.rename, self.stages = tower, rename, stages
        self.capacity, self.dtype, self.device = capacity, dtype, device
        self.loaded: LRUCache[AdapterRef, TowerAdapter] = LRUCache(maxsize=capacity)
        self._lock = threading.Lock()
        self._hooked: set[str] = set()
        self._active: dict[str, list[tuple[TowerAdapter, torch.Tensor]]] = {}  # stage -> (adapter, rows)

    def get(self, ref: AdapterRef) -> TowerAdapter:
        """`ref`'s adapter, read on first use; AdapterError when it does not fit the tower."""
        with self._lock:
            if (adapter := self.loaded.get(ref)) is not None:  # now the most recently used
                return adapter
        adapter = read_tower_adapter(ref, self.tower, self.rename, self.stages, self.dtype, self.device)
        with self._lock:
            self.loaded[ref] = adapter
        return adapter

    @contextmanager
    def step(self, refs: Sequence[AdapterRef | None], rows: dict[str, Sequence[int]]):
        """Within it, the tower's forward applies item i's adapter `refs[i]` (None: none) to its
        rows: `rows[stage][i]` rows in a row at each stage of the packed forward."""
        adapters = [None if ref is None else self.get(ref) for ref in refs]
        for adapter in adapters:
            for target in (adapter.deltas if adapter is not None else ()):
                self._hook(target)
        for stage, counts in rows.items():
            groups = row_groups(adapters, counts)
            self._active[stage] = [(adapter, torch.tensor(r, dtype=torch.long, device=self.device))
                                   for adapter, r in groups.items() if adapter.deltas]
        try:
            yield
        finally:
            self._active.clear()

    def _hook(self, target: str) -> None:
        if target in self._hooked:
            return
        stage = next(s for s in self.stages if target.startswith(s))

        def add_deltas(module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
            for adapter, rows in self._active.get(stage, ()):
                if (delta := adapter.deltas.get(target)) is not None:
                    delta.add_to(y, args[0][rows], rows)
            return y

        self.tower.get_submodule(target).register_forward_hook(add_deltas)
        self._hooked.add(target)
