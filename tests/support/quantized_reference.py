"""The reference of a quantized checkpoint: the same directory with every quantized projection
dense in float64 (where each product is exact) and no `quantization_config`, for `transformers`'
dense loader (`tests.support.reference`). Block FP8 (`weight` x `weight_scale_inv` per block),
per-channel FP8 (`weight` x `weight_scale` per row), AWQ (`qweight`/`qzeros`/`scales` ->
`weight` `(out, in)` = ((q - z) x s)^T). A MoE checkpoint's per-expert projections
(`mlp.experts.<j>.gate_proj.weight`, ...) are stacked back into the layout `transformers` loads
(`mlp.experts.gate_up_proj` `(E, 2I, H)`: each expert's gate rows then its up rows;
`mlp.experts.down_proj` `(E, H, I)`).

Written on torch and safetensors alone, element by element where it can: not the engine's
dequantization."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's `order_map`: the 4 bits at 4*i hold column AWQ_ORDER[i]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    out = weight.to(torch.float64).clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j].double()
    return out


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 `(rows, cols)` -> int64 `(rows, 8 cols)` of the 4-bit values, in column order."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        out[:, column::8] = (packed.to(torch.int64) >> (4 * i)) & 15
    return out


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = qweight.shape[0] // scales.shape[0]
    q, z = unpack_awq(qweight), unpack_awq(qzeros)
    out = torch.empty(q.shape, dtype=torch.float64)
    for g in range(scales.shape[0]):
        rows = slice(g * group, (g + 1) * group)
        out[rows] = (q[rows] - z[g]).double() * scales[g].double()
    return out.t().contiguous()


def dense_tensors(tensors: dict[str, torch.Tensor], q: dict) -> dict[str, torch.Tensor]:
    """One file's tensors with its quantized projections dense (float64)."""
    method = q["quant_method"]
    if method == "awq":
        dense = {key: t for key, t in tensors.items() if not key.endswith((".qweight", ".qzeros", ".scales"))}
        for key in tensors:
            if key.endswith(".qweight"):
                base = key.removesuffix(".qweight")
                dense[base + ".weight"] = dequantize_awq(tensors[key], tensors[base + ".qzeros"],
                                                         tensors[base + ".scales"])
        return dense
    scale = "weight_scale_inv" if method == "fp8" else "weight_scale"
    dense = {}
    for key, t in tensors.items():
        if key.endswith("." + scale):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[key.removesuffix("weight") + scale]
            block = q["weight_block_size"] if method == "fp8" else [1, t.shape[1]]
            t = dequantize(t, s, block)
        dense[key] = t
    return dense


def stacked_experts(dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`dense` with each MoE layer's per-expert projections stacked (the module layout)."""
    out, experts = {}, {}
    for key, t in dense.items():
        found = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
        if found:
            experts.setdefault(found[1], {})[int(found[2]), found[3]] = t
        else:
            out[key] = t
    for prefix, parts in experts.items():
        num = 1 + max(j for j, _ in parts)
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([parts[j, "gate_proj"], parts[j, "up_proj"]]) for j in range(num)])
        out[prefix + ".down_proj"] = torch.stack([parts[j, "down_proj"] for j in range(num)])
    return out


def dequantized_copy(model_dir: str | Path, out_dir: str | Path) -> str:
    """`model_dir` copied to `out_dir` (once) with its quantized projections dense in float64."""
    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    config = json.loads((model_dir / "config.json").read_text())
    q = config.pop("quantization_config")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map = {}
    for file in model_dir.glob("*.safetensors"):
        dense = stacked_experts(dense_tensors(load_file(file), q))
        save_file(dense, tmp / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(dense, file.name))
    if (model_dir / "model.safetensors.index.json").is_file():
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2) + "\n")
    tmp.rename(out_dir)
    return str(out_dir)


def edit_tensors(model_dir: Path, edit) -> None:
    """Rewrite `model_dir`'s `model.safetensors` after `edit(tensors)` changed the dict in place
    (the bad-checkpoint tests)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
