"""The draft-info pool's slot numbers and the take-once read rule (docs/contract.md §1.3)."""
from __future__ import annotations

import numpy as np

from engine.host.slot_pool import SlotPool


class DraftSlots:
    """Slot numbers of the draft-info pool; slot 0 is padding and never handed out.

    A slot is *fresh* after a decode step wrote draft info into it. Taking a
    read slot returns the slot if fresh, else 0, and marks it consumed, so a
    request never verifies the same drafts twice. A new request, one
    preempted and recomputed, or one just out of prefill holds no fresh slot
    and reads padding.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need slot 0 (padding) and at least one real slot")
        self.num_slots = num_slots
        self.fresh = np.zeros(num_slots, dtype=bool)
        self.slots = SlotPool(num_slots, first=1)

    def allocate(self) -> int:
        slot = self.slots.take()
        if slot is None:
            raise RuntimeError(f"draft-info pool exhausted: all {self.num_slots - 1} slots are in use")
        self.fresh[slot] = False
        return slot

    def release(self, slot: int) -> None:
        if not self.slots.holds(slot):
            raise ValueError(f"slot={slot}: not an allocated draft-info slot")
        self.fresh[slot] = False
        self.slots.give_back(slot)

    def read_slots(self, write_slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """Per request: its write slot if it holds fresh draft info and the
        request decodes this step, else 0. Consumes nothing (see `consume`)."""
        return np.multiply(write_slots, self.fresh[write_slots] & is_decode, dtype=np.int32)

    def consume(self, read_slots: np.ndarray) -> None:
        """The step that read these slots went through: they are no longer fresh."""
        self.fresh[read_slots] = False
        self.fresh[0] = False

    def take_read_slots(self, write_slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """`read_slots`, consumed at once."""
        read = self.read_slots(write_slots, is_decode)
        self.consume(read)
        return read

    def mark_written(self, slots: np.ndarray) -> None:
        """After a decode step's draft head wrote these slots (0 = no write)."""
        self.fresh[slots] = True
        self.fresh[0] = False
