"""LoRA adapters as both services read them: PEFT directories (docs/lora.md#format), each service taking
its own modules (the vision tower's and merger's: `encoder_service.lora`; the others: `llm_service.model.lora`);
`tower_media` gives an item the adapter that changes its tower (docs/lora.md#on-the-vision-tower)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mmserve.inputs.media import AdapterRef, EncodeItem

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the Qwen2-VL / Qwen2.5-VL towers' linears (blocks' attention and MLP, the merger's `mlp.0` / `mlp.2`)
TOWER_TARGETS = ("qkv", "proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj", "mlp.0", "mlp.2")
# checkpoint module paths of the vision tower and its merger (legacy and transformers >= 4.52 layouts)
TOWER_PREFIXES = ("visual.", "model.visual.")
# PEFT options that change what an adapter computes and that neither service implements
_UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
                "modules_to_save": None, "fan_in_fan_out": False}


class AdapterError(ValueError):
    """An adapter a service cannot serve (the message names the adapter and what is wrong)."""


@dataclass(frozen=True)
class Delta:
    """`y[:, out] += scale * (x @ a^T) @ b^T` on one linear."""

    out: slice
    a: torch.Tensor  # (r, input_size)
    b: torch.Tensor  # (out size, r)
    scale: float

    def add_to(self, y: torch.Tensor, x_rows: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the delta of the inputs `x_rows` to the output rows `rows` of `y`, in place."""
        y[:, self.out].index_add_(0, rows, (x_rows @ self.a.T) @ self.b.T * self.scale)


def scaling(config: dict) -> float:
    """PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`."""
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def read_pairs(name: str, path: str | Path, tower: bool) -> tuple[int, float, dict[str, dict[str, torch.Tensor]]]:
    """The adapter's rank and `scaling` (its config checked: AdapterError naming the field) and per
    targeted checkpoint module of the vision tower (`tower`) or of the language model, its LoRA
    weights (`"A"`, `"B"`: `fitted_delta` checks both are there); AdapterError for a missing file or
    a tensor that is no LoRA weight."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {name!r}: no {CONFIG_FILE} in {path}")
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    for field, default in _UNSUPPORTED.items():
        if config.get(field, default) not in (default, None, {}, False):
            raise AdapterError(f"adapter {name!r}: {field} {config[field]!r} is not supported")
    if isinstance(targets := config.get("target_modules"), list):  # a str is a regex: the tensors say what it matched
        known = dict.fromkeys(LM_TARGETS + TOWER_TARGETS)
        if bad := sorted(set(targets) - set(known)):
            raise AdapterError(f"adapter {name!r}: target_modules {bad} not supported (only {', '.join(known)})")
    if not (path / WEIGHTS_FILE).is_file():
        raise AdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path / WEIGHTS_FILE).items():
        module, _, part = key.removeprefix(KEY_PREFIX).rpartition(".lora_")
        if not key.startswith(KEY_PREFIX) or part not in ("A.weight", "B.weight"):
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(module, {})[part[0]] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: no LoRA tensors in {WEIGHTS_FILE}")
    return r, scaling(config), {m: ab for m, ab in sorted(pairs.items()) if m.startswith(TOWER_PREFIXES) == tower}


def fitted_delta(name: str, module: str, ab: dict[str, torch.Tensor], rank: int, in_features: int, out: slice,
                 scale: float, dtype: torch.dtype, device: torch.device) -> Delta:
    """`module`'s delta (its weights `ab` from `read_pairs`) on a linear of `in_features` inputs
    (its output slice `out`), or AdapterError naming the adapter and the module when A or B is
    missing or does not fit."""
    if missing := {"A", "B"} - set(ab):
        raise AdapterError(f"adapter {name!r}: {module} has no lora_{missing.pop()}.weight")
    a, b = ab["A"], ab["B"]
    want_a, want_b = (rank, in_features), (out.stop - out.start, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(f"adapter {name!r}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                           f"fit r {rank} on the base model (want {want_a} / {want_b})")
    return Delta(out, a.to(device, dtype), b.to(device, dtype), scale)


def row_groups(names: Sequence[object | None], counts: Sequence[int]) -> dict[object, list[int]]:
    """The packed rows of each adapter: sequence i (`counts[i]` rows in a row) runs under adapter
    `names[i]` (None: the base model, no group); groups in order of first appearance."""
    rows: dict[object, list[int]] = {}
    start = 0
    for name, n in zip(names, counts):
        if name is not None:
            rows.setdefault(name, []).extend(range(start, start + n))
        start += n
    return rows


def targets_tower(path: str | Path) -> bool:
    """Whether the adapter of `path` has tensors of the vision tower (read from its safetensors
    header only; False when it has no weights file, which the LLM replica refuses)."""
    weights = Path(path) / WEIGHTS_FILE
    try:
        stamp = weights.stat().st_mtime_ns
    except OSError:
        return False
    return _targets_tower(str(weights), stamp)


@functools.lru_cache(maxsize=256)
def _targets_tower(weights: str, stamp: int) -> bool:
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        return any(k.removeprefix(KEY_PREFIX).startswith(TOWER_PREFIXES) for k in f.keys())


def tower_media(media: Sequence[EncodeItem], adapter: AdapterRef | None) -> list[EncodeItem]:
    """`media` as the encoder must get it under `adapter` (a request's LoRA adapter, None for the
    base model): each item carrying the adapter when (and only when) it targets the vision tower,
    so its content hash (every encoder-side key) differs from the base model's; unchanged otherwise."""
    if adapter is None or not targets_tower(adapter.path):
        return list(media)
    return [dataclasses.replace(m, item=dataclasses.replace(m.item, tower_adapter=adapter)) for m in media]
