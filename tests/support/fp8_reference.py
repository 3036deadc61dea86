"""The reference of a block-FP8 checkpoint: the same directory with every FP8 weight dequantized
(stored value x its block's scale, in float64, where the product is exact) and no
`quantization_config`, for `transformers`' dense loader (`tests.support.reference`).

Written on torch and safetensors alone: not the engine's dequantization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    rows, cols = weight.shape
    out = weight.to(torch.float64).clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j].double()
    return out


def dequantized_copy(model_dir: str | Path, out_dir: str | Path) -> str:
    """`model_dir` copied to `out_dir` (once) with its FP8 weights dense in float64."""
    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = tmp / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.endswith("_scale_inv")}
        index.write_text(json.dumps(data, indent=2) + "\n")
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        dense = {key: dequantize(t, tensors[key + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
                 for key, t in tensors.items() if not key.endswith("_scale_inv")}
        save_file(dense, tmp / file.name, metadata={"format": "pt"})
    tmp.rename(out_dir)
    return str(out_dir)
