"""Quantized weight formats of the engine's `layers.Linear`, read as the checkpoints are published
(docs/quantization.md): `read_format` finds the format in `config.json`'s `quantization_config`
(top level, or its `text_config`); each is a `WeightFormat` (`BlockFP8`, `ChannelFP8`, `AWQ`).
A MoE layer's experts are held as `ExpertsWeights` of the same format.
"""

from __future__ import annotations

import math
import re
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llm_service.model import layers, quantized_gemm
from mmserve.checkpoint import StoredTensor, read_config, safetensors_files, stored_tensors

FP8 = torch.float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the 4 bits at 4*i of an int32 hold column AWQ_ORDER[i] of its 8
_AWQ_SHIFTS = torch.tensor([4 * AWQ_ORDER.index(column) for column in range(8)], dtype=torch.int32)


class WeightFormat(ABC):
    """One quantized weight format of `layers.Linear`. A format reads the checkpoint's headers
    (`quantized_tensors`), gives a `Linear` the tensors it stores (`convert`) and computes with
    them (`forward`); `name` is what `GET /v1/models` and the load log say."""

    label: str  # the kind of tensor in error messages ("FP8")
    out_multiple: int = 1  # a packed projection's slices are multiples of this many output rows ...
    out_reason: str = ""  # ... because of this

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def quantized_tensors(self, stored: dict[str, StoredTensor]) -> list[str]:
        """Keys of the main stored tensor of each quantized projection (`...q_proj.weight`,
        `...q_proj.qweight`), each checked against its companions' presence and shapes; a
        ValueError naming the tensor otherwise."""

    @abstractmethod
    def params(self, out: int, inp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors a `Linear` of `(out, in)` holds: attribute -> (shape, dtype)."""

    @abstractmethod
    def dense(self, linear: layers.Linear, dtype: torch.dtype) -> torch.Tensor:
        """`linear`'s weight `(out, in)` in `dtype`, computed in float32 (or `dtype` if wider); any
        object holding the `params` tensors will do, with leading dimensions (`(E, out, in)` for
        an `ExpertsWeights`)."""

    def gemm(self, linear: layers.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """The format's GEMM on the stored tensors (`quantized_gemm`); None where none takes `x`."""
        return None

    def forward(self, linear: layers.Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(linear, x)
        return F.linear(x, self.dense(linear, x.dtype), linear.bias) if y is None else y

    def convert(self, name: str, linear: layers.Linear, device: torch.device) -> None:
        """Give `linear` (named `name`) empty tensors of this format to load into."""
        sizes = linear.output_sizes
        if len(sizes) > 1 and any(size % self.out_multiple for size in sizes):
            raise ValueError(f"{name}: its packed slices {sizes} are not whole {self.out_reason}")
        out, inp = linear.weight.shape
        linear.weight = None  # a format that stores a `weight` sets it again below
        for attr, (shape, dtype) in self.params(out, inp).items():
            setattr(linear, attr, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
        linear.quantization = self


class _FP8(WeightFormat):
    """An e4m3 `weight` `(out, in)` and float32 scales (`scale_name`) of `scale_shape`."""

    label = "FP8"
    scale_name: str
    scale_rule: str  # how the scale's shape follows from the weight's, for errors

    @abstractmethod
    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]: ...

    def params(self, out, inp):
        return {"weight": ((out, inp), FP8), self.scale_name: (self.scale_shape((out, inp)), torch.float32)}

    def quantized_tensors(self, stored):
        found = []
        for key, tensor in stored.items():
            base = key.rpartition(".")[0]
            if key.endswith("." + self.scale_name) and stored.get(base + ".weight", tensor).dtype != FP8:
                raise ValueError(f"checkpoint tensor {key} scales no F8_E4M3 weight {base}.weight")
            if tensor.dtype not in (FP8, torch.float8_e5m2):
                continue
            scale = stored.get(f"{base}.{self.scale_name}")
            if tensor.dtype != FP8 or not key.endswith(".weight") or len(tensor.shape) != 2:
                raise ValueError(f"checkpoint tensor {key} ({tensor.dtype}, {tensor.shape}) is not an "
                                 f"e4m3 weight (out, in) with {self.scale_name}")
            if scale is None:
                raise ValueError(f"checkpoint tensor {key} is F8_E4M3 but the checkpoint has no "
                                 f"{base}.{self.scale_name}")
            if scale.shape != self.scale_shape(tensor.shape):
                raise ValueError(f"checkpoint tensor {base}.{self.scale_name} has shape {scale.shape}; the weight "
                                 f"{tensor.shape} {self.scale_rule} needs {self.scale_shape(tensor.shape)}")
            found.append(key)
        return found


@dataclass(frozen=True)
class BlockFP8(_FP8):
    """Block-scaled FP8: `block` = (rows, columns) of the weight one scale covers."""

    block: tuple[int, int]
    scale_name = "weight_scale_inv"

    @property
    def name(self) -> str:
        return f"fp8 (e4m3, {self.block[0]}x{self.block[1]} blocks)"

    @property
    def out_multiple(self) -> int:
        return self.block[0]

    @property
    def out_reason(self) -> str:
        return (f"blocks of weight_block_size[0]={self.block[0]} rows: the scale grids of its parts cannot "
                "be concatenated")

    @property
    def scale_rule(self) -> str:
        return f"in blocks {list(self.block)} (weight_block_size)"

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a weight of `shape` `(out, in)`."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    scale_shape = grid

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (e4m3, `(..., out, in)`) x each block's `scale`, computed in float32 (or `dtype`
        if wider), in `dtype`."""
        wide = torch.promote_types(dtype, torch.float32)
        (rows, cols), cols_per_block = weight.shape[-2:], self.block[1]
        per_row = scale.to(wide).repeat_interleave(self.block[0], -2)[..., :rows, :]  # (..., rows, column blocks)
        out, whole = weight.to(wide), cols // cols_per_block * cols_per_block
        out[..., :whole].unflatten(-1, (-1, cols_per_block)).mul_(per_row[..., :whole // cols_per_block, None])
        out[..., whole:].mul_(per_row[..., -1:])  # a partial last column block
        return out.to(dtype)

    def dense(self, linear, dtype):
        return self.dequantize(linear.weight, linear.weight_scale_inv, dtype)

    def gemm(self, linear, x):
        return quantized_gemm.block_fp8(linear, x, self.block)


@dataclass(frozen=True)
class ChannelFP8(_FP8):
    """Per-output-channel FP8 (compressed-tensors `float-quantized`, strategy `channel`)."""

    scale_name = "weight_scale"
    scale_rule = "(one scale per output channel)"

    @property
    def name(self) -> str:
        return "compressed-tensors fp8 (e4m3, per-channel weights, dynamic per-token activations)"

    def scale_shape(self, shape):
        return shape[0], 1

    def dense(self, linear, dtype):
        wide = torch.promote_types(dtype, torch.float32)
        return (linear.weight.to(wide) * linear.weight_scale.to(wide)).to(dtype)

    def gemm(self, linear, x):
        return quantized_gemm.channel_fp8(linear, x)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 `(rows, cols)` holding eight 4-bit values each (`AWQ_ORDER`) -> `(rows, 8 cols)` int32 in 0..15."""
    return ((packed.unsqueeze(-1) >> _AWQ_SHIFTS.to(packed.device)) & 0xF).flatten(-2)


@dataclass(frozen=True)
class AWQ(WeightFormat):
    """AWQ int4 (GEMM layout) with zero points: weight[in, out] = (q - z) * s per group of input rows."""

    group_size: int
    label = "AWQ int4"
    out_multiple = 8
    out_reason = "groups of 8 output columns (eight 4-bit values per int32)"

    @property
    def name(self) -> str:
        return f"awq (int4, groups of {self.group_size}, zero points)"

    def params(self, out, inp):
        groups, words = inp // self.group_size, out // 8
        return {"qweight": ((inp, words), torch.int32), "qzeros": ((groups, words), torch.int32),
                "scales": ((groups, out), torch.float16)}

    def quantized_tensors(self, stored):
        found = []
        for key, tensor in stored.items():
            base, _, param = key.rpartition(".")
            if param == "qzeros" and base + ".qweight" not in stored:
                raise ValueError(f"checkpoint tensor {key} belongs to no qweight {base}.qweight")
            if param != "qweight":
                continue
            if tensor.dtype != torch.int32 or len(tensor.shape) != 2:
                raise ValueError(f"checkpoint tensor {key} ({tensor.dtype}, {tensor.shape}) is not an int32 "
                                 "(in, out/8)")
            inp, out = tensor.shape[0], tensor.shape[1] * 8
            if inp % self.group_size:
                raise ValueError(f"checkpoint tensor {key} has {inp} input rows, not whole groups of "
                                 f"group_size={self.group_size}")
            for name, (shape, dtype) in list(self.params(out, inp).items())[1:]:  # qzeros, scales
                if (part := stored.get(f"{base}.{name}")) is None:
                    raise ValueError(f"checkpoint tensor {key} is AWQ int4 but the checkpoint has no {base}.{name}")
                if (part.shape, part.dtype) != (shape, dtype):
                    raise ValueError(f"checkpoint tensor {base}.{name} is {part.dtype} {part.shape}; the qweight "
                                     f"{tensor.shape} in groups of {self.group_size} (group_size) needs "
                                     f"{dtype} {shape}")
            found.append(key)
        return found

    def dense(self, linear, dtype):
        wide = torch.promote_types(dtype, torch.float32)
        g = self.group_size
        zeros = unpack_int4(linear.qzeros).repeat_interleave(g, -2)
        scales = linear.scales.to(wide).repeat_interleave(g, -2)
        weight = ((unpack_int4(linear.qweight) - zeros).to(wide) * scales).transpose(-1, -2)
        return weight.to(dtype).contiguous()  # (out, in) rows, as a dense checkpoint's weight: the same GEMM

    def gemm(self, linear, x):
        return quantized_gemm.awq(linear, x, self.group_size)


class ExpertsWeights(nn.Module):
    """One stacked projection of a MoE layer's experts (`gate_up_proj`: each expert's gate | up
    rows, or `down_proj`) in a format: the tensors a `Linear` of `(out, in)` holds in it, each with
    a leading experts dimension (block FP8: `weight` `(E, out, in)` e4m3, `weight_scale_inv`
    `(E, out/bo, in/bi)`; AWQ: `qweight` `(E, in, out/8)`, ...). `shape`: the dense tensor's,
    `(E, out, in)`."""

    def __init__(self, fmt: WeightFormat, num_experts: int, out: int, inp: int, device: torch.device):
        super().__init__()
        for attr, (shape, dtype) in fmt.params(out, inp).items():
            setattr(self, attr, nn.Parameter(torch.empty((num_experts, *shape), dtype=dtype, device=device),
                                             requires_grad=False))
        self.quantization = fmt
        self.shape = (num_experts, out, inp)

    def dense(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """Expert `expert`'s weight `(out, in)` in `dtype` (its slices dequantized), or every
        expert's `(E, out, in)`."""
        one = self if expert is None else types.SimpleNamespace(
            **{attr: p[expert] for attr, p in self.named_parameters(recurse=False)})
        return self.quantization.dense(one, dtype)


def read_format(model_dir: str | Path) -> WeightFormat | None:
    """The checkpoint's weight format: None for a dense one; a ValueError naming the field for
    one mmserve does not read."""
    config = read_config(model_dir)
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    readers = {"fp8": _read_block_fp8, "compressed-tensors": _read_compressed_tensors, "awq": _read_awq}
    if method not in readers:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported: mmserve reads "
                         "'fp8' (block-scaled e4m3), 'compressed-tensors' (per-channel FP8) and 'awq' (int4 GEMM)")
    return readers[method](q)


def _require(q: dict, field: str, allowed, default=None, where: str = "quantization_config") -> None:
    value = q.get(field, default)
    if value not in allowed:
        raise ValueError(f"{where}.{field} {value!r} is not supported: mmserve reads "
                         f"{' or '.join(repr(a) for a in allowed)}")


def _read_block_fp8(q: dict) -> BlockFP8:
    _require(q, "fmt", ("e4m3",), "e4m3")
    _require(q, "activation_scheme", ("dynamic",), "dynamic")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not two positive integers "
                         "(per-tensor FP8 is not supported)")
    return BlockFP8(tuple(block))


def _read_compressed_tensors(q: dict) -> ChannelFP8:
    _require(q, "format", ("float-quantized",))
    _require(q, "quantization_status", ("compressed",))
    if not (isinstance(groups := q.get("config_groups"), dict) and groups):
        raise ValueError(f"quantization_config.config_groups {groups!r} names no quantization scheme")
    for group, scheme in groups.items():
        where = f"quantization_config.config_groups.{group}"
        weights, inputs = scheme.get("weights") or {}, scheme.get("input_activations")
        for field, allowed in (("num_bits", (8,)), ("type", ("float",)), ("strategy", ("channel",)),
                               ("symmetric", (True,)), ("dynamic", (False,))):
            _require(weights, field, allowed, where=where + ".weights")
        _require(scheme, "format", ("float-quantized", None), where=where)
        if inputs is not None:  # activations quantized at run time (no stored input_scale)
            _require(inputs, "dynamic", (True,), where=where + ".input_activations")
        if scheme.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations is set: mmserve does not quantize outputs")
    return ChannelFP8()


def _read_awq(q: dict) -> AWQ:
    _require(q, "bits", (4,))
    _require(q, "version", ("gemm", "GEMM"))
    _require(q, "zero_point", (True,))
    if not (isinstance(group := q.get("group_size"), int) and group > 0):
        raise ValueError(f"quantization_config.group_size {group!r} is not a positive integer")
    return AWQ(group)


# a MoE layer's experts as the checkpoints store them: one projection per expert
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)$")
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # stacked -> parts, in order


def quantize_modules(modules: nn.Module, model_dir: str | Path, rename, fmt: WeightFormat, device: torch.device) -> int:
    """Turn the `layers.Linear`s of `modules` whose checkpoint weights are quantized into ones of
    `fmt`, and the experts of a MoE layer whose per-expert weights are into `ExpertsWeights`,
    then give every parameter still on the meta device (`tensor_parallel.parameters_on_meta`)
    storage on `device`; returns how many were converted. A `transformers` `nn.Linear` whose name
    `modules.engine_linears` (a regular expression) matches becomes a `layers.Linear` first. A
    quantized tensor with no quantized place (a module the family runs in `transformers`' own
    layers, a packed projection or a MoE layer with some parts dense) is refused here, before
    anything is read."""
    stored = {t.key: t for file in safetensors_files(Path(model_dir)) for t in stored_tensors(file)}
    parts: dict[str, list[str]] = {}  # module name -> its checkpoint tensors stored quantized
    experts: dict[str, dict[tuple[int, str], str]] = {}  # experts module -> (expert, part) -> its tensor
    for key in sorted(fmt.quantized_tensors(stored)):
        name = rename(key.rpartition(".")[0] + ".weight")  # the module's name, as its dense weight's
        if name is None:
            continue
        if per_expert := _PER_EXPERT.match(name.removesuffix(".weight")):
            experts.setdefault(per_expert["experts"], {})[int(per_expert["expert"]), per_expert["part"]] = key
            continue
        owner, _, module = name.removesuffix(".weight").rpartition(".")
        packed = next((p for p, members in layers.PACKED.items() if module in members), module)
        if _submodule(modules, f"{owner}.{packed}".lstrip(".")) is None:
            packed = module  # `transformers`' layers: q_proj, k_proj, ... each a module
        parts.setdefault(f"{owner}.{packed}".lstrip("."), []).append(key)
    for name, keys in parts.items():
        if (linear := _engine_linear(modules, name)) is None:
            raise ValueError(f"checkpoint tensor {keys[0]} is {fmt.label}, but mmserve runs {name} in full precision "
                             f"only ({fmt.label} weights go to the engine's own decoder layers)")
        if len(keys) != len(linear.output_sizes):
            raise ValueError(f"{name} packs {len(linear.output_sizes)} projections but only {sorted(keys)} are "
                             f"{fmt.label} in the checkpoint: a packed projection is all quantized or all dense")
        try:
            fmt.convert(name, linear, device)
        except ValueError as e:
            raise ValueError(f"{e} (checkpoint tensors {', '.join(sorted(keys))})") from None
    for name, keys in experts.items():
        _quantize_experts(modules, name, keys, fmt, device)
    from llm_service.model.tensor_parallel import materialize

    materialize(modules, None, device)
    return len(parts) + len(experts)


def _engine_linear(modules: nn.Module, name: str) -> layers.Linear | None:
    """The engine's `Linear` at `name`: the one there, or one put in place of a `transformers`
    `nn.Linear` the modules allow (`engine_linears`); None otherwise."""
    if isinstance(module := _submodule(modules, name), layers.Linear):
        return module
    allowed = getattr(modules, "engine_linears", None)
    if type(module) is not nn.Linear or not allowed or not re.fullmatch(allowed, name):
        return None
    with torch.device("meta"):  # storage comes with the format's tensors (`convert`) or the meta pass after
        linear = layers.Linear(module.in_features, (module.out_features,), module.bias is not None, module.weight.dtype)
    owner, _, attr = name.rpartition(".")
    setattr(modules.get_submodule(owner), attr, linear)
    return linear


def _quantize_experts(modules: nn.Module, name: str, keys: dict[tuple[int, str], str], fmt: WeightFormat,
                      device: torch.device) -> None:
    """The experts module `name`'s stacked projections as `ExpertsWeights` of `fmt`; `keys`: its
    quantized checkpoint tensors, by (expert, part), all of them or a refusal."""
    first = keys[min(keys)]
    module = _submodule(modules, name)
    stacked = {s: getattr(module, s, None) for s in EXPERT_PARTS}
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in stacked.values()):
        raise ValueError(f"checkpoint tensor {first} is {fmt.label}, but {name} is no MoE layer's experts "
                         "(gate_up_proj (E, 2I, H), down_proj (E, H, I)) mmserve runs")
    num_experts = stacked["gate_up_proj"].shape[0]
    for j in range(num_experts):
        for part in (p for members in EXPERT_PARTS.values() for p in members):
            if (j, part) not in keys:
                raise ValueError(f"{name}: expert {j}'s {part} is not {fmt.label} in the checkpoint but {first} is: "
                                 "a layer's experts are all quantized or all dense")
    inter = stacked["gate_up_proj"].shape[1] // 2
    if inter % fmt.out_multiple:
        raise ValueError(f"{name}.gate_up_proj: its packed slices ({inter}, {inter}) are not whole "
                         f"{fmt.out_reason} (checkpoint tensors {first}, ...)")
    for attr, tensor in stacked.items():
        delattr(module, attr)
        setattr(module, attr, ExpertsWeights(fmt, *tensor.shape, device))


def _submodule(modules: nn.Module, name: str) -> nn.Module | None:
    try:
        return modules.get_submodule(name)
    except AttributeError:
        return None
