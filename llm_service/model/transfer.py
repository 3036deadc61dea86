"""Host-to-device copies that never wait for the device.

A step's inputs are made on the host while the device may still run the step before (overlapped
steps). A plain copy from pageable memory to CUDA synchronises with the device, which would
serialise the two: `to_device` stages through pinned memory (the caching host allocator keeps a
buffer until its copy is done) and copies asynchronously. Off CUDA it is an ordinary `.to`.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: from host memory through pinned memory to CUDA; otherwise `.to`."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ints(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list of ints) as a tensor on `device`, copied without waiting."""
    return to_device(torch.tensor(values, dtype=dtype), device)
