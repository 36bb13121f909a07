"""A decoder's KV cache: per layer one key and one value tensor `[num_slots, cache_len,
kv_heads, head_dim]`, and the slots it hands out to requests (`CausalLM.allocate_slot`).

The cache starts uninitialised and is zeroed only where attention comes to read masked
padding (`make_finite`), so cache memory no request reaches is never committed.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from engine.host.slot_pool import SlotPool


def check_fits_memory(shape: tuple[int, int, int, int], num_layers: int, device: torch.device, dtype: torch.dtype,
                      max_context: int) -> None:
    """On CPU, a cache of `num_layers` key and value tensors of `shape` larger than the
    machine's memory is refused before anything is allocated, naming the fields that size
    it (an allocation error says neither)."""
    if device.type != "cpu":
        return
    num_slots, cache_len, kv_heads, head_dim = shape
    per_slot = 2 * num_layers * cache_len * kv_heads * head_dim * dtype.itemsize
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_slots * per_slot > memory:
        raise ValueError(f"num_slots={num_slots}: the KV cache would take {num_slots * per_slot / 2**30:.1f} GiB "
                         f"({per_slot / 2**20:.0f} MiB per slot at max_context={max_context}) and the machine has "
                         f"{memory / 2**30:.0f} GiB; lower num_slots (the loop's max_num_reqs) or max_context")


class KVCache:
    """Keys and values of `num_slots` requests of up to `max_context` positions each
    (`cache_len` >= `max_context`: batch-invariant attention reads whole key tiles)."""

    ZERO_GRAIN = 256  # positions zeroed at a time by `make_finite`

    def __init__(self, *, num_layers: int, num_slots: int, cache_len: int, max_context: int, kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_slots, cache_len, kv_heads, head_dim)
        check_fits_memory(shape, num_layers, device, dtype, max_context)
        self.num_slots = num_slots
        self.cache_len = cache_len
        self.max_context = max_context
        # Uninitialised on purpose: see the module docstring.
        self.k_cache = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v_cache = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.slots = SlotPool(num_slots)
        # Positions below this hold finite values (written, copied or zeroed); see `make_finite`.
        self._finite_upto = np.zeros(num_slots, dtype=np.int64)

    def allocate(self) -> int:
        """A free slot (the lowest), now in use. **Raises** RuntimeError when none is free."""
        slot = self.slots.take()
        if slot is None:
            raise RuntimeError(f"all {self.num_slots} KV-cache slots are in use")
        return slot

    def is_allocated(self, slot: int) -> bool:
        return self.slots.holds(slot)

    def first_unallocated(self, slots: np.ndarray) -> int | None:
        """The index of the first of `slots` [n] int64 not allocated, or None."""
        bad = (slots < 0) | (slots >= self.num_slots)
        bad[~bad] = ~self.slots.in_use[slots[~bad]]
        return int(bad.argmax()) if bad.any() else None

    def free(self, slot: int) -> None:
        """Give `slot` back; its contents are garbage to its next owner.
        **Raises** ValueError when it is not allocated."""
        if not self.is_allocated(slot):
            raise ValueError(f"KV-cache slot {slot} is not allocated")
        self.slots.give_back(slot)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the keys and values of cache positions `[0, length)` from one slot to another.

        The decode loop's prefix sharing: a request whose prompt starts like one already
        prefilled takes those positions instead of computing them. A position's keys and
        values depend only on the tokens up to it, so (in batch-invariant mode, bit for bit)
        the copy equals what prefilling the destination would have written.
        """
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not self.is_allocated(slot):
                raise ValueError(f"copy_prefix: {name}={slot} is not an allocated KV-cache slot")
        if src_slot == dst_slot:
            raise ValueError(f"copy_prefix: src_slot and dst_slot are both {src_slot}")
        if not 0 <= length <= self.max_context:
            raise ValueError(f"copy_prefix: length={length} must be in [0, {self.max_context}]")
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst_slot, :length] = cache[src_slot, :length]

    def make_finite(self, slots: np.ndarray, seqlens_k: np.ndarray, needed: np.ndarray) -> None:
        """Zero the cache positions a step's attention reads past each request's context:
        request i (slot `slots[i]`, context `seqlens_k[i]`) reads positions below `needed[i]`.

        Masked padding (up to the longest context of a one-call decode, or to the end of the
        last key tile in batch-invariant mode) gets probability 0, but uninitialised memory
        there could hold NaN, and 0 * NaN is NaN. A slot is zeroed from its finite prefix
        upwards in grains of `ZERO_GRAIN` positions, so this runs rarely and untouched cache
        memory is never committed. The zeroed range starts at or past `seqlen_k`, clear of
        the positions this step writes."""
        lo = np.maximum(self._finite_upto[slots], seqlens_k)
        hi = np.minimum(-(-needed // self.ZERO_GRAIN) * self.ZERO_GRAIN, self.cache_len)
        for slot, start, end in zip(slots[lo < needed], lo[lo < needed], hi[lo < needed]):
            for cache in (*self.k_cache, *self.v_cache):
                cache[slot, start:end].zero_()
        self._finite_upto[slots] = np.maximum(lo, np.where(lo < needed, hi, lo))
