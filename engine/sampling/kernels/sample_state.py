"""The sampling kernel's row state between phases (`engine.sampling.kernels.sample_kernel`):
its columns in `SampleScratch`, and one digit of a cut, the phase that reads and writes the
most of it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.kernels.arrivals import arrive
from engine.sampling.kernels.kept_set import LIST_CAP, digit_histogram, digit_select

# Row state (`SampleScratch.state_i` [rows, STATE_COLS] int64, `state_f` [rows, 2] f32, `level`
# [rows] f64): what one phase's merge leaves for the next phases of the row.
STATE_COLS = 16
BEST_ID: tl.constexpr = tl.constexpr(0)  # the first index of the masked maximum (the greedy token)
ERROR: tl.constexpr = tl.constexpr(1)  # RowError
CUT_K: tl.constexpr = tl.constexpr(2)  # top-k's key cut (KEY_MAX: off)
CUT: tl.constexpr = tl.constexpr(3)  # the kept set's key cut, top-k and top-p
LO: tl.constexpr = tl.constexpr(4)  # the radix select's settled digits
TOTAL: tl.constexpr = tl.constexpr(5)  # the radix select's total weight
KEPT_TOTAL: tl.constexpr = tl.constexpr(6)  # the kept masses' total
DRAWN: tl.constexpr = tl.constexpr(7)  # the drawn token
ABOVE: tl.constexpr = tl.constexpr(8)  # kept tokens above a known token (processed rank)
SETTLED: tl.constexpr = tl.constexpr(9)  # the kept list settled the row (`kept_list.settle`)
LISTED: tl.constexpr = tl.constexpr(10)  # ids on the row's kept list (0 between cuts)
BEST: tl.constexpr = tl.constexpr(0)  # state_f: M, the masked maximum
RAW_MAX: tl.constexpr = tl.constexpr(1)  # state_f: the logits' maximum
# Per program partials (`part_i` [slots, 4] int64, `part_f` [slots, 2] f32, `part_top` [slots, TOP]).
P_BEST_ID: tl.constexpr = tl.constexpr(0)
P_NOT_FINITE: tl.constexpr = tl.constexpr(1)
P_MASS: tl.constexpr = tl.constexpr(2)
P_ABOVE: tl.constexpr = tl.constexpr(3)

@triton.jit
def cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p,
               state_i, state_f, level_ptr, hist_row, arrivals_ptr, do_cut, gather, list_row, kept_row, raw, mass_ptr,
               COUNT: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
               LAST: tl.constexpr, CHUNK: tl.constexpr, NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr,
               ACCURATE: tl.constexpr, WRITE_KEPT: tl.constexpr):
    """One digit of a cut (COUNT: top-k; else top-p over what min-p and top-k leave): this
    program's part of the histogram, then the last arrival selects the digit; the LAST digit
    writes the cut (top-k's also as the kept set's, until top-p narrows it) and, `gather`,
    lists the ids the cut may keep; the FIRST, `raw`, sums this part's raw masses into `mass_ptr`.
    Returns whether this program merged (and settles the list)."""
    merged = tl.zeros((), dtype=tl.int1)
    if do_cut:
        best = tl.load(state_f + BEST, cache_modifier=".cg")
        shift = tl.where(best > -float("inf"), best, 0.0)
        lo = tl.load(state_i + LO, cache_modifier=".cg").to(tl.int32)
        cut_k = tl.load(state_i + CUT_K, cache_modifier=".cg").to(tl.int32)
        raw_mass = digit_histogram(lo, score_row, start, stop, stop_row, active, shift, temperature, min_p_floor,
                                   cut_k, hist_row, gather, list_row, state_i + LISTED, kept_row, raw,
                                   tl.load(state_f + RAW_MAX, cache_modifier=".cg"), COUNT, SHIFT, BITS, FIRST,
                                   CHUNK, NUM_STOP, MASS_SCALE, ACCURATE, LAST, WRITE_KEPT, LIST_CAP)
        if FIRST:
            if raw:
                tl.store(mass_ptr, raw_mass)
        merged = arrive(arrivals_ptr, row, parts)
        if merged:
            total = tl.load(state_i + TOTAL, cache_modifier=".cg")
            level = tl.load(level_ptr + row, cache_modifier=".cg")
            cut_k = tl.load(state_i + CUT_K, cache_modifier=".cg").to(tl.int32)
            lo = tl.load(state_i + LO, cache_modifier=".cg").to(tl.int32)
            lo, total, level = digit_select(lo, total, level, top_p, hist_row, COUNT, SHIFT, BITS, FIRST)
            if LAST:
                if COUNT:
                    tl.store(state_i + CUT_K, lo.to(tl.int64))
                    tl.store(state_i + CUT, lo.to(tl.int64))
                    tl.store(state_i + LO, tl.zeros((), dtype=tl.int64))  # top-p's select starts afresh
                else:
                    tl.store(state_i + CUT, tl.minimum(cut_k, lo).to(tl.int64))
            else:
                tl.store(state_i + LO, lo.to(tl.int64))
                tl.store(state_i + TOTAL, total)
                tl.store(level_ptr + row, level)
    return merged
