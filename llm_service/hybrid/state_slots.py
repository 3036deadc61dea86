"""Recurrent-state bookkeeping: which state slots are free, which sequence holds each one.

No tensors here (they live in `llm_service.hybrid.state_cache.StatePool`, on the runner's side).
"""

from __future__ import annotations


class StateSlotManager:
    """Hands out per-sequence state slots by id, beside the `BlockManager` of the paged KV.

    Attributes:
        num_slots: slots in the pool (ids `0 .. num_slots - 1`).

    A model with linear-attention layers keeps, per running sequence, a fixed-size state (a
    convolution window and a recurrent matrix per such layer) in one slot. A sequence holds a
    slot from its admission until it is preempted, aborted or finished; slots are never shared
    and never cached (a freed slot's contents are dead: the next holder starts from zeros).
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest id first
        self._held: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._held)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        """A free slot id, now held (RuntimeError when none is free)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back (ValueError if it is not held: a double free is a bug)."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)
