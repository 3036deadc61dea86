"""Reading a Hugging Face checkpoint directory: config, processor settings, selected tensors.

Each runtime reads only the tensors of its own half of the model straight from the safetensors
files; nothing is loaded and then deleted.

Config fields are read through `transformers`' config classes (`load_config`), never from the
JSON: released Qwen2-VL and Qwen2.5-VL checkpoints write a flat `config.json` (the language
model's fields at the top level, `rope_scaling: {"type": "mrope", "mrope_section": ...}`), while
`transformers` 5 saves them nested under `text_config`; the classes read both the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DTYPE_CHOICES = ("auto", *_DTYPES)


class LoadedTensors(NamedTuple):
    state_dict: dict[str, torch.Tensor]
    keys_read: tuple[str, ...]


def read_config(model_dir: str | Path) -> dict:
    """The raw `config.json`: only for the top-level fields every layout shares (`model_type`,
    `dtype`); anything else through `load_config`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint: no config.json")
    return json.loads(path.read_text())


def load_config(model_dir: str | Path) -> PreTrainedConfig:
    """The checkpoint's `transformers` config, flat (published) or nested layout alike: the
    language model's fields are in `config.get_text_config()` either way."""
    from transformers import AutoConfig

    read_config(model_dir)  # a clear error when there is no config.json
    return AutoConfig.from_pretrained(str(model_dir))


def resolve_max_model_len(config: PreTrainedConfig, setting: int | None) -> int:
    """The context served, prompt + generated tokens, as router and LLM both use it: `setting`
    (`engine.max_model_len`), or the checkpoint's `max_position_embeddings`, which it may not exceed."""
    limit = int(config.get_text_config().max_position_embeddings)
    if setting is None:
        return limit
    if setting > limit:
        raise ValueError(f"engine.max_model_len {setting} exceeds the checkpoint's max_position_embeddings "
                         f"{limit}: lower it, or leave it unset to serve {limit} tokens")
    return setting


def resolve_dtype(name: str, config: dict) -> torch.dtype:
    """`auto` picks the checkpoint's own dtype (float32 when it names none)."""
    if name == "auto":
        name = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[name]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def load_tensors(model_dir: str | Path, rename: Callable[[str], str | None], dtype: torch.dtype) -> LoadedTensors:
    """Tensors whose checkpoint key `rename` maps to a module key (others are never read)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    read: list[str] = []
    for file in _safetensors_files(Path(model_dir)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is None:
                    continue
                state[name] = f.get_tensor(key).to(dtype)
                read.append(key)
    return LoadedTensors(state, tuple(read))


def strip_prefix(key: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def processor_settings(model_dir: Path, section: str, legacy_file: str) -> dict:
    """One processor's settings from `processor_config.json` (transformers 5) or its own legacy file."""
    combined = model_dir / "processor_config.json"
    if combined.is_file():
        data = json.loads(combined.read_text())
        if section in data:
            return data[section]
    legacy = model_dir / legacy_file
    return json.loads(legacy.read_text()) if legacy.is_file() else {}


def read_chat_template(model_dir: str | Path) -> str | None:
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if template:
                return template
    return None
