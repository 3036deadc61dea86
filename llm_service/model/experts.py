"""The engine's mixture-of-experts path (docs/attention.md#mixture-of-experts): the experts of
every MoE layer run here, not in `transformers`' per-expert loop. `install(decoder)` binds
`experts_forward` onto each experts module (`gate_up_proj` `(E, 2I, H)`, `down_proj` `(E, H, I)`);
the family's router and shared expert stay its own code around that call. Quantized experts
(`quantized.ExpertsWeights`) are dequantized per expert on CPU, whole on CUDA. `PerExpertLoader`
writes a checkpoint's per-expert tensors into their slices of the stacked ones as they are read.
"""

from __future__ import annotations

import re
import threading
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from llm_service.model.layers import PACKED_DIM
from llm_service.model.quantized import EXPERT_PARTS, ExpertsWeights, _submodule

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_experts(module: nn.Module) -> bool:
    """A `transformers` 5 experts module in the layout this path runs (gate and up concatenated,
    not transposed, no biases; dense or quantized)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    stacked = (torch.Tensor, ExpertsWeights)
    return (isinstance(gate_up, stacked) and isinstance(down, stacked) and len(gate_up.shape) == 3
            and len(down.shape) == 3 and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False) and getattr(module, "is_concatenated", True))


def install(decoder: nn.Module, triton: bool = False) -> list[nn.Module]:
    """Bind `experts_forward` onto every experts module of `decoder` (after its weights are loaded
    and moved); `triton`: on CUDA, the fused kernel for the modules `torch._grouped_mm` cannot take
    (it measured faster where it runs: one Qwen3-VL-30B-A3B layer in bf16 on an H200, 0.53 vs 0.72 ms
    at batch 1, 0.60 vs 0.73 ms at 64, `bench/llm.py --moe`). Returns the modules, layer order."""
    modules = [m for m in decoder.modules() if is_experts(m)]
    for m in modules:
        m.forward = types.MethodType(experts_forward, m)
        device = next(m.parameters()).device
        m.register_buffer("load", torch.zeros(m.gate_up_proj.shape[0], dtype=torch.int64, device=device),
                          persistent=False)
        quantized = isinstance(m.gate_up_proj, ExpertsWeights)  # dequantized whole on CUDA: the fused kernel
        m.use_triton = triton and device.type == "cuda" and (quantized or not grouped_mm_runs(m.gate_up_proj,
                                                                                               m.down_proj))
    return modules


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`order` `(T*k,)`: the flat (token, slot) pairs sorted by expert (stable: token order within
    an expert); `counts` `(E,)` int64: pairs per expert. Device-side, no host sync."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return order, counts.scatter_add_(0, flat, torch.ones_like(flat))


def gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's own activation of `(S, 2I)` gate/up rows -> `(S, I)`."""
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    g, u = gate_up.chunk(2, dim=-1)
    return module.act_fn(g) * u


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """sum over k of `top_k_weights[t, k] * expert[top_k_index[t, k]](hidden_states[t])`, `(T, H)`."""
    num_tokens, top_k = top_k_index.shape
    gate_up_w, down_w = self.gate_up_proj, self.down_proj
    if isinstance(gate_up_w, ExpertsWeights) and (self.use_triton or hidden_states.is_cuda):
        # no quantized grouped GEMM yet: the layer's experts dequantized whole, without a host sync
        gate_up_w, down_w = gate_up_w.dense(hidden_states.dtype), down_w.dense(hidden_states.dtype)
    if self.use_triton:  # it sorts and pads the pairs itself
        from mmserve.kernels.triton_moe import fused_experts

        self.load.scatter_add_(0, top_k_index.reshape(-1), torch.ones_like(top_k_index.reshape(-1)))
        return fused_experts(hidden_states, gate_up_w, down_w, top_k_index, top_k_weights,
                             lambda gate_up: gate(self, gate_up))
    order, counts = route(top_k_index, gate_up_w.shape[0])
    self.load.add_(counts)
    rows = grouped(self, hidden_states[order // top_k], counts, gate_up_w, down_w)  # (T*k, H), sorted by expert
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    weighted = rows.to(acc) * top_k_weights.reshape(-1)[order, None].to(acc)
    pairs = torch.empty_like(weighted)
    pairs[order] = weighted
    return pairs.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def grouped(module: nn.Module, x: torch.Tensor, counts: torch.Tensor, gate_up_w: torch.Tensor | ExpertsWeights,
            down_w: torch.Tensor | ExpertsWeights) -> torch.Tensor:
    """Each expert's two GEMMs over its run of the expert-sorted rows `x` `(S, H)`; quantized
    weights: each expert that has rows dequantized into `x`'s dtype for its GEMMs."""
    if isinstance(gate_up_w, torch.Tensor) and x.dtype == gate_up_w.dtype and grouped_mm_runs(gate_up_w, down_w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = gate(module, torch._grouped_mm(x, gate_up_w.transpose(1, 2), offs=offsets))
        return torch._grouped_mm(h, down_w.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], down_w.shape[1])
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            h = gate(module, F.linear(x[rows], _one(gate_up_w, expert, x.dtype)))
            out[rows] = F.linear(h, _one(down_w, expert, x.dtype))
            start += n
    return out


def _one(stacked: torch.Tensor | ExpertsWeights, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight `(out, in)`: a view of a dense stack, a quantized one's dequantized."""
    return stacked.dense(dtype, expert) if isinstance(stacked, ExpertsWeights) else stacked[expert]


def grouped_mm_runs(gate_up_w: torch.Tensor, down_w: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes these weights: float32/bf16/fp16 (on CUDA bf16 from Hopper on) with
    row strides of whole 16-byte units."""
    dtype = gate_up_w.dtype
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_MM_DTYPES:
        return False
    if gate_up_w.is_cuda and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(gate_up_w.device)[0] < 9):
        return False
    size = gate_up_w.element_size()
    return all(d * size % 16 == 0 for d in (gate_up_w.shape[1], gate_up_w.shape[2], down_w.shape[1]))


_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
                         r"\.(?P<attr>\w+)$")


class PerExpertLoader:
    """A `load_weights` `convert` step (`mmserve.checkpoint`) for checkpoints that store one
    projection per expert: `<experts>.<j>.gate_proj.weight`, `up_proj`, `down_proj` (module keys,
    as the face renames them), and a quantized format's companions (`weight_scale_inv`, `qweight`,
    `qzeros`, `scales`, ...). Each tensor is written into its slice of the experts module's stacked
    tensor as it is read (expert `j`; gate then up along the output dimension of `gate_up_proj`, the
    columns of AWQ's `(in, out)` tensors), and the stacked tensor is handed to the loader once every
    expert's part is in: a layer's experts are never held twice."""

    def __init__(self, modules: nn.Module):
        self.modules = modules
        self.filled: dict[str, set[tuple[int, str]]] = {}  # stacked tensor -> (expert, part) written

    def __call__(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        made = {}
        for key in list(waiting):
            found = _PER_EXPERT.match(key)
            place = found and self._place(found)
            if not place:
                continue  # not a per-expert tensor, or no place for it: the loader names what is left
            name, target = place
            tensor, expert, part = waiting.pop(key), int(found["expert"]), found["part"]
            parts = next(members for members in EXPERT_PARTS.values() if part in members)
            dim = PACKED_DIM.get(found["attr"], 0)  # the output dimension of one expert's tensor
            expected = list(target.shape[1:])
            expected[dim] //= len(parts)
            if expert >= target.shape[0] or list(tensor.shape) != expected:
                raise ValueError(f"checkpoint tensor for {key} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(expected)} for each of {target.shape[0]} experts: does config.json match "
                                 "the weights?")
            if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1 and target.dtype != tensor.dtype:
                raise ValueError(f"checkpoint tensor for {key} is {tensor.dtype}, which this model holds in "
                                 f"{target.dtype}: its values mean nothing without their scales")
            with torch.no_grad():
                target[expert].narrow(dim, parts.index(part) * expected[dim], expected[dim]).copy_(tensor)
            filled = self.filled.setdefault(name, set())
            filled.add((expert, part))
            if len(filled) == target.shape[0] * len(parts):
                made[name] = target
                del self.filled[name]
        return made

    def _place(self, found: re.Match) -> tuple[str, torch.Tensor] | None:
        """(module key, tensor) of the stacked tensor a per-expert tensor goes into."""
        stacked = next(s for s, members in EXPERT_PARTS.items() if found["part"] in members)
        held = getattr(_submodule(self.modules, found["experts"]), stacked, None)  # None: nothing to place
        if isinstance(held, ExpertsWeights):
            target, name = getattr(held, found["attr"], None), f"{found['experts']}.{stacked}.{found['attr']}"
        else:
            target, name = held if found["attr"] == "weight" else None, f"{found['experts']}.{stacked}"
        return (name, target) if isinstance(target, torch.Tensor) and target.dim() == 3 else None


class ExpertLoad:
    """Tokens per expert of a decoder's MoE layers, for the load-balance metrics.

    The engine thread calls `collect` after reading a step's sampled ids: at most every
    `interval_s` it copies the modules' counters to the host (one small copy, which waits for the
    step in flight) and zeroes them. Any thread `drain`s what was collected. Rows that pad a batch
    to a captured graph's size are routed and counted too."""

    def __init__(self, modules: list[nn.Module], interval_s: float = 1.0):
        self.modules, self.interval_s = modules, interval_s
        self._lock = threading.Lock()
        self._counts: torch.Tensor | None = None
        self._forwards = self._forwards_seen = 0
        self._last = time.monotonic()

    def collect(self, num_forwards: int, force: bool = False) -> None:
        """Engine thread: add the counters to the host tally (`num_forwards`: the runner's count so far)."""
        if not self.modules or (not force and time.monotonic() - self._last < self.interval_s):
            return
        self._last = time.monotonic()
        counts = torch.stack([m.load for m in self.modules]).cpu()
        self.reset()
        with self._lock:
            self._counts = counts if self._counts is None else self._counts + counts
            self._forwards += num_forwards - self._forwards_seen
            self._forwards_seen = num_forwards

    def drain(self) -> tuple[torch.Tensor, int] | None:
        """`(layers, E)` tokens per expert and the forwards they came from, since the last drain;
        None: nothing collected (or no MoE layer)."""
        with self._lock:
            if self._counts is None:
                return None
            out, self._counts, self._forwards = (self._counts, self._forwards), None, 0
        return out

    def reset(self, num_forwards: int | None = None) -> None:
        """Zero the device counters (`num_forwards`: also restart the forward count there, after a warm-up)."""
        for m in self.modules:
            m.load.zero_()
        if num_forwards is not None:
            with self._lock:
                self._counts, self._forwards, self._forwards_seen = None, 0, num_forwards


def imbalance(counts: torch.Tensor) -> float:
    """max over mean tokens per expert, of the worst layer (1.0: perfectly even; 0.0: no tokens)."""
    per_layer = counts.float()
    mean = per_layer.mean(dim=1)
    busy = mean > 0
    return float((per_layer.max(dim=1).values[busy] / mean[busy]).max()) if busy.any() else 0.0
