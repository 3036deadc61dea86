"""LoRA adapters on the engine's own decoder (`llm_service.model.layers`), several in one step
(docs/lora.md#in-the-engine): q/k/v become slices of `qkv_proj`, gate/up slices of `gate_up_proj`;
within `LoraSet.step(groups)` each targeted `Linear` adds its adapters' deltas to their rows,
grouped (CPU, SDPA backend) or by slot (Triton backend: `SlotStacks`, captured by the decode graphs).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llm_service.engine.sequence import LoraRequest
from llm_service.model import layers
from llm_service.model.transfer import ints
from mmserve.lora import AdapterError, Delta, fitted_delta, read_pairs, row_groups, scaling  # noqa: F401 (tests)
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
    name = request.name
    rank, scale, pairs = read_pairs(name, request.path, tower=False)  # the vision tower's modules left to the encoder
    deltas: dict[str, list[Delta]] = {}
    for module, ab in pairs.items():
        target, out = _engine_slice(name, module, linears, rename)
        delta = fitted_delta(name, module, ab, rank, linears[target].input_size, out, scale, dtype, device)
        deltas.setdefault(target, []).append(delta)
    return Adapter(name, str(Path(request.path)), rank, scale, {k: tuple(v) for k, v in deltas.items()})


def _engine_slice(name: str, module: str, linears: dict[str, layers.Linear], rename) -> tuple[str, slice]:
    """The decoder `Linear` a checkpoint module maps to, and its output slice there."""
    if (key := rename(module + ".weight")) is None or not key.startswith("decoder."):
        raise AdapterError(f"adapter {name!r}: target {module} is neither a language-model nor a "
                           "vision-tower module")
    owner, _, leaf = key.removeprefix("decoder.").removesuffix(".weight").rpartition(".")
    if leaf not in TARGETS:
        raise AdapterError(f"adapter {name!r}: target_modules: {leaf} ({module}) is not supported "
                           f"(only {', '.join(TARGETS)})")
    for packed, parts in layers.PACKED.items():
        if leaf in parts and f"{owner}.{packed}" in linears:
            return f"{owner}.{packed}", linears[f"{owner}.{packed}"].slices()[parts.index(leaf)]
    target = f"{owner}.{leaf}"
    if target not in linears:
        raise AdapterError(f"adapter {name!r}: target {module}: the engine's decoder has no {target}")
    return target, linears[target].slices()[0]


class SlotStacks:
    """One `Linear`'s adapters by slot, for the slot kernels: `a` `(slots, S, rank, in)` and `b`
    `(slots, S, max slice, rank)` over its `S` output slices, zero where an adapter has no rank or
    no delta; `offsets` / `sizes` where the slices lie in its output."""

    def __init__(self, linear: layers.Linear, capacity: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.slices = linear.slices()
        self.max_size = max(linear.output_sizes)
        self.a = torch.zeros(capacity, len(self.slices), rank, linear.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(capacity, len(self.slices), self.max_size, rank, dtype=dtype, device=device)
        self.offsets = ints([s.start for s in self.slices], device, torch.int32)
        self.sizes = ints(list(linear.output_sizes), device, torch.int32)

    def install(self, slot: int, deltas: tuple[Delta, ...]) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for d in deltas:
            i, rank = self.slices.index(d.out), d.a.shape[0]
            self.a[slot, i, :rank].copy_(d.a)
            self.b[slot, i, :d.b.shape[0], :rank].copy_(d.b)


class LinearLoras:
    """A `Linear`'s LoRA attachment (`Linear.lora`): the deltas of each loaded adapter that targets
    it, applied to the rows of the step's groups (`LoraSet.step`); with `stacks`, by slot."""

    def __init__(self, owner: LoraSet, stacks: SlotStacks | None = None):
        self.owner, self.stacks = owner, stacks
        self.deltas: dict[str, tuple[Delta, ...]] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        if self.stacks is not None:
            if owner.launch:
                from mmserve.kernels.triton_lora import lora_shrink_expand_

                st = self.stacks
                lora_shrink_expand_(x, y, st.a, st.b, owner.scales, st.offsets, st.sizes, owner.token_slot,
                                    st.max_size)
            return y
        for name, rows in owner.active:
            if deltas := self.deltas.get(name):
                xs = x[rows]
                for d in deltas:
                    d.add_to(y, xs, rows)
        return y


class LoraSet:
    """The adapters loaded on one decoder: at most `capacity`, by name; when a new one is needed,
    the least recently used one that no request holds is dropped (`hold` / `release`). Ranks up to
    `max_rank`; `kernels`: by slot (the module docstring), `max_tokens` rows a step at most."""

    def __init__(self, decoder: nn.Module, rename, capacity: int, dtype: torch.dtype, device: torch.device,
                 max_rank: int = 16, kernels: bool = False, max_tokens: int = 0):
        self.rename, self.capacity, self.dtype, self.device = rename, capacity, dtype, device
        self.max_rank, self.kernels = max_rank, kernels
        self.linears = {n: m for n, m in decoder.named_modules() if isinstance(m, layers.Linear)}
        if not self.linears:
            raise ValueError("LoRA adapters need the engine's own decoder (Qwen2-VL, Qwen2.5-VL, dense Qwen3-VL)")
        self.active: list[tuple[str, torch.Tensor]] = []
        self.launch = False  # the slot kernels run in this forward (a step with adapters, or a graph capture)
        self.slot_of: dict[str, int] = {}
        rank = max(4, 1 << (max_rank - 1).bit_length())  # slots' rank, a power of two: the kernels' vector width
        if kernels:
            self.scales = torch.zeros(capacity, dtype=torch.float32, device=device)
            self.token_slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        for linear in self.linears.values():
            linear.lora = LinearLoras(self, SlotStacks(linear, capacity, rank, dtype, device) if kernels else None)
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self.holders: Counter[str] = Counter()
        self.ready: dict[str, Adapter] = {}  # read ahead by `prepare` (another thread), not installed yet
        self._ready_lock = threading.Lock()

    def prepare(self, request: LoraRequest) -> None:
        """From any thread: read `request`'s adapter ahead (its tensors on the device), so that
        `hold` on the engine thread only installs it. AdapterError when it does not fit."""
        if request.name not in self.loaded:
            adapter = read_adapter(request, self.linears, self.rename, self.dtype, self.device)
            with self._ready_lock:
                self.ready[request.name] = adapter

    def forget(self, name: str) -> None:
        """From any thread: drop what `prepare` read of `name` and `hold` has not installed."""
        with self._ready_lock:
            self.ready.pop(name, None)

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
            with self._ready_lock:
                adapter = self.ready.pop(request.name, None)
            if adapter is None or adapter.path != str(Path(request.path)):
                adapter = read_adapter(request, self.linears, self.rename, self.dtype, self.device)
            if adapter.rank > self.max_rank:
                raise AdapterError(f"adapter {request.name!r}: r {adapter.rank} exceeds engine.max_lora_rank "
                                   f"{self.max_rank}")
            if len(self.loaded) >= self.capacity:
                self._drop(free)
            self.loaded[request.name] = adapter
            slot = self.slot_of[request.name] = min(set(range(self.capacity)) - set(self.slot_of.values()))
            for target, linear in self.linears.items():
                if deltas := adapter.deltas.get(target, ()):
                    linear.lora.deltas[request.name] = deltas
                if linear.lora.stacks is not None:  # (a Linear the adapter leaves alone: zeros in its slot)
                    linear.lora.stacks.install(slot, deltas)
            if self.kernels:
                self.scales[slot] = adapter.scaling
        self.holders[request.name] += 1
        return True

    def release(self, name: str) -> None:
        self.holders[name] -= 1

    def _drop(self, name: str) -> None:
        for target in self.loaded.pop(name).deltas:
            del self.linears[target].lora.deltas[name]
        del self.holders[name]
        del self.slot_of[name]

    @contextmanager
    def step(self, groups: tuple[tuple[str, torch.Tensor], ...]):
        """Within it, the decoder's forward applies each group's adapter to its token rows (by slot:
        each row names its adapter's slot in `token_slot`, the others -1, as again after it)."""
        self.active[:] = groups
        if self.kernels:
            for name, rows in groups:
                self.token_slot[rows] = self.slot_of[name]
            self.launch = True
        try:
            yield
        finally:
            self.active.clear()
            if self.kernels:
                self.token_slot.fill_(-1)
                self.launch = False

    @contextmanager
    def capturing(self):
        """Within it (a decode graph's capture), the slot kernels launch whatever the rows: the graph
        replays them for any mix of adapters (`token_slot`; all -1: no delta)."""
        self.launch = True
        try:
            yield
        finally:
            self.launch = False


def token_groups(names: list[str | None], counts: list[int],
                 device: torch.device) -> tuple[tuple[str, torch.Tensor], ...]:
    """The packed step's token rows of each adapter: sequence i (`counts[i]` tokens in a row) runs
    under adapter `names[i]` (None: the base model, no group)."""
    return tuple((name, ints(rows, device)) for name, rows in row_groups(names, counts).items())
