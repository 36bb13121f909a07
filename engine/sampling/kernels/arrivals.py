"""The merge of a split launch (`engine.sampling.kernels.sample_kernel`): each program of a
row writes its partials to its slot and arrives on the row's counter; the last to arrive
merges every slot of the row and resets the counter (zero between phases), a barrier across
programs without a cooperative launch.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive(arrivals_ptr, row, parts):
    """Whether this program is the last of its row's `parts` to finish the phase (it resets the
    counter and merges); the barrier orders this program's stores before its arrival."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
    last = arrived == parts - 1
    if last:
        tl.store(arrivals_ptr + row, 0)
    return last


@triton.jit
def row_part_slots(row, parts, PARTS_PAD: tl.constexpr):
    """The row's parts' partial slots [PARTS_PAD], which exist (made at the merge: alive across a pass, a spill)."""
    part = tl.arange(0, PARTS_PAD)
    return row * parts + part, part < parts
