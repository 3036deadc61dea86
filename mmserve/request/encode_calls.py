"""How one request's media items become encoder calls: the router's rule
(`deployments.core.dispatch`), and what the capacity planner (`mmserve.capacity.simulate`) simulates.

A request's items are spread over several calls (so over encoder replicas) only when each call
still gets at least `SPREAD_MIN_GROUP_TOKENS`; a small request stays one call (one RPC). With
affinity routing (`affinity_spread`) an item the router sent before goes alone, so that it can go
back to the replica holding it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SPREAD_MIN_GROUP_TOKENS = 2048
SPREAD_MAX_GROUPS = 8


def balanced_groups(sizes: Sequence[int], num_groups: int) -> list[list[int]]:
    """Item indices in `num_groups` groups of near-equal summed size (none empty).

    Largest item first onto the least-loaded group (vLLM's `get_load_balance_assignment`);
    indices ascend within a group. Fewer groups when there are fewer items.
    """
    num_groups = max(1, min(num_groups, len(sizes)))
    heap = [(0, g) for g in range(num_groups)]
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + sizes[i], g))
    return [sorted(g) for g in groups if g]


def spread(sizes: Sequence[int]) -> list[list[int]]:
    """How the router splits one request's items (token counts `sizes`) into encoder calls."""
    return balanced_groups(sizes, min(SPREAD_MAX_GROUPS, max(1, sum(sizes) // SPREAD_MIN_GROUP_TOKENS)))


def affinity_spread(sizes: Sequence[int], seen: Sequence[bool]) -> list[list[int]]:
    """The split with affinity routing: each item the router sent before (`seen`) alone, first;
    the cold items spread by size as `spread` does."""
    cold = [i for i, s in enumerate(seen) if not s]
    cold_groups = spread([sizes[i] for i in cold])
    return [[i] for i, s in enumerate(seen) if s] + [[cold[j] for j in group] for group in cold_groups]
