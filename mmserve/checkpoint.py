"""Reading a Hugging Face checkpoint directory: config, processor settings, tensors (and writing
a safetensors file tensor by tensor, for the builders that rewrite one).

Each runtime reads only the tensors of its own half of the model, one at a time, into modules built
without initial values (docs/operations.md#loading-and-cpu-threads).

Config fields are read through `transformers`' config classes (`load_config`), never from the
JSON: released Qwen2-VL and Qwen2.5-VL checkpoints write a flat `config.json` (the language
model's fields at the top level, `rope_scaling: {"type": "mrope", "mrope_section": ...}`), while
`transformers` 5 saves them nested under `text_config`; the classes read both the same way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
DTYPE_CHOICES = ("auto", *_DTYPES)
# safetensors' dtype names (https://github.com/huggingface/safetensors, format spec)
_FILE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_QUANTIZATION_SCALES = (".weight_scale_inv", ".weight_scale", ".scales")  # FP8 block, FP8 channel, AWQ
_READ_CHUNK = 1 << 30  # one read() moves at most ~2 GiB on Linux
_CONVERT_CHUNK = 1 << 26  # bytes of the file read at a time into a CPU parameter of another dtype


def read_config(model_dir: str | Path) -> dict:
    """The raw `config.json`: only for the top-level fields every layout shares (`model_type`,
    `dtype`); anything else through `load_config`."""
    if not (path := Path(model_dir) / "config.json").is_file():
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


def safetensors_files(model_dir: Path) -> list[Path]:
    if (index := model_dir / "model.safetensors.index.json").is_file():
        return [model_dir / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if not (files := sorted(model_dir.glob("*.safetensors"))):
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


class StoredTensor(NamedTuple):
    """Where one tensor lies in a safetensors file (from its header; nothing read yet)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def stored_tensors(file: Path) -> list[StoredTensor]:
    """The header of one safetensors file: 8 bytes of header length, the JSON header, the data."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    base = 8 + size
    out = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in _FILE_DTYPES:
            raise ValueError(f"{file.name}: tensor {key} has dtype {meta['dtype']}, which mmserve cannot read")
        begin, end = meta["data_offsets"]
        out.append(StoredTensor(key, _FILE_DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, end - begin))
    return sorted(out, key=lambda t: t.start)  # sequential reads


def weight_bytes(model_dir: str | Path, select: Callable[[str], bool], dtype: torch.dtype) -> int:
    """Bytes the tensors `select` picks (by checkpoint key) take in `dtype`, from the files' headers
    alone; quantized weights (FP8, AWQ's packed int32) and their scales count as stored: they are served so."""
    size = torch.empty((), dtype=dtype).element_size()

    def served(t: StoredTensor) -> int:
        kept = t.dtype in _FP8 or t.dtype == torch.int32 or t.key.endswith(_QUANTIZATION_SCALES)
        return t.nbytes if kept else math.prod(t.shape) * size

    return sum(served(t) for file in safetensors_files(Path(model_dir)) for t in stored_tensors(file) if select(t.key))


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write (or atomically replace) the safetensors file `path` from `(key, tensor)` pairs, holding
    one tensor at a time: each one's bytes go to a spool file as it comes, one spool per element
    size (largest first in the file, as safetensors' own writer orders them, so every tensor starts
    aligned to its element size), then the header and the spools are joined."""
    names = {dtype: name for name, dtype in _FILE_DTYPES.items()}
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp, contextlib.ExitStack() as files:
        spools: dict[int, BinaryIO] = {}
        entries: dict[int, list[tuple[str, str, list[int], int, int]]] = {}
        for key, tensor in tensors:
            size = tensor.element_size()
            if size not in spools:
                spools[size] = files.enter_context(open(Path(tmp) / f"spool{size}", "w+b"))
            spool, begin = spools[size], spools[size].tell()
            spool.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
            entries.setdefault(size, []).append((key, names[tensor.dtype], list(tensor.shape), begin, spool.tell()))
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset, order = 0, sorted(spools, reverse=True)
        for size in order:
            for key, dtype, shape, begin, end in entries[size]:
                header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset + begin, offset + end]}
            offset += spools[size].tell()
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        written = Path(tmp) / path.name
        with open(written, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for size in order:
                spools[size].seek(0)
                shutil.copyfileobj(spools[size], out, 1 << 24)
        os.replace(written, path)


def _read_into(f, stored: StoredTensor, out: torch.Tensor) -> torch.Tensor:
    """The stored bytes into `out` (CPU, contiguous, the stored dtype and shape)."""
    view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
    f.seek(stored.start)
    done = 0
    while done < stored.nbytes:
        if not (n := f.readinto(view[done:done + _READ_CHUNK])):
            raise ValueError(f"{stored.key}: the file ends before the tensor does")
        done += n
    return out


def _read_converted(f, stored: StoredTensor, out: torch.Tensor) -> None:
    """The stored tensor into `out` (CPU, contiguous, its shape, another dtype), `_CONVERT_CHUNK`
    bytes of the file at a time: no copy of the whole tensor in its stored dtype beside `out`."""
    size = stored.dtype.itemsize
    step, numel = max(1, _CONVERT_CHUNK // size), stored.nbytes // size
    buffer, flat = torch.empty(min(step, numel), dtype=stored.dtype), out.detach().view(-1)
    for begin in range(0, numel, step):
        n = min(step, numel - begin)
        part = StoredTensor(stored.key, stored.dtype, (n,), stored.start + begin * size, n * size)
        flat[begin:begin + n].copy_(_read_into(f, part, buffer[:n]))


def rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


class LoadReport(NamedTuple):
    keys_read: tuple[str, ...]
    bytes_read: int
    seconds: float
    peak_rss_growth: int | None  # over the RSS before loading (Linux)

    def summary(self) -> str:
        peak = "" if self.peak_rss_growth is None else f", host memory peak +{self.peak_rss_growth / 1e9:.2f} GB"
        return f"{len(self.keys_read)} tensors, {self.bytes_read / 1e9:.2f} GB read in {self.seconds:.1f}s{peak}"


Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def load_weights(module: nn.Module, model_dir: str | Path, rename: Callable[[str], str | None], *,
                 convert: Convert | None = None, optional: frozenset[str] = frozenset(),
                 on_read: Callable[[str, torch.Tensor], None] | None = None,
                 take: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> LoadReport:
    """Stream the checkpoint's tensors into `module`'s parameters and buffers, one at a time.

    `module` is built with uninitialised storage on its device, in its dtype; how each tensor gets
    there: docs/operations.md#loading-and-cpu-threads. A tensor whose module key names no
    parameter waits for `convert` (a family's layout conversion: fused or split projections),
    which returns the module tensors it can make from the waiting ones and removes those it used.
    Every parameter and persistent buffer must be loaded except the `optional` ones (tied weights).
    `on_read(key, tensor)` sees each tensor as the file holds it (e.g. to fingerprint the weights).
    `take(name, tensor)`: the part of a module tensor this process holds (a tensor-parallel
    shard, `llm_service.model.tensor_parallel`), applied before it is placed.
    """
    start, rss0, peak = time.perf_counter(), rss_bytes(), 0
    targets = module.state_dict(keep_vars=True)  # name -> the live Parameter / buffer
    loaded: set[str] = set()
    waiting: dict[str, torch.Tensor] = {}
    keys, nbytes = [], 0

    def place(name: str, tensor: torch.Tensor) -> None:
        target = targets[name]
        if take is not None:
            tensor = take(name, tensor)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(target.shape)}: does config.json match the weights?")
        if tensor.dtype in _FP8 and target.dtype != tensor.dtype:  # its values mean nothing without their scales
            raise ValueError(f"checkpoint tensor for {name} is {tensor.dtype}, which this model holds in "
                             f"{target.dtype}: mmserve has no FP8 layer for it")
        if tensor is not target:
            with torch.no_grad():
                target.copy_(tensor)
        loaded.add(name)

    for file in safetensors_files(Path(model_dir)):
        with open(file, "rb", buffering=0) as f:
            for stored in stored_tensors(file):
                if (name := rename(stored.key)) is None or name in optional:
                    continue
                target = targets.get(name)
                in_place = (target is not None and target.device.type == "cpu" and target.is_contiguous()
                            and tuple(target.shape) == stored.shape)
                convert_in_place = (in_place and target.dtype != stored.dtype and stored.dtype not in _FP8
                                    and on_read is None and take is None)  # those two see the tensor as stored
                if convert_in_place:
                    with torch.no_grad():
                        _read_converted(f, stored, target)
                    tensor = target
                else:
                    direct = in_place and target.dtype == stored.dtype
                    buffer = target if direct else torch.empty(stored.shape, dtype=stored.dtype)
                    tensor = _read_into(f, stored, buffer)
                keys.append(stored.key)
                nbytes += stored.nbytes
                if on_read is not None:
                    on_read(stored.key, tensor)
                if rss0 is not None:
                    peak = max(peak, rss_bytes() - rss0)
                if target is not None:
                    place(name, tensor)
                    continue
                waiting[name] = tensor
                for made, made_tensor in (convert(waiting) if convert else {}).items():
                    if made not in targets:
                        raise ValueError(f"converted checkpoint tensor {made} has no place in the model")
                    place(made, made_tensor)
                del tensor
    if waiting:
        raise ValueError(f"checkpoint tensors with no place in the model: {sorted(waiting)[:5]}")
    if missing := set(targets) - loaded - optional:
        raise ValueError(f"checkpoint lacks tensors of the model: {sorted(missing)[:5]}")
    return LoadReport(tuple(keys), nbytes, time.perf_counter() - start, peak if rss0 is not None else None)


def strip_prefix(key: str, prefixes: tuple[str, ...]) -> str | None:
    return next((key[len(prefix):] for prefix in prefixes if key.startswith(prefix)), None)


def processor_settings(model_dir: Path, section: str, legacy_file: str) -> dict:
    """One processor's settings from `processor_config.json` (transformers 5) or its own legacy file."""
    combined = model_dir / "processor_config.json"
    if combined.is_file() and section in (data := json.loads(combined.read_text())):
        return data[section]
    legacy = model_dir / legacy_file
    return json.loads(legacy.read_text()) if legacy.is_file() else {}


def read_chat_template(model_dir: str | Path) -> str | None:
    model_dir = Path(model_dir)
    if (jinja := model_dir / "chat_template.jinja").is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file() and (template := json.loads(path.read_text()).get("chat_template")):
            return template
    return None
