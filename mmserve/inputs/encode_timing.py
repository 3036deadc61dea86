"""How long an item's embedding took, per request: the encoder's queue and forward, and the transfer.

The encoder pool stamps each item it returns with an `EncodeTiming` as the caller saw it (a cache
hit: `hit`, zero queue and encode), the encoder hands it on with the result (object store or
gRPC reference) and the LLM replica turns a request's items into stage times
(`embedding_stages`, for `usage.stage_ms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class EncodeTiming(NamedTuple):
    """One item of one encode call, as its caller saw it."""

    queue_ms: float  # from the call to the start of the item's first forward: CPU decode + waiting for a batch
    encode_ms: float  # from the start of its first forward (or the call, when it joined later) to its end
    hit: bool  # answered by the embedding cache (queue and encode 0)
    done_at: float  # wall clock (time.time()) when the encoder had it: the transfer starts there


def embedding_stages(timings: Sequence[EncodeTiming | None], waited_ms: float, received_at: float) -> dict[str, float]:
    """`encode_queue_ms`, `encode_ms` and `embedding_transfer_ms` of a request whose items' embeddings
    the LLM replica waited `waited_ms` for (`embeddings_ms`), the last of them in hand at wall time
    `received_at`. The request waits for its last item: the stages are that item's (the latest
    `done_at`; of those, the longest queue + encode), the transfer from its `done_at` to
    `received_at`. Each is cut to what is left of `waited_ms` (transfer first, then encode, then
    queue), so they are non-negative and sum to at most `waited_ms`: the encoder may have started
    before the LLM replica saw the request. No items: zeros; an item without timing (a standalone
    encoder's pinned result): {}."""
    if any(t is None for t in timings):
        return {}
    if not timings:
        return {"encode_queue_ms": 0.0, "encode_ms": 0.0, "embedding_transfer_ms": 0.0}
    last = max(timings, key=lambda t: (t.done_at, t.queue_ms + t.encode_ms))
    left = max(0.0, waited_ms)
    transfer = min(left, max(0.0, (received_at - last.done_at) * 1000))
    encode = min(left - transfer, max(0.0, last.encode_ms))
    queue = min(left - transfer - encode, max(0.0, last.queue_ms))
    return {"encode_queue_ms": queue, "encode_ms": encode, "embedding_transfer_ms": transfer}
