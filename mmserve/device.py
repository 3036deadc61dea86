"""The device a replica runs on, and its share of a GPU's memory."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    """`auto` is CUDA when this process sees a GPU, else the CPU."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def hold_to_share(device: str | torch.device, share: float) -> None:
    """Holds this process's CUDA allocator on `device` to `share` of the device's memory (a replica
    given part of a GPU: past its part it runs out of memory itself, never into its neighbour's);
    nothing off CUDA or for a whole device."""
    device = torch.device(device)
    if device.type == "cuda" and share < 1:  # torch takes an index here ("cuda" alone is refused)
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.set_per_process_memory_fraction(share, index)


def device_memory(device: str | torch.device) -> dict[str, int]:
    """This process's CUDA allocator on `device` (bytes reserved now and at most so far) and the
    device's total; zeros off CUDA. What a replica reports about its share of a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"reserved_bytes": 0, "max_reserved_bytes": 0, "total_bytes": 0}
    return {"reserved_bytes": torch.cuda.memory_reserved(device),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "total_bytes": torch.cuda.get_device_properties(device).total_memory}
