"""Slot numbers handed out lowest first and given back (the draft-info pool's, a model's KV cache's).

The pool keeps the bookkeeping; its owner says what a slot is and words the errors.
"""
from __future__ import annotations

import numpy as np


class SlotPool:
    """Slots `first` .. `count - 1` (a pool whose slot 0 is padding starts at 1)."""

    def __init__(self, count: int, *, first: int = 0) -> None:
        self.count = count
        self.free = list(range(count - 1, first - 1, -1))  # popped from the end: lowest first
        self.in_use = np.zeros(count, dtype=bool)  # [count] whether each slot is handed out (read-only outside)

    def take(self) -> int | None:
        """The lowest free slot, now in use; None when every slot is."""
        if not self.free:
            return None
        slot = self.free.pop()
        self.in_use[slot] = True
        return slot

    def holds(self, slot: int) -> bool:
        """Whether `slot` is handed out."""
        return 0 <= slot < self.count and bool(self.in_use[slot])

    def give_back(self, slot: int) -> None:
        """`slot` is free again (the owner checked `holds`)."""
        self.in_use[slot] = False
        self.free.append(slot)
