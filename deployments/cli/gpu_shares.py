"""`mmserve serve`'s GPU shares when `--encoder-gpus` / `--llm-gpus` are not given, on a host with GPUs:
shares Ray accounts for, so that the encoder and LLM replicas never both count a device as their own.

- One GPU: fractions that fit both models. The encoder gets its weights plus `ENCODER_HEADROOM_BYTES`
  (activations of an `encoder_pool.max_batch_tokens` batch, its CUDA graphs), rounded up to a
  twentieth and at least a tenth, at most half; the LLM the rest (its weights, then its KV pool from
  `engine.gpu_memory_utilization` of the share: docs/gpu.md). Refused when the LLM's weights do not fit.
- Several GPUs: whole GPUs, one for the encoder and one per tensor-parallel rank of the LLM.
"""

from __future__ import annotations

import math
import os
import subprocess
from typing import NamedTuple

ENCODER_HEADROOM_BYTES = 4 << 30
SHARE_STEP = 0.05
MIN_ENCODER_SHARE, MAX_ENCODER_SHARE = 0.1, 0.5
GPU_QUERY_TIMEOUT_S = 60  # nvidia-smi without persistence mode can take 15-30 s (ray#63243)


class GpuShares(NamedTuple):
    encoder: float  # num_gpus of an encoder replica
    llm: float  # num_gpus of an LLM replica (of each rank, tensor-parallel)
    why: str


def choose_gpu_shares(gpus: int, gpu_memory_bytes: int, encoder_bytes: int, llm_bytes: int,
                      tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9) -> GpuShares:
    """The shares for `gpus` devices of `gpu_memory_bytes` each and models whose weights take
    `encoder_bytes` and `llm_bytes`; ValueError (saying what to give instead) when they do not fit."""
    gib = 1 << 30
    if gpus > 1 or tensor_parallel_size > 1:
        if gpus < tensor_parallel_size + 1:
            raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} takes {tensor_parallel_size} whole GPUs "
                             f"and the encoder one more, and this host has {gpus}: give --encoder-gpus and "
                             "--llm-gpus, or a smaller --tensor-parallel-size")
        if llm_bytes / tensor_parallel_size > gpu_memory_utilization * gpu_memory_bytes:
            raise ValueError(f"the LLM's weights ({llm_bytes / gib:.1f} GiB over {tensor_parallel_size} GPU) do not "
                             f"fit GPUs of {gpu_memory_bytes / gib:.0f} GiB: raise --tensor-parallel-size")
        ranks = f", one per rank ({tensor_parallel_size})" if tensor_parallel_size > 1 else ""
        return GpuShares(1.0, 1.0, f"{gpus} GPUs: a whole GPU for the encoder replica, whole GPUs for the "
                                   f"LLM replica{ranks}")
    steps = math.ceil((encoder_bytes + ENCODER_HEADROOM_BYTES) / gpu_memory_bytes / SHARE_STEP - 1e-9)
    encoder = round(min(MAX_ENCODER_SHARE, max(MIN_ENCODER_SHARE, steps * SHARE_STEP)), 2)
    llm = round(1 - encoder, 2)
    if llm_bytes >= gpu_memory_utilization * llm * gpu_memory_bytes:
        raise ValueError(f"the LLM's weights ({llm_bytes / gib:.1f} GiB) leave no room for its KV cache in "
                         f"{llm:g} of a {gpu_memory_bytes / gib:.0f} GiB GPU (the encoder's weights take "
                         f"{encoder_bytes / gib:.1f} GiB): give --encoder-gpus and --llm-gpus, or use more GPUs")
    return GpuShares(encoder, llm, f"one GPU of {gpu_memory_bytes / gib:.0f} GiB: the encoder's weights "
                                   f"({encoder_bytes / gib:.1f} GiB) + {ENCODER_HEADROOM_BYTES / gib:.0f} GiB of "
                                   f"activations, the LLM's weights ({llm_bytes / gib:.1f} GiB) + its KV cache")


def visible_gpu_memory() -> list[int]:
    """Total memory (bytes) of each GPU this process may use (`CUDA_VISIBLE_DEVICES` applied), from
    `nvidia-smi` (no CUDA context here: the start of Ray's node runs beside it); [] without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines() if line.count(",") == 2]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if g[0] in wanted or g[1] in wanted]
    return [int(mib) << 20 for _, _, mib in gpus]
