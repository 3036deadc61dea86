"""A saved tiny checkpoint rewritten as a quantized release is (`mmserve build-tiny-model
--quantization`; the formats: docs/quantization.md): the language model's projections quantized from
the dense weights by the format's own rules, the rest (vision tower, embeddings, norms, biases,
lm_head) as saved, `quantization_config` in `config.json`. A MoE checkpoint's stacked experts are
written one projection per expert, as the quantized releases store them (Qwen3-VL-30B-A3B-Instruct-FP8);
the routers (`mlp.gate`) stay dense and are named in the skip lists, as the releases name them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

QUANTIZATIONS = ("fp8-block", "fp8-channel", "awq")
BLOCK = [16, 16]  # weight_block_size: whole blocks in every tiny projection
GROUP = 32  # AWQ group_size, or the largest divisor of it that divides every projection's input
RELEASED_BLOCK, RELEASED_GROUP = [128, 128], 128  # the released checkpoints' (real-size builders use them)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the 4 bits at 4*i of an int32 hold column AWQ_ORDER[i] of its 8


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


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """`(rows, 8 cols)` integers in 0..15 -> int32 `(rows, cols)`, eight to a word in `AWQ_ORDER`."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    words = sum(grouped[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()  # the bits, as int32


def quantize_awq(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's asymmetric int4 of `weight` `(out, in)` per group of `group` input rows (its
    `pseudo_quantize_tensor`, without the activation-aware scale search): {qweight, qzeros, scales}."""
    w = weight.t().reshape(-1, group, weight.shape[0])  # (groups, group, out)
    low, high = w.amin(1), w.amax(1)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    q = (torch.round(w / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15)
    return {"qweight": pack_int4(q.reshape(weight.shape[1], -1)), "qzeros": pack_int4(zeros), "scales": scales}


def not_converted(keys) -> list[str]:
    """What the writers skip: lm_head, the vision tower (under the prefix the file uses), each MoE
    layer's router."""
    routers = sorted(k.removesuffix(".weight") for k in keys if k.endswith(".mlp.gate.weight"))
    return ["lm_head", "model.visual" if any(k.startswith("model.visual.") for k in keys) else "visual", *routers]


def per_expert(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked experts tensor as one dense projection `(out, in)` per expert; any other as it is."""
    prefix, _, stacked = key.rpartition(".")
    if not prefix.endswith(".mlp.experts") or stacked not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return {key: tensor}
    if stacked == "down_proj":
        return {f"{prefix}.{j}.down_proj.weight": tensor[j].contiguous() for j in range(tensor.shape[0])}
    gate, up = tensor.chunk(2, dim=1)
    return {f"{prefix}.{j}.{name}.weight": part[j].contiguous()
            for j in range(tensor.shape[0]) for name, part in (("gate_proj", gate), ("up_proj", up))}


def converted(key: str, tensor: torch.Tensor, skipped: list[str]) -> bool:
    """Whether the writer quantizes checkpoint tensor `key`: the language model's 2-D projections."""
    module = key.removesuffix(".weight")
    return (key.endswith("_proj.weight") and tensor.dim() == 2
            and not any(module == m or module.startswith(m + ".") for m in skipped))


def quantize(quantization: str, module: str, weight: torch.Tensor, block: list[int],
             group: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of projection `module` (its dense `weight`) in `quantization`."""
    if quantization == "fp8-block":
        return dict(zip((f"{module}.weight", f"{module}.weight_scale_inv"), quantize_block_fp8(weight, block)))
    if quantization == "fp8-channel":  # blocks of one whole row
        return dict(zip((f"{module}.weight", f"{module}.weight_scale"),
                        quantize_block_fp8(weight, [1, weight.shape[1]])))
    return {f"{module}.{name}": t for name, t in quantize_awq(weight, group).items()}


def quantization_config(quantization: str, skipped: list[str], block: list[int], group: int) -> dict:
    """`config.json`'s `quantization_config` as each format's tool writes it."""
    if quantization == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(block), "modules_to_not_convert": skipped}
    if quantization == "awq":  # AutoAWQ (transformers' AwqConfig)
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": skipped[1:]}  # AutoAWQ never quantizes lm_head

    def args(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": observer,
                "observer_kwargs": {}}

    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": args("channel", False, "minmax"),
                                          "input_activations": args("token", True, None),
                                          "output_activations": None}},
            "ignore": [skipped[0], f"re:{re.escape(skipped[1])}\\..*", *skipped[2:]],
            "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def quantize_checkpoint(model_dir: Path, quantization: str = "fp8-block", block: list[int] = BLOCK,
                        group: int = GROUP) -> None:
    """Rewrite the safetensors files and `config.json` of `model_dir` in place (see the module
    docstring), one tensor at a time: a real-size checkpoint is never all in memory."""
    from safetensors import safe_open

    from mmserve.checkpoint import stored_tensors, write_safetensors

    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(model_dir.glob("*.safetensors"))
    # the projections as written (a MoE's experts one by one), from the headers: shapes only
    shapes = [(k, t) for file in files for st in stored_tensors(file)
              for k, t in per_expert(st.key, torch.empty(st.shape, device="meta")).items()]
    skipped = not_converted([key for key, _ in shapes])
    group = math.gcd(group, *(t.shape[1] for key, t in shapes if converted(key, t, skipped)))

    def rewritten(file: Path):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():
                for key, tensor in per_expert(stored, f.get_tensor(stored)).items():
                    made = (quantize(quantization, key.removesuffix(".weight"), tensor, block, group)
                            if converted(key, tensor, skipped) else {key: tensor})
                    yield from made.items()
                    if index is not None:
                        index["weight_map"].update(dict.fromkeys(made, file.name))

    for file in files:
        if index is not None:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file.name}
        write_safetensors(file, rewritten(file), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(quantization, skipped, block, group)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
