"""Physical limits of the GPUs figures are taken on: peak memory bandwidth and dense bf16 tensor
throughput (vendor datasheets, no sparsity), by the name CUDA reports; `--peak-gbs` /
`--peak-tflops` override them for a GPU not listed.
"""

from __future__ import annotations

from typing import NamedTuple


class Peaks(NamedTuple):
    memory_gbs: float | None  # GB/s (1e9 bytes)
    bf16_tflops: float | None  # dense


# a substring of the CUDA name -> peaks; the first match wins, so the more specific names come first
TABLE: tuple[tuple[str, Peaks], ...] = (
    ("H200 NVL", Peaks(4800, 835)),
    ("H200", Peaks(4800, 989)),
    ("H100 PCIe", Peaks(2000, 756)),
    ("H100 NVL", Peaks(3900, 835)),
    ("H100", Peaks(3350, 989)),  # SXM5: "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-40GB", Peaks(1555, 312)),
    ("A100-PCIE-40GB", Peaks(1555, 312)),
    ("A100 80GB PCIe", Peaks(1935, 312)),
    ("A100", Peaks(2039, 312)),  # SXM4 80 GB
    ("L40S", Peaks(864, 362)),
    ("L40", Peaks(864, 181)),
    ("L4", Peaks(300, 121)),
)


def peaks(device_name: str | None, memory_gbs: float | None = None, bf16_tflops: float | None = None) -> Peaks:
    """The table's peaks for `device_name`, each replaced by the override when one is given;
    None for what neither knows (a GPU not listed, the CPU)."""
    listed = next((p for key, p in TABLE if device_name and key in device_name), Peaks(None, None))
    return Peaks(memory_gbs or listed.memory_gbs, bf16_tflops or listed.bf16_tflops)
