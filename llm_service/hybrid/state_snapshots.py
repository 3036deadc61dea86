"""Recurrent-state snapshots for prefix caching: which snapshot row holds the state of which prompt
prefix. Ids only (the rows live in `llm_service.hybrid.state_cache.StatePool`, after the slots).

A cached KV prefix alone cannot resume a hybrid model: its linear-attention layers need their
recurrent state at the end of that prefix too. The engine copies a running sequence's state slot
into a snapshot row when its prefill reaches one of its snapshot points (block boundaries: the end
of the system prompt, of each media item, of the prompt), keyed by the prefix hash of the KV block
that ends there (`Sequence.block_hashes`); a later request with that prefix takes the cached blocks
up to the deepest such point and starts its slot from the snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SnapshotManager:
    """A bounded LRU of state snapshots keyed by prefix hash, beside the `BlockManager`.

    Attributes:
        num_snapshots: snapshot rows (ids `first_row .. first_row + num_snapshots - 1`).
        first_row: the first snapshot row of the state pool (the slots come before).
        num_saved: snapshots taken so far.
        num_resumed: sequences admitted from a snapshot so far.

    Invariants (the engine keeps them): a snapshot exists only while the KV block its prefix ends
    at is cached (`drop` is the block manager's eviction hook), so one never outlives its block;
    a full cache evicts its least recently used snapshot for a new one (the block stays cached).
    Snapshots are never shared by two prefixes (one hash, one row) and rows never leak
    (`num_used + num_free == num_snapshots`). A snapshot is copied into a sequence's slot in the
    step that admits it, before that step's new snapshots are written, so no row needs pinning.
    """

    def __init__(self, num_snapshots: int, first_row: int):
        if num_snapshots < 1:
            raise ValueError(f"a snapshot cache needs at least one row, got {num_snapshots}")
        self.num_snapshots, self.first_row = num_snapshots, first_row
        self.num_saved = 0
        self.num_resumed = 0
        self._free = list(range(first_row + num_snapshots - 1, first_row - 1, -1))  # pop(): lowest first
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # least recently used first

    @property
    def num_used(self) -> int:
        return len(self._by_hash)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def row_of(self, prefix_hash: int) -> int | None:
        return self._by_hash.get(prefix_hash)

    def deepest(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` (a cached KV prefix) a sequence can resume from:
        the deepest block whose prefix has a snapshot (0: none)."""
        return next((k for k in range(len(hashes), 0, -1) if hashes[k - 1] in self._by_hash), 0)

    def resume(self, prefix_hash: int) -> int:
        """The row to start a sequence's slot from (the snapshot is now the most recently used)."""
        self._by_hash.move_to_end(prefix_hash)
        self.num_resumed += 1
        return self._by_hash[prefix_hash]

    def save(self, prefix_hash: int) -> int | None:
        """A row for the state at the end of prefix `prefix_hash` (the least recently used snapshot
        makes room when none is free); None when that prefix has a snapshot already."""
        if prefix_hash in self._by_hash:
            self._by_hash.move_to_end(prefix_hash)
            return None
        row = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        self._by_hash[prefix_hash] = row
        self.num_saved += 1
        return row

    def drop(self, prefix_hash: int) -> None:
        """The KV block of prefix `prefix_hash` left the cache: its snapshot (if any) goes too."""
        if (row := self._by_hash.pop(prefix_hash, None)) is not None:
            self._free.append(row)
