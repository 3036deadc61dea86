"""CUDA graphs of one step at a ladder of sizes, shared by the LLM's decode graphs
(`llm_service.model.cuda_graphs`) and the encoder's graphs by token budget (`encoder_service.vit_graphs`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def capture_ladder(sizes: Iterable[int], step_of: Callable[[int], Callable[[], object]], device: torch.device,
                   warmups: int = 1) -> dict[int, tuple[torch.cuda.CUDAGraph, object]]:
    """One graph of `step_of(size)()` per size, largest first into one memory pool (the smaller
    graphs reuse the largest one's activations). Each step first runs `warmups` times on a side
    stream, as torch asks (Triton compiles, the allocator settles). Returns {size: (graph, the
    captured step's output)}: replaying a graph rewrites that output in place."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
    pool = None
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            step = step_of(size)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmups):
                    step()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step()
            graphs[size] = (graph, out)
            pool = graph.pool()
    torch.cuda.synchronize(device)
    return graphs
