"""A saved tiny checkpoint rewritten as Qwen's `-FP8` releases are: the language model's
projections as `F8_E4M3` weights with float32 `weight_scale_inv` block scales, the rest (vision
tower, embeddings, norms, biases, lm_head) as saved, `quantization_config` in `config.json`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

QUANTIZATIONS = ("fp8-block",)  # `mmserve build-tiny-model --quantization`
BLOCK = [16, 16]  # weight_block_size: whole blocks in every tiny projection (the released ones use 128)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize_block_fp8(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales `(ceil(out/bo), ceil(in/bi))`) with e4m3 x scale ~ `weight`:
    each block's scale maps its largest magnitude to e4m3's largest value."""
    (rows, cols), (bo, bi) = weight.shape, block
    go, gi = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = torch.zeros(go * bo, gi * bi, dtype=torch.float32)
    padded[:rows, :cols] = weight
    blocks = padded.view(go, bo, gi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    stored = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return stored.view(go * bo, gi * bi)[:rows, :cols].contiguous(), scale


def not_converted(keys) -> list[str]:
    """`modules_to_not_convert`: lm_head and the vision tower, under the prefix the file uses."""
    return ["lm_head", "model.visual" if any(k.startswith("model.visual.") for k in keys) else "visual"]


def converted(key: str, tensor: torch.Tensor, skipped: list[str]) -> bool:
    """Whether the writer quantizes checkpoint tensor `key`: the language model's 2-D projections."""
    module = key.removesuffix(".weight")
    return (key.endswith("_proj.weight") and tensor.dim() == 2
            and not any(module == m or module.startswith(m + ".") for m in skipped))


def quantize_checkpoint(model_dir: Path, block: list[int] = BLOCK) -> None:
    """Rewrite the safetensors files and `config.json` of `model_dir` in place (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = {file: load_file(file) for file in sorted(model_dir.glob("*.safetensors"))}
    skipped = not_converted([key for tensors in files.values() for key in tensors])
    for file, tensors in files.items():
        out = {}
        for key, tensor in tensors.items():
            if not converted(key, tensor, skipped):
                out[key] = tensor
                continue
            out[key], out[key + "_scale_inv"] = quantize_block_fp8(tensor, block)
            if index is not None:
                index["weight_map"][key + "_scale_inv"] = file.name
        save_file(out, file, metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block), "modules_to_not_convert": skipped}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
