"""LoRA adapters on the engine's own decoder (`llm_service.model.layers`), several in one step.

An adapter is a PEFT directory (`mmserve.lora` reads it, for this service and the encoder). Its
language-model module names map to the engine's as the LM face's `rename` maps the checkpoint's
keys; q/k/v become slices of `qkv_proj`, gate/up slices of `gate_up_proj`. Scaling is PEFT's:
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`. Its vision-tower modules are the
encoder's (`encoder_service.lora`): left alone here.

In a step, each token belongs to one adapter or to the base model: `LoraSet.step(groups)`
makes each targeted `Linear` add `scale * (x[rows] @ A^T) @ B^T` to its output slice for the
rows of each adapter present (one pair of GEMMs per adapter and slice: the grouped matmul of
the CPU; no CUDA kernel yet).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llm_service.engine.sequence import LoraRequest
from llm_service.model import layers
from llm_service.model.transfer import ints
from mmserve.lora import AdapterError, Delta, fitted_delta, is_tower_module, read_pairs, row_groups, scaling
from mmserve.lora import LM_TARGETS as TARGETS


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    deltas: dict[str, tuple[Delta, ...]]  # decoder module name (e.g. "layers.0.self_attn.qkv_proj") -> its deltas


def read_adapter(request: LoraRequest, linears: dict[str, layers.Linear], rename, dtype: torch.dtype,
                 device: torch.device) -> Adapter:
    """The adapter of `request.path` fitted to the decoder's `linears` (module name -> `Linear`);
    `rename`: the LM face's checkpoint key -> module key. AdapterError when it does not fit."""
    name, path = request.name, Path(request.path)
    config, pairs = read_pairs(name, path)
    rank, scale = config["r"], scaling(config)
    deltas: dict[str, list[Delta]] = {}
    for module, ab in pairs.items():
        if is_tower_module(module):  # the encoder's
            continue
        target, out = _engine_slice(name, module, linears, rename)
        delta = fitted_delta(name, module, ab, rank, linears[target].input_size, out, scale, dtype, device)
        deltas.setdefault(target, []).append(delta)
    return Adapter(name, str(path), rank, scale, {k: tuple(v) for k, v in deltas.items()})


def _engine_slice(name: str, module: str, linears: dict[str, layers.Linear], rename) -> tuple[str, slice]:
    """The decoder `Linear` a checkpoint module maps to, and its output slice there."""
    key = rename(module + ".weight")
    if key is None or not key.startswith("decoder."):
        raise AdapterError(f"adapter {name!r}: target {module} is neither a language-model nor a "
                           "vision-tower module")
    owner, _, leaf = key.removeprefix("decoder.").removesuffix(".weight").rpartition(".")
    if leaf not in TARGETS:
        raise AdapterError(f"adapter {name!r}: target_modules: {leaf} ({module}) is not supported "
                           f"(only {', '.join(TARGETS)})")
    for packed, parts in layers.PACKED.items():
        if leaf in parts and f"{owner}.{packed}" in linears:
            linear = linears[f"{owner}.{packed}"]
            return f"{owner}.{packed}", linear.slices()[parts.index(leaf)]
    target = f"{owner}.{leaf}"
    if target not in linears:
        raise AdapterError(f"adapter {name!r}: target {module}: the engine's decoder has no {target}")
    return target, linears[target].slices()[0]


class LinearLoras:
    """A `Linear`'s LoRA attachment (`Linear.lora`): the deltas of each loaded adapter that targets
    it, applied to the rows of the step's groups (`LoraSet.step`)."""

    def __init__(self, active: list):
        self.active = active  # the step's (adapter name, token rows): shared by every attachment
        self.deltas: dict[str, tuple[Delta, ...]] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for name, rows in self.active:
            if deltas := self.deltas.get(name):
                xs = x[rows]
                for d in deltas:
                    d.add_to(y, xs, rows)
        return y


class LoraSet:
    """The adapters loaded on one decoder: at most `capacity`, by name; when a new one is needed,
    the least recently used one that no request holds is dropped (`hold` / `release`)."""

    def __init__(self, decoder: nn.Module, rename, capacity: int, dtype: torch.dtype, device: torch.device):
        self.rename, self.capacity, self.dtype, self.device = rename, capacity, dtype, device
        self.linears = {n: m for n, m in decoder.named_modules() if isinstance(m, layers.Linear)}
        if not self.linears:
            raise ValueError("LoRA adapters need the engine's own decoder (Qwen2-VL, Qwen2.5-VL, dense Qwen3-VL)")
        self.active: list[tuple[str, torch.Tensor]] = []
        for linear in self.linears.values():
            linear.lora = LinearLoras(self.active)
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self.holders: Counter[str] = Counter()

    def hold(self, request: LoraRequest) -> bool:
        """Load `request`'s adapter if needed and count one more holder; False when all `capacity`
        places are held (the request waits). AdapterError for an adapter that does not fit, or a
        name already loaded from another path."""
        if (adapter := self.loaded.get(request.name)) is not None:
            if adapter.path != str(Path(request.path)):
                raise AdapterError(f"adapter {request.name!r} is loaded from {adapter.path}, not {request.path}")
            self.loaded.move_to_end(request.name)
        else:
            free = next((n for n in self.loaded if not self.holders[n]), None)
            if len(self.loaded) >= self.capacity and free is None:
                return False
            adapter = read_adapter(request, self.linears, self.rename, self.dtype, self.device)
            if len(self.loaded) >= self.capacity:
                self._drop(free)
            self.loaded[request.name] = adapter
            for target, deltas in adapter.deltas.items():
                self.linears[target].lora.deltas[request.name] = deltas
        self.holders[request.name] += 1
        return True

    def release(self, name: str) -> None:
        self.holders[name] -= 1

    def _drop(self, name: str) -> None:
        for target in self.loaded.pop(name).deltas:
            del self.linears[target].lora.deltas[name]
        del self.holders[name]

    @contextmanager
    def step(self, groups: tuple[tuple[str, torch.Tensor], ...]):
        """Within it, the decoder's forward applies each group's adapter to its token rows."""
        self.active[:] = groups
        try:
            yield
        finally:
            self.active.clear()


def token_groups(names: list[str | None], counts: list[int],
                 device: torch.device) -> tuple[tuple[str, torch.Tensor], ...]:
    """The packed step's token rows of each adapter: sequence i (`counts[i]` tokens in a row) runs
    under adapter `names[i]` (None: the base model, no group)."""
    return tuple((name, ints(rows, device)) for name, rows in row_groups(names, counts).items())
