"""Block-scaled FP8 weights: the `quant_method: "fp8"` checkpoints Qwen publishes (`-FP8` releases).

`config.json` (top level, or its `text_config`) holds
`quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [bo, bi], "modules_to_not_convert": [...]}`. Each converted projection is
stored as an `F8_E4M3` `weight` `(out, in)` and a `weight_scale_inv` `(ceil(out/bo), ceil(in/bi))`:
stored value x its block's scale = the weight (edge blocks may be partial). Which projections are
converted is read from the file: a weight stored in F8_E4M3 is one (the writer followed
`modules_to_not_convert`: vision tower, lm_head), anything else is loaded as it is.

The engine's `layers.Linear` keeps the e4m3 weight and its scale grid (packed projections
concatenate both along the output dimension, so each slice must cover whole blocks) and, in its
forward, dequantizes into the input's dtype and runs a plain GEMM (`BlockFP8.forward`): the CPU
path, and CUDA's until an FP8 tensor-core GEMM takes over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llm_service.model import layers
from mmserve.checkpoint import read_config, safetensors_files, stored_tensors

FP8 = torch.float8_e4m3fn
SCALE = "weight_scale_inv"


@dataclass(frozen=True)
class BlockFP8:
    """One block-scaled FP8 format: `block` = (rows, columns) of the weight one scale covers."""

    block: tuple[int, int]

    @property
    def name(self) -> str:
        """As `GET /v1/models` and the load log say it."""
        return f"fp8 (e4m3, {self.block[0]}x{self.block[1]} blocks)"

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a weight of `shape` `(out, in)`."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (e4m3) x each block's `scale`, computed in float32 (or `dtype` if wider), in `dtype`."""
        wide = torch.promote_types(dtype, torch.float32)
        (rows, cols), cols_per_block = weight.shape, self.block[1]
        per_row = scale.to(wide).repeat_interleave(self.block[0], 0)[:rows]  # (rows, column blocks)
        out, whole = weight.to(wide), cols // cols_per_block * cols_per_block
        out[:, :whole].unflatten(1, (-1, cols_per_block)).mul_(per_row[:, :whole // cols_per_block, None])
        out[:, whole:].mul_(per_row[:, -1:])  # a partial last column block
        return out.to(dtype)

    def forward(self, linear: layers.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(linear.weight, linear.weight_scale_inv, x.dtype), linear.bias)

    def convert(self, name: str, linear: layers.Linear, device: torch.device) -> None:
        """Give `linear` (named `name`) an e4m3 `weight` and a float32 `weight_scale_inv` to load into."""
        rows = self.block[0]
        if len(linear.output_sizes) > 1 and any(size % rows for size in linear.output_sizes):
            raise ValueError(f"{name}: its packed slices {linear.output_sizes} are not whole blocks of "
                             f"weight_block_size[0]={rows} rows: the scale grids of its parts cannot be concatenated")
        shape = tuple(linear.weight.shape)
        linear.weight = nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)
        linear.weight_scale_inv = nn.Parameter(torch.empty(self.grid(shape), dtype=torch.float32, device=device),
                                               requires_grad=False)
        linear.quantization = self


def read_format(model_dir: str | Path) -> BlockFP8 | None:
    """The checkpoint's weight format: None for a dense one; a ValueError naming the field for
    one mmserve does not read."""
    config = read_config(model_dir)
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method {q.get('quant_method')!r} is not supported: "
                         "mmserve reads 'fp8' (block-scaled e4m3)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {q['fmt']!r} is not supported: mmserve reads 'e4m3'")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported: "
                         "mmserve reads 'dynamic'")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not two positive integers "
                         "(per-tensor FP8 is not supported)")
    return BlockFP8(tuple(block))


def quantized_weights(model_dir: str | Path, fmt: BlockFP8) -> list[str]:
    """Checkpoint keys of the weights stored in FP8, each checked against its `weight_scale_inv`
    (present, the shape of its block grid) from the files' headers alone."""
    stored = {t.key: t for file in safetensors_files(Path(model_dir)) for t in stored_tensors(file)}
    out = []
    for key, tensor in stored.items():
        base = key.rpartition(".")[0]
        if key.endswith("." + SCALE) and stored.get(base + ".weight", tensor).dtype != FP8:
            raise ValueError(f"checkpoint tensor {key} scales no F8_E4M3 weight {base}.weight")
        if tensor.dtype not in (FP8, torch.float8_e5m2):
            continue
        scale = stored.get(f"{base}.{SCALE}")
        if tensor.dtype != FP8 or not key.endswith(".weight") or len(tensor.shape) != 2:
            raise ValueError(f"checkpoint tensor {key} ({tensor.dtype}, {tensor.shape}) is not a block-scaled "
                             "e4m3 weight (out, in)")
        if scale is None:
            raise ValueError(f"checkpoint tensor {key} is F8_E4M3 but the checkpoint has no {base}.{SCALE}")
        if scale.shape != fmt.grid(tensor.shape):
            raise ValueError(f"checkpoint tensor {base}.{SCALE} has shape {scale.shape}; the weight {tensor.shape} "
                             f"in blocks {list(fmt.block)} (weight_block_size) needs {fmt.grid(tensor.shape)}")
        out.append(key)
    return sorted(out)


def quantize_modules(modules: nn.Module, model_dir: str | Path, rename, fmt: BlockFP8, device: torch.device) -> int:
    """Turn the `layers.Linear`s of `modules` whose checkpoint weights are FP8 into FP8 ones, then
    give every parameter still on the meta device (`tensor_parallel.parameters_on_meta`) storage
    on `device`; returns how many were converted. A quantized tensor with no FP8 place (a module
    the family runs in `transformers`' own layers, a packed projection with some parts dense) is
    refused here, before anything is read."""
    parts: dict[str, list[str]] = {}  # module name -> its checkpoint weights stored in FP8
    for key in quantized_weights(model_dir, fmt):
        name = rename(key)
        if name is None:
            continue
        owner, _, module = name.removesuffix(".weight").rpartition(".")
        packed = next((p for p, members in layers.PACKED.items() if module in members), module)
        parts.setdefault(f"{owner}.{packed}".lstrip("."), []).append(key)
    for name, keys in parts.items():
        linear = modules.get_submodule(name) if _has_module(modules, name) else None
        if not isinstance(linear, layers.Linear):
            raise ValueError(f"checkpoint tensor {keys[0]} is FP8, but mmserve runs {name} in full precision only "
                             "(FP8 weights go to the engine's own decoder layers)")
        if len(keys) != len(linear.output_sizes):
            raise ValueError(f"{name} packs {len(linear.output_sizes)} projections but only {sorted(keys)} are FP8 "
                             "in the checkpoint: a packed projection is all FP8 or all dense")
        try:
            fmt.convert(name, linear, device)
        except ValueError as e:
            raise ValueError(f"{e} (checkpoint tensors {', '.join(sorted(keys))})") from None
    made: dict[int, nn.Parameter] = {}  # tied parameters stay one tensor
    for name, param in list(modules.named_parameters(remove_duplicate=False)):
        if param.device.type == "meta":
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
            owner, _, attr = name.rpartition(".")
            setattr(modules.get_submodule(owner), attr, made[id(param)])
    return len(parts)


def _has_module(modules: nn.Module, name: str) -> bool:
    try:
        modules.get_submodule(name)
    except AttributeError:
        return False
    return True
