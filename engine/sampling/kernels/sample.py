"""The sampler on CUDA: kept set, draw and logprobs of every row in one Triton kernel.

`sample_rows` (torch op `engine::sample_rows`) computes what `engine.sampling.sampler.sample`
computes, in vLLM's stage order (temperature, min-p, top-k, top-p), from the controlled
scores and the unprocessed logits, into a `SampleOutput`. Every row takes its own branch
inside the kernel, so one launch serves greedy, plain, filtered, logprob and processed-
logprob rows alike: no graph-set variants.

Design
- Phases. The work of a row is a chain of nine phases, each one pass over the row (or
  nothing, where the row's kind skips it) followed by a merge: pass 1 (0), three radix
  digits of top-k (1-3), three of top-p (4-6), the draw's pass (7), the logprob pass and
  the outputs (8). Each phase needs the merged result of the one before (the next digit's
  window, the cut, the drawn token).
- Split rows. A launch is (rows, parts): program (r, c) streams tokens
  [c * span, (c + 1) * span) of row r, span a whole number of chunks (`split`: as many parts
  as the launch's programs spread over the rows, at most one per chunk). Each program
  writes its partials (maxima and first indices, top-N keys, integer masses and counts,
  the histogram's integer adds, the draw's block masses) and arrives on the row's counter;
  the last to arrive merges them in part order into the row's state (`SampleScratch`) and
  resets the counter. One part (a row per program, `programs=1`, or as many rows as
  programs) runs all nine phases in one launch; more than one part makes one launch per
  phase, so that every part of a phase is merged before any part of the next one starts
  (a barrier across programs without a cooperative launch). Nine launches at 1.3 µs of
  graph node each buy every SM at B = 1, where one program per row leaves 131 of 132 idle
  and streams the row 9 times through one SM.
- Passes over the row, by row kind (V tokens read per pass; the draw also reads the one
  block of 1024 tokens it lands in), whatever the row's values (tests/test_kernel_passes.py
  counts the interpreter's loads of the row and holds the kernel to this table):
    greedy or forced, no logprobs ...................... 1 (pass 1 finds the token; nothing else runs)
    greedy or forced + raw logprobs .................... 2
    greedy + processed logprobs ........................ 2 (no cuts: a greedy request has no filters, as vLLM)
    forced + processed logprobs ........................ 2 (+ the cuts of its request)
    sampled, no cut or min-p only ...................... 2, 3 with logprobs
    each of top-k and top-p ............................ +3 (radix passes of 11, 10 and 10 bits)
    worst: sampled, top-k and top-p, logprobs .......... 9
  Greedy costs one pass because the cuts, the draw and the logprob passes each sit behind a
  per-row branch (`needs_distribution`, the logprobs mode) that a greedy row without
  logprobs never enters: pass 1's running maximum and its first index are the token.
  More than 4 with both cuts: each exact cut is a selection over 31-bit keys and top-p's
  level needs top-k's exact cut first; a Triton program cannot hold a 129280-token row on
  chip nor keep a wide weighted histogram in shared memory, so each digit reads the row again.
  Grid: (rows, parts), 8 warps, 1024 tokens per step of a pass (4 per thread; no spills
  for sm_90, `python -m profiling.kernel_build`).
  Pass 1: the row maximum M of the masked scores and its first index (the greedy token), the
  finite check of the logits, their maximum and their top-N (raw logprobs). The cuts:
  `kept_set.digit_histogram` and `digit_select`. The draw's pass: each kept token's mass,
  summed per block of 1024 into scratch, and the processed top-N; its merge totals the
  blocks and draws: the block where the running mass passes u * total, and the token inside
  it. The logprob pass: the raw normaliser and the rank.
- Scratch (`SampleScratch`, preallocated, fixed shapes): per row one int64 histogram of 2048
  bins (zero between digits), a row of int64 block masses, the row's state and merged
  top-N and its arrival counter (zero between phases); per program slot its partials.
- Exact: counts and masses are integers, so every sum is the torch path's whatever the order
  of addition; the kernel compiles without FMA contraction and divides with IEEE rounding.
  What may differ is `exp` by an ulp between implementations (docs/contract.md §2): on CUDA
  the kernel calls libdevice's, which torch's CUDA kernels call too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError
from engine.sampling.kernels import FP_FUSION, interpreting
from engine.sampling.kernels.kept_set import (
    HIST_BINS, KEY_MAX, chunk_survivors, chunk_values, digit_histogram, digit_select, exp_f32, log_f64, masked_scores,
)
from engine.sampling.kernels.top_n import ABSENT, key_ids, key_values, merge_top, rank_keys, top_of_lists
from engine.sampling.normaliser import BLOCK, mass_bits
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput

LOGPROBS_MODES = {None: 0, "raw": 1, "processed": 2}
NUM_WARPS = 8
GPU_CHUNK = 1024  # tokens per step of a pass on a GPU: 4 per thread of 8 warps (2048 spills once the phases merge)
MAX_PROGRAMS = 512  # programs a split launch spreads its rows over at most (the scratch's partial slots)
NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.LOGITS_NOT_FINITE))
NO_TOKEN_ALLOWED: tl.constexpr = tl.constexpr(int(RowError.NO_TOKEN_ALLOWED))
NOTHING_LEFT: tl.constexpr = tl.constexpr(int(RowError.NOTHING_LEFT))
SCORES_NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.SCORES_NOT_FINITE))
PLACEHOLDER: tl.constexpr = tl.constexpr(PLACEHOLDER_TOKEN)


# Row state (`SampleScratch.state_i` [rows, STATE_COLS] int64, `state_f` [rows, 2] f32, `level`
# [rows] f64): what one phase's merge leaves for the next phases of the row.
STATE_COLS = 16
_BEST_ID: tl.constexpr = tl.constexpr(0)  # the first index of the masked maximum (the greedy token)
_ERROR: tl.constexpr = tl.constexpr(1)  # RowError
_CUT_K: tl.constexpr = tl.constexpr(2)  # top-k's key cut (KEY_MAX: off)
_CUT: tl.constexpr = tl.constexpr(3)  # the kept set's key cut, top-k and top-p
_LO: tl.constexpr = tl.constexpr(4)  # the radix select's settled digits
_TOTAL: tl.constexpr = tl.constexpr(5)  # the radix select's total weight
_KEPT_TOTAL: tl.constexpr = tl.constexpr(6)  # the kept masses' total
_DRAWN: tl.constexpr = tl.constexpr(7)  # the drawn token
_ABOVE: tl.constexpr = tl.constexpr(8)  # kept tokens above a known token (processed rank)
_BEST: tl.constexpr = tl.constexpr(0)  # state_f: M, the masked maximum
_RAW_MAX: tl.constexpr = tl.constexpr(1)  # state_f: the logits' maximum
# Per program partials (`part_i` [slots, 4] int64, `part_f` [slots, 2] f32, `part_top` [slots, TOP]).
_P_BEST_ID: tl.constexpr = tl.constexpr(0)
_P_NOT_FINITE: tl.constexpr = tl.constexpr(1)
_P_MASS: tl.constexpr = tl.constexpr(2)
_P_ABOVE: tl.constexpr = tl.constexpr(3)
PHASES = 9  # pass 1, three top-k digits, three top-p digits, the draw's pass, the logprob pass


@triton.jit
def _arrive(arrivals_ptr, row, parts):
    """Whether this program is the last of its row's `parts` to finish the phase; that one
    resets the row's counter (zero between phases) and merges. The barrier before the
    atomic orders this program's stores (partials, histogram adds) before its arrival."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
    last = arrived == parts - 1
    if last:
        tl.store(arrivals_ptr + row, 0)
    return last


@triton.jit
def _part_slots(row, parts, PARTS_PAD: tl.constexpr):
    """The partial slots of the row's parts [PARTS_PAD] and which of them exist. Made where
    a merge reads them: kept alive across a pass, 128 of them cost sm_90 a spill."""
    part = tl.arange(0, PARTS_PAD)
    return row * parts + part, part < parts


@triton.jit
def _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p,
               state_i, state_f, level_ptr, hist_row, arrivals_ptr, do_cut,
               COUNT: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
               LAST: tl.constexpr, CHUNK: tl.constexpr, NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr,
               ACCURATE: tl.constexpr):
    """One digit of a cut (COUNT: top-k; else top-p over what min-p and top-k leave): this
    program's part of the histogram, then the last arrival selects the digit; the LAST
    digit writes the cut (top-k's cut also as the kept set's, until top-p narrows it)."""
    if do_cut:
        best = tl.load(state_f + _BEST, cache_modifier=".cg")
        shift = tl.where(best > -float("inf"), best, 0.0)
        lo = tl.load(state_i + _LO, cache_modifier=".cg").to(tl.int32)
        cut_k = tl.load(state_i + _CUT_K, cache_modifier=".cg").to(tl.int32)
        digit_histogram(lo, score_row, start, stop, stop_row, active, shift, temperature, min_p_floor, cut_k,
                        hist_row, COUNT, SHIFT, BITS, FIRST, CHUNK, NUM_STOP, MASS_SCALE, ACCURATE)
        if _arrive(arrivals_ptr, row, parts):
            total = tl.load(state_i + _TOTAL, cache_modifier=".cg")
            level = tl.load(level_ptr + row, cache_modifier=".cg")
            cut_k = tl.load(state_i + _CUT_K, cache_modifier=".cg").to(tl.int32)
            lo = tl.load(state_i + _LO, cache_modifier=".cg").to(tl.int32)
            lo, total, level = digit_select(lo, total, level, top_p, hist_row, COUNT, SHIFT, BITS, FIRST)
            if LAST:
                if COUNT:
                    tl.store(state_i + _CUT_K, lo.to(tl.int64))
                    tl.store(state_i + _CUT, lo.to(tl.int64))
                    tl.store(state_i + _LO, tl.zeros((), dtype=tl.int64))  # top-p's select starts afresh
                else:
                    tl.store(state_i + _CUT, tl.minimum(cut_k, lo).to(tl.int64))
            else:
                tl.store(state_i + _LO, lo.to(tl.int64))
                tl.store(state_i + _TOTAL, total)
                tl.store(level_ptr + row, level)


@triton.jit
def _sample_kernel(
    scores_ptr, logits_ptr, stride_scores, stride_logits,
    temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, row_to_req_ptr, stop_ids_ptr, stride_stop,
    eos_rows_ptr, forced_ptr, uniforms_ptr, nothing_allowed_ptr,
    hist_ptr, block_mass_ptr, stride_hist, stride_blocks,
    tokens_ptr, logprob_ptr, rank_ptr, top_ids_ptr, top_logprobs_ptr, needs_exact_ptr, error_ptr, stride_top,
    row_controlled_ptr, kept_weights_ptr, mass_total_ptr, one_hot_ptr, stride_weights,
    state_i_ptr, state_f_ptr, level_ptr, part_i_ptr, part_f_ptr, part_top_ptr, row_top_ptr, arrivals_ptr,
    stride_part_top, stride_row_top, span, parts,
    V: tl.constexpr, NUM_STOP: tl.constexpr, NUM_TOP: tl.constexpr, TOP_PAD: tl.constexpr,
    LOGPROBS: tl.constexpr, SEPARATE_LOGITS: tl.constexpr, HAS_NOTHING_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
    MASS_BITS: tl.constexpr, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    HAS_ROW_CONTROLLED: tl.constexpr, WRITE_KEPT: tl.constexpr, FIRST_PHASE: tl.constexpr,
    LAST_PHASE: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    slot = row * parts + part  # this program's partials
    start = part * span  # its tokens: [start, stop), whole chunks (span is a multiple of CHUNK)
    stop = tl.minimum(start + span, V)
    MASS_SCALE: tl.constexpr = 2.0 ** MASS_BITS
    score_row = scores_ptr + row.to(tl.int64) * stride_scores
    logit_row = logits_ptr + row.to(tl.int64) * stride_logits
    if HAS_ROW_CONTROLLED:
        # A row the controls kernel skipped has no controlled scores: they are its logits.
        score_row = tl.where(tl.load(row_controlled_ptr + row) != 0, score_row, logit_row)
    req = tl.load(row_to_req_ptr + row)
    stop_row = stop_ids_ptr + req * stride_stop
    active = tl.load(eos_rows_ptr + row)
    raw_temperature = tl.load(temperatures_ptr + req)
    greedy = raw_temperature == 0.0
    temperature = tl.where(greedy, 1.0, raw_temperature)
    top_k = tl.load(top_ks_ptr + req).to(tl.int64)
    top_p = tl.load(top_ps_ptr + req)
    min_p = tl.load(min_ps_ptr + req)
    # A greedy request has no filters (as vLLM): its processed logprobs are over every token.
    k_on = (top_k > 0) & (top_k < V) & ~greedy
    min_p_floor = tl.where((min_p > 0.0) & ~greedy, min_p, -1.0)  # weight >= -1 keeps every token
    forced = tl.load(forced_ptr + row)
    token_known = greedy | (forced >= 0)
    lane = tl.arange(0, TOP_PAD)
    state_i = state_i_ptr + row * 16
    state_f = state_f_ptr + row * 2
    hist_row = hist_ptr + row * stride_hist
    blocks_row = block_mass_ptr + row * stride_blocks
    row_top = row_top_ptr + row * stride_row_top

    # Phase 0, pass 1 over the part: M and the greedy token, the logits' finite check, their
    # maximum and top-N. The last arrival merges the parts in order (the first part holding M
    # wins ties, as the first chunk does in a part) and opens the row's state.
    if FIRST_PHASE == 0:
        best = tl.full((), -float("inf"), tl.float32)
        best_id = tl.zeros((), dtype=tl.int64)
        raw_max = tl.full((), -float("inf"), tl.float32)
        not_finite = tl.zeros((), dtype=tl.int1)
        scores_nan = tl.zeros((), dtype=tl.int1)  # a control made a NaN (its +inf shows in `best`)
        raw_top = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
        for base in range(start, stop, CHUNK):
            offs = base + tl.arange(0, CHUNK)
            in_row = offs < stop
            score, masked = masked_scores(score_row, offs, in_row, stop_row, active, NUM_STOP)
            clean = tl.where(masked == masked, masked, -float("inf"))  # a NaN (failed row) plays no part
            scores_nan = scores_nan | (tl.max((masked != masked).to(tl.int32), 0) > 0)
            chunk_best = tl.max(clean, 0)
            chunk_id = tl.min(tl.where(clean == chunk_best, offs, V), 0).to(tl.int64)
            best_id = tl.where(chunk_best > best, chunk_id, best_id)  # the first chunk holding M wins ties
            best = tl.maximum(best, chunk_best)
            if SEPARATE_LOGITS:
                plain = tl.load(logit_row + offs, mask=in_row, other=0.0)
            else:
                plain = tl.where(in_row, score, 0.0)
            not_finite = not_finite | (tl.max(((plain != plain) | (tl.abs(plain) == float("inf"))).to(tl.int32), 0) > 0)
            raw_max = tl.maximum(raw_max, tl.max(tl.where(plain == plain, plain, -float("inf")), 0))
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                raw_top = merge_top(raw_top, rank_keys(plain, offs, in_row, ID_BITS, ID_MASK), TOP_PAD)
        tl.store(part_f_ptr + slot * 2 + _BEST, best)
        tl.store(part_f_ptr + slot * 2 + _RAW_MAX, raw_max)
        tl.store(part_i_ptr + slot * 4 + _P_BEST_ID, best_id)
        # Bit 0: the logits are not finite; bit 1: the processed scores hold a NaN.
        tl.store(part_i_ptr + slot * 4 + _P_NOT_FINITE, not_finite.to(tl.int64) | (scores_nan.to(tl.int64) << 1))
        if (LOGPROBS == 1) and (NUM_TOP > 0):
            tl.store(part_top_ptr + slot * stride_part_top + lane, raw_top)
        if _arrive(arrivals_ptr, row, parts):
            # Every part's partials in one load each (no round trip per part). M's first index is
            # the first part's holding M (ids grow with the parts).
            part_slots, my_parts = _part_slots(row, parts, PARTS_PAD)
            part_best = tl.load(part_f_ptr + part_slots * 2 + _BEST, mask=my_parts, other=-float("inf"),
                                cache_modifier=".cg")
            best = tl.max(part_best, 0)
            first_part = tl.argmax(part_best, 0, tie_break_left=True)  # masked-off parts read -inf
            best_id = tl.load(part_i_ptr + (row * parts + first_part) * 4 + _P_BEST_ID, cache_modifier=".cg")
            raw_max = tl.max(tl.load(part_f_ptr + part_slots * 2 + _RAW_MAX, mask=my_parts, other=-float("inf"),
                                     cache_modifier=".cg"), 0)
            flags = tl.load(part_i_ptr + part_slots * 4 + _P_NOT_FINITE, mask=my_parts, other=0, cache_modifier=".cg")
            not_finite = tl.max((flags & 1).to(tl.int32), 0) != 0
            scores_nan = tl.max(((flags >> 1) & 1).to(tl.int32), 0) != 0
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                raw_top = top_of_lists(tl.load(part_top_ptr + part_slots[:, None] * stride_part_top + lane[None, :],
                                               mask=my_parts[:, None], other=ABSENT, cache_modifier=".cg"), TOP_PAD)
            if HAS_NOTHING_ALLOWED:
                nothing_allowed = tl.load(nothing_allowed_ptr + row)
            else:
                nothing_allowed = tl.zeros((), dtype=tl.int1)
            left = tl.where(nothing_allowed, NO_TOKEN_ALLOWED, tl.where(best == -float("inf"), NOTHING_LEFT, 0))
            # A control that makes a finite logit +inf (it shows in `best`) or NaN fails the row.
            error = tl.where(not_finite, NOT_FINITE,
                             tl.where(scores_nan | (best == float("inf")), SCORES_NOT_FINITE, left))
            tl.store(state_f + _BEST, best)
            tl.store(state_f + _RAW_MAX, raw_max)
            tl.store(state_i + _BEST_ID, best_id)
            tl.store(state_i + _ERROR, error.to(tl.int64))
            tl.store(state_i + _CUT_K, tl.full((), KEY_MAX, tl.int64))
            tl.store(state_i + _CUT, tl.full((), KEY_MAX, tl.int64))
            tl.store(state_i + _LO, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + _TOTAL, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + _KEPT_TOTAL, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + _ABOVE, tl.zeros((), dtype=tl.int64))
            tl.store(level_ptr + row, top_k.to(tl.float64))  # top-k's level; top-p counts its own
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                tl.store(row_top + lane, raw_top)
        if LAST_PHASE > 0:
            tl.debug_barrier()

    # What pass 1 left: the row's failure, and whether it needs its kept set.
    best_id = tl.load(state_i + _BEST_ID, cache_modifier=".cg")
    failed = tl.load(state_i + _ERROR, cache_modifier=".cg") != 0
    # A forced token skips the draw: its row needs the kept set only for processed logprobs.
    needs_distribution = (~token_known | (LOGPROBS == 2)) & ~failed
    do_k = needs_distribution & k_on
    do_p = needs_distribution & (top_p < 1.0) & ~greedy
    top_p64 = top_p.to(tl.float64)

    # Phases 1-6, the cuts in vLLM's order: min-p (elementwise), top-k over every token,
    # top-p over what both leave; three radix digits each.
    if (FIRST_PHASE <= 1) and (LAST_PHASE >= 1):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_k, True, 20, 11, True, False, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()
    if (FIRST_PHASE <= 2) and (LAST_PHASE >= 2):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_k, True, 10, 10, False, False, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()
    if (FIRST_PHASE <= 3) and (LAST_PHASE >= 3):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_k, True, 0, 10, False, True, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()
    if (FIRST_PHASE <= 4) and (LAST_PHASE >= 4):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_p, False, 20, 11, True, False, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()
    if (FIRST_PHASE <= 5) and (LAST_PHASE >= 5):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_p, False, 10, 10, False, False, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()
    if (FIRST_PHASE <= 6) and (LAST_PHASE >= 6):
        _cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor, top_p64, state_i,
                   state_f, level_ptr, hist_row, arrivals_ptr, do_p, False, 0, 10, False, True, CHUNK, NUM_STOP,
                   MASS_SCALE, ACCURATE)
        tl.debug_barrier()

    best = tl.load(state_f + _BEST, cache_modifier=".cg")
    shift = tl.where(best > -float("inf"), best, 0.0)
    known_token = tl.where(forced >= 0, forced, best_id)

    # Phase 7, the draw's pass over the part: kept masses per block, the processed top-N and
    # a known token's rank; the last arrival totals the blocks, draws, merges the top-N.
    if (FIRST_PHASE <= 7) and (LAST_PHASE >= 7):
        if needs_distribution:
            cut = tl.load(state_i + _CUT, cache_modifier=".cg").to(tl.int32)
            above = tl.zeros((), dtype=tl.int64)  # kept tokens of larger z than the known token
            kept_top = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
            if LOGPROBS == 2:
                # The known token's processed logit, kept or not (-inf when not: it ranks after every kept token).
                known_offs = known_token + tl.zeros((1,), dtype=tl.int64)
                k_masked, k_z, k_weight, k_key, k_mass = chunk_values(score_row, known_offs, known_offs < V, stop_row,
                                                                      active, shift, temperature, NUM_STOP, MASS_SCALE,
                                                                      ACCURATE)
                known_z = tl.sum(tl.where(chunk_survivors(k_masked, k_weight, k_key, min_p_floor, cut), k_z,
                                          -float("inf")), 0)
            for base in range(start, stop, CHUNK):
                offs = base + tl.arange(0, CHUNK)
                in_row = offs < stop
                masked, z, weight, key, mass = chunk_values(score_row, offs, in_row, stop_row, active, shift,
                                                            temperature, NUM_STOP, MASS_SCALE, ACCURATE)
                kept = chunk_survivors(masked, weight, key, min_p_floor, cut)
                kept_mass = tl.where(kept, mass, 0)
                per_block = tl.sum(tl.reshape(kept_mass, (CHUNK // BLOCK_TOKENS, BLOCK_TOKENS)), 1)
                block_at = base // BLOCK_TOKENS + tl.arange(0, CHUNK // BLOCK_TOKENS)
                tl.store(blocks_row + block_at, per_block, mask=block_at < NUM_BLOCKS)
                if WRITE_KEPT:
                    tl.store(kept_weights_ptr + row.to(tl.int64) * stride_weights + offs, tl.where(kept, weight, 0.0),
                             mask=in_row)
                if LOGPROBS == 2:
                    kept_z = tl.where(kept, z, -float("inf"))
                    if NUM_TOP > 0:
                        # Every token takes part: past the kept ones, the smallest ids at -inf (as vLLM lists them).
                        kept_top = merge_top(kept_top, rank_keys(kept_z, offs, in_row, ID_BITS, ID_MASK), TOP_PAD)
                    above += tl.sum((kept_z > known_z).to(tl.int64), 0)
            tl.store(part_i_ptr + slot * 4 + _P_ABOVE, above)
            if (LOGPROBS == 2) and (NUM_TOP > 0):
                tl.store(part_top_ptr + slot * stride_part_top + lane, kept_top)
            if _arrive(arrivals_ptr, row, parts):
                block_idx = tl.arange(0, BLOCKS_PAD)
                block_cum = tl.cumsum(tl.load(blocks_row + block_idx, mask=block_idx < NUM_BLOCKS, other=0,
                                              cache_modifier=".cg"), 0)
                total = tl.sum(tl.where(block_idx == NUM_BLOCKS - 1, block_cum, 0), 0)
                part_slots, my_parts = _part_slots(row, parts, PARTS_PAD)
                above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + _P_ABOVE, mask=my_parts, other=0,
                                       cache_modifier=".cg"), 0)
                if (LOGPROBS == 2) and (NUM_TOP > 0):
                    kept_top = top_of_lists(tl.load(part_top_ptr + part_slots[:, None] * stride_part_top
                                                    + lane[None, :], mask=my_parts[:, None], other=ABSENT,
                                                    cache_modifier=".cg"), TOP_PAD)
                # The draw: the first token whose running kept mass exceeds u * total (engine.sampling.draw).
                drawn = best_id
                if ~token_known:
                    target = tl.load(uniforms_ptr + row) * total.to(tl.float64)
                    block = tl.minimum(tl.sum(((block_cum.to(tl.float64) <= target) & (block_idx < NUM_BLOCKS))
                                              .to(tl.int64), 0), NUM_BLOCKS - 1)
                    before = tl.sum(tl.where(block_idx == block - 1, block_cum, 0), 0)
                    column = tl.arange(0, BLOCK_TOKENS)
                    offs = block * BLOCK_TOKENS + column
                    masked, z, weight, key, mass = chunk_values(score_row, offs, offs < V, stop_row, active, shift,
                                                                temperature, NUM_STOP, MASS_SCALE, ACCURATE)
                    inner = tl.where(chunk_survivors(masked, weight, key, min_p_floor, cut), mass, 0)
                    running = before + tl.cumsum(inner, 0)
                    pick = tl.sum((running.to(tl.float64) <= target).to(tl.int64), 0)
                    last_positive = tl.maximum(tl.max(tl.where(inner > 0, column, -1), 0), 0).to(tl.int64)
                    drawn = tl.minimum(block * BLOCK_TOKENS + tl.minimum(pick, last_positive), V - 1)
                tl.store(state_i + _KEPT_TOTAL, total)
                tl.store(state_i + _DRAWN, drawn)
                tl.store(state_i + _ABOVE, above)
                if (LOGPROBS == 2) and (NUM_TOP > 0):
                    tl.store(row_top + lane, kept_top)
        tl.debug_barrier()

    # Phase 8, the logprob pass over the part where the token was not known before the draw;
    # the last arrival (every row arrives) writes the row's outputs.
    if LAST_PHASE == 8:
        cut = tl.load(state_i + _CUT, cache_modifier=".cg").to(tl.int32)
        drawn = tl.load(state_i + _DRAWN, cache_modifier=".cg")
        token = tl.where(forced >= 0, forced, tl.where(greedy, best_id, drawn))
        token = tl.where(failed, PLACEHOLDER, token)
        raw_max = tl.load(state_f + _RAW_MAX, cache_modifier=".cg")
        if LOGPROBS == 1:
            if SEPARATE_LOGITS:
                token_raw = tl.load(logit_row + token)
            else:
                token_raw = tl.load(score_row + token)
            if ~failed:
                raw_mass = tl.zeros((), dtype=tl.int64)
                above = tl.zeros((), dtype=tl.int64)
                for base in range(start, stop, CHUNK):
                    offs = base + tl.arange(0, CHUNK)
                    in_row = offs < stop
                    if SEPARATE_LOGITS:
                        plain = tl.load(logit_row + offs, mask=in_row, other=-float("inf"))
                    else:
                        plain = tl.load(score_row + offs, mask=in_row, other=-float("inf"))
                    raw_weight = exp_f32(plain - raw_max, ACCURATE)
                    raw_mass += tl.sum((raw_weight * MASS_SCALE).to(tl.int64), 0)
                    above += tl.sum((plain > token_raw).to(tl.int64), 0)
                tl.store(part_i_ptr + slot * 4 + _P_MASS, raw_mass)
                tl.store(part_i_ptr + slot * 4 + _P_ABOVE, above)
        if LOGPROBS == 2:
            if needs_distribution & ~token_known:
                token_offs = token + tl.zeros((1,), dtype=tl.int64)
                t_masked, t_z, t_weight, t_key, t_mass = chunk_values(score_row, token_offs, token_offs < V, stop_row,
                                                                      active, shift, temperature, NUM_STOP,
                                                                      MASS_SCALE, ACCURATE)
                token_z = tl.sum(tl.where(chunk_survivors(t_masked, t_weight, t_key, min_p_floor, cut), t_z,
                                          -float("inf")), 0)
                above = tl.zeros((), dtype=tl.int64)
                for base in range(start, stop, CHUNK):
                    offs = base + tl.arange(0, CHUNK)
                    masked, z, weight, key, mass = chunk_values(score_row, offs, offs < stop, stop_row, active, shift,
                                                                temperature, NUM_STOP, MASS_SCALE, ACCURATE)
                    kept_z = tl.where(chunk_survivors(masked, weight, key, min_p_floor, cut), z, -float("inf"))
                    above += tl.sum((kept_z > token_z).to(tl.int64), 0)
                tl.store(part_i_ptr + slot * 4 + _P_ABOVE, above)
        if _arrive(arrivals_ptr, row, parts):
            part_slots, my_parts = _part_slots(row, parts, PARTS_PAD)
            total = tl.load(state_i + _KEPT_TOTAL, cache_modifier=".cg")
            error = tl.load(state_i + _ERROR, cache_modifier=".cg")
            logprob = tl.zeros((), dtype=tl.float64)
            rank = tl.zeros((), dtype=tl.int64)
            top_ids = tl.full((TOP_PAD,), -1, dtype=tl.int64)
            top_logprobs = tl.zeros((TOP_PAD,), dtype=tl.float64)
            if LOGPROBS == 1:
                raw_mass = tl.zeros((), dtype=tl.int64)
                above = tl.zeros((), dtype=tl.int64)
                if ~failed:
                    raw_mass = tl.sum(tl.load(part_i_ptr + part_slots * 4 + _P_MASS, mask=my_parts, other=0,
                                              cache_modifier=".cg"), 0)
                    above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + _P_ABOVE, mask=my_parts, other=0,
                                           cache_modifier=".cg"), 0)
                lse = raw_max.to(tl.float64) + log_f64(raw_mass.to(tl.float64) * (1.0 / MASS_SCALE), ACCURATE)
                logprob = token_raw.to(tl.float64) - lse
                rank = above + 1
                raw_top = tl.load(row_top + lane, cache_modifier=".cg")
                top_ids = key_ids(raw_top, ID_MASK)
                top_logprobs = key_values(raw_top, ID_BITS).to(tl.float64) - lse
            if LOGPROBS == 2:
                above = tl.load(state_i + _ABOVE, cache_modifier=".cg")
                if needs_distribution & ~token_known:
                    above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + _P_ABOVE, mask=my_parts, other=0,
                                           cache_modifier=".cg"), 0)
                token_offs = token + tl.zeros((1,), dtype=tl.int64)
                t_masked, t_z, t_weight, t_key, t_mass = chunk_values(score_row, token_offs, token_offs < V, stop_row,
                                                                      active, shift, temperature, NUM_STOP,
                                                                      MASS_SCALE, ACCURATE)
                token_mass = tl.sum(tl.where(chunk_survivors(t_masked, t_weight, t_key, min_p_floor, cut), t_mass, 0),
                                    0)
                log_total = log_f64(total.to(tl.float64), ACCURATE)
                logprob = log_f64(token_mass.to(tl.float64), ACCURATE) - log_total
                rank = above + 1
                kept_top = tl.load(row_top + lane, cache_modifier=".cg")
                top_ids = key_ids(kept_top, ID_MASK)
                top_weight = exp_f32(key_values(kept_top, ID_BITS), ACCURATE)
                top_mass = tl.where(top_ids >= 0, (top_weight * MASS_SCALE).to(tl.int64), 0)
                top_logprobs = log_f64(top_mass.to(tl.float64), ACCURATE) - log_total
            tl.store(tokens_ptr + row, token)
            tl.store(error_ptr + row, error)
            if WRITE_KEPT:
                # What rejection verification reads of the draw: the kept total, and the token of a
                # row whose distribution is one-hot (greedy or forced; -1: the kept weights).
                tl.store(mass_total_ptr + row, total.to(tl.float64))
                tl.store(one_hot_ptr + row, tl.where(forced >= 0, forced, tl.where(greedy, best_id, -1)))
            tl.store(needs_exact_ptr + row, tl.zeros((), dtype=tl.int1))
            if LOGPROBS != 0:
                write_logprobs = True
            else:
                write_logprobs = failed
            if write_logprobs:
                on_top = lane < NUM_TOP
                tl.store(logprob_ptr + row, tl.where(failed, 0.0, logprob).to(tl.float32))
                tl.store(rank_ptr + row, tl.where(failed, 0, rank))
                tl.store(top_ids_ptr + row * stride_top + lane, tl.where(failed, -1, top_ids), mask=on_top)
                tl.store(top_logprobs_ptr + row * stride_top + lane,
                         tl.where(failed, 0.0, top_logprobs).to(tl.float32), mask=on_top)


@dataclass
class SampleScratch:
    """The kernel's working memory, allocated once for the largest bucket (fixed shapes:
    capture-safe). Every buffer but the row state is zero between launches."""

    hist: torch.Tensor  # [rows, HIST_BINS] int64: one histogram of one radix digit per row
    block_mass: torch.Tensor  # [rows, ceil(V / BLOCK)] int64: the kept masses per block of the draw
    state_i: torch.Tensor  # [rows, STATE_COLS] int64: the row's state between phases (best id, error, cuts...)
    state_f: torch.Tensor  # [rows, 2] f32: the row's masked maximum M and its logits' maximum
    level: torch.Tensor  # [rows] f64: the radix select's level
    part_i: torch.Tensor  # [slots, 4] int64: each program's partials (best id, not finite, mass, rank count)
    part_f: torch.Tensor  # [slots, 2] f32: each program's partial maxima
    part_top: torch.Tensor  # [slots, top] int64: each program's top-N rank keys
    row_top: torch.Tensor  # [rows, top] int64: the row's merged top-N rank keys
    arrivals: torch.Tensor  # [rows] int32: the programs of the row done with the phase (0 between phases)

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str, num_top: int = 0) -> SampleScratch:
        """For up to `rows` rows of V = `vocab` and top-N lists of up to `num_top`."""
        slots = max(rows, MAX_PROGRAMS)
        top = triton.next_power_of_2(max(num_top, 1))
        i64 = dict(dtype=torch.int64, device=device)
        return cls(hist=torch.zeros(rows, int(HIST_BINS), **i64), block_mass=torch.zeros(rows, -(-vocab // BLOCK), **i64),
                   state_i=torch.zeros(rows, STATE_COLS, **i64),
                   state_f=torch.zeros(rows, 2, dtype=torch.float32, device=device),
                   level=torch.zeros(rows, dtype=torch.float64, device=device), part_i=torch.zeros(slots, 4, **i64),
                   part_f=torch.zeros(slots, 2, dtype=torch.float32, device=device),
                   part_top=torch.zeros(slots, top, **i64), row_top=torch.zeros(rows, top, **i64),
                   arrivals=torch.zeros(rows, dtype=torch.int32, device=device))


@dataclass
class KeptWeights:
    """Each row's draw as rejection verification reads it (`engine::verify_step`), preallocated."""

    weights: torch.Tensor  # [rows, V] f32: exp(z) on the kept set, 0 elsewhere
    mass_total: torch.Tensor  # [rows] f64: the kept masses' total
    one_hot_tokens: torch.Tensor  # [rows] int64: the token of a greedy or forced row, -1 otherwise

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str) -> KeptWeights:
        return cls(weights=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
                   mass_total=torch.zeros(rows, dtype=torch.float64, device=device),
                   one_hot_tokens=torch.full((rows,), -1, dtype=torch.int64, device=device))


def _chunk(vocab: int, device: torch.device) -> int:
    """Tokens per step of a pass, whole blocks of the draw: GPU_CHUNK on a CUDA device (the
    dry run's fake one included: its launches are the GPU's); on the host, in the
    interpreter, whose cost is per operation, the whole row up to 16384."""
    if device.type == "cpu":
        return min(16384, max(BLOCK, triton.next_power_of_2(vocab)))
    return GPU_CHUNK if vocab >= GPU_CHUNK else BLOCK


def _launch_constants(vocab: int, num_stop: int, num_top: int, mode: int, separate_logits: bool,
                      has_nothing_allowed: bool, has_row_controlled: bool = False,
                      write_kept: bool = False, device: torch.device = torch.device("cuda")) -> dict[str, object]:
    num_blocks = -(-vocab // BLOCK)
    id_bits = max(1, (vocab - 1).bit_length())
    return dict(V=vocab, NUM_STOP=num_stop, NUM_TOP=num_top, TOP_PAD=triton.next_power_of_2(max(num_top, 1)),
                LOGPROBS=mode, SEPARATE_LOGITS=separate_logits, HAS_NOTHING_ALLOWED=has_nothing_allowed,
                CHUNK=_chunk(vocab, device), BLOCK_TOKENS=BLOCK, NUM_BLOCKS=num_blocks,
                BLOCKS_PAD=triton.next_power_of_2(num_blocks), MASS_BITS=mass_bits(vocab),
                ID_BITS=id_bits, ID_MASK=(1 << id_bits) - 1, ACCURATE=not interpreting(),
                HAS_ROW_CONTROLLED=has_row_controlled, WRITE_KEPT=write_kept)


def split(rows: int, vocab: int, chunk: int, programs: int) -> tuple[int, int]:
    """(parts per row, tokens per part): each row over as many programs as `programs`
    spreads over the rows, in whole chunks of `chunk` tokens, every part non-empty."""
    chunks = -(-vocab // chunk)
    parts = max(1, min(chunks, programs // rows))
    span = -(-chunks // parts) * chunk
    return -(-vocab // span), span


def _parts_pad(vocab: int, chunk: int, parts: int) -> int:
    """The merges' width: 1 for one part, else the most parts a row of V can have, whatever
    the bucket: one build per vocabulary (a narrower one spilled a register on sm_90)."""
    return 1 if parts == 1 else triton.next_power_of_2(-(-vocab // chunk))


def device_programs(device: torch.device) -> int:
    """Programs a launch spreads the rows over: the SMs of a CUDA device (the dry run's fake
    device reports the ones it stands for), at most MAX_PROGRAMS; 1 elsewhere (the
    interpreter: one program per row, unless a caller asks for a split)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(MAX_PROGRAMS, torch.cuda.get_device_properties(index).multi_processor_count)


@triton_op("engine::sample_rows", mutates_args={"hist", "block_mass", "tokens", "logprob", "rank", "top_ids",
                                                "top_logprobs", "needs_exact", "error", "kept_weights",
                                                "mass_total", "one_hot_tokens", "state_i", "state_f", "level",
                                                "part_i", "part_f", "part_top", "row_top", "arrivals"})
def _sample_rows_op(scores: torch.Tensor, logits: torch.Tensor | None, temperatures: torch.Tensor,
                    top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, row_to_req: torch.Tensor,
                    stop_ids: torch.Tensor, eos_suppression_rows: torch.Tensor, forced_tokens: torch.Tensor,
                    draw_uniforms: torch.Tensor, nothing_allowed: torch.Tensor | None, hist: torch.Tensor,
                    block_mass: torch.Tensor, tokens: torch.Tensor, logprob: torch.Tensor, rank: torch.Tensor,
                    top_ids: torch.Tensor, top_logprobs: torch.Tensor, needs_exact: torch.Tensor,
                    error: torch.Tensor, logprobs_mode: int, state_i: torch.Tensor, state_f: torch.Tensor,
                    level: torch.Tensor, part_i: torch.Tensor, part_f: torch.Tensor, part_top: torch.Tensor,
                    row_top: torch.Tensor, arrivals: torch.Tensor, programs: int,
                    row_controlled: torch.Tensor | None = None, kept_weights: torch.Tensor | None = None,
                    mass_total: torch.Tensor | None = None, one_hot_tokens: torch.Tensor | None = None) -> None:
    rows, vocab = scores.shape
    if rows == 0:
        return
    plain = scores if logits is None else logits
    write_kept = kept_weights is not None
    constants = _launch_constants(vocab, stop_ids.shape[1], top_ids.shape[1], logprobs_mode, logits is not None,
                                  nothing_allowed is not None, row_controlled is not None, write_kept, scores.device)
    parts, span = split(rows, vocab, constants["CHUNK"], programs)
    # One program per row makes every phase in one launch; a split row needs every part of a
    # phase done before the next phase starts: one launch per phase (the merge of each is the
    # last program of the row to finish it).
    phases = [(0, PHASES - 1)] if parts == 1 else [(phase, phase) for phase in range(PHASES)]
    for first, last in phases:
        wrap_triton(_sample_kernel)[(rows, parts)](
            scores, plain, scores.stride(0), plain.stride(0),
            temperatures, top_ks, top_ps, min_ps, row_to_req, stop_ids, stop_ids.stride(0),
            eos_suppression_rows, forced_tokens, draw_uniforms,
            eos_suppression_rows if nothing_allowed is None else nothing_allowed,
            hist, block_mass, hist.stride(0), block_mass.stride(0),
            tokens, logprob, rank, top_ids, top_logprobs, needs_exact, error, top_ids.stride(0),
            eos_suppression_rows if row_controlled is None else row_controlled,  # never read without the flags
            kept_weights if write_kept else scores, mass_total if write_kept else logprob,
            one_hot_tokens if write_kept else tokens, kept_weights.stride(0) if write_kept else 0,
            state_i, state_f, level, part_i, part_f, part_top, row_top, arrivals, part_top.stride(0),
            row_top.stride(0), span, parts,
            **constants, FIRST_PHASE=first, LAST_PHASE=last, PARTS_PAD=_parts_pad(vocab, constants["CHUNK"], parts),
            num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
        )


def sample_rows(scores: torch.Tensor, params: RowParams, out: SampleOutput, scratch: SampleScratch, *,
                logits: torch.Tensor | None = None, nothing_allowed: torch.Tensor | None = None,
                logprobs: str | None = None, row_controlled: torch.Tensor | None = None,
                kept: KeptWeights | None = None, programs: int | None = None) -> SampleOutput:
    """Sample one token per row on the device: `engine.sampling.sampler.sample` in vLLM's
    stage order (temperature, min-p, top-k, top-p), as one kernel launch. Capture-safe.

    Parameters (all on one device, CUDA or, under `TRITON_INTERPRET=1`, CPU):
    - `scores` [rows, V] f32, unit column stride: the controlled scores (penalties, logit
      bias, allowed tokens and the token bitmask applied; EOS/stop suppression is applied
      here, from `params`);
    - `params` `RowParams` with `draw_uniforms` staged ([rows] f64); per-request controls
      (temperatures f32, top_ks int32, top_ps f32, min_ps f32, stop_ids [reqs, S] int64) and
      per-row ones (row_to_req int64, eos_suppression_rows bool, forced_tokens int64);
    - `out` the preallocated `SampleOutput` (rows, top-N = out.top_ids.shape[1]);
    - `scratch` a `SampleScratch` of at least `rows` rows for this V;
    - `logits` [rows, V] f32 or None: the unprocessed logits (the finite check and raw
      logprobs read them; None: `scores` are unprocessed);
    - `nothing_allowed` [rows] bool or None: rows whose token bitmask allows no token;
    - `logprobs` None (logprob, rank and top-N left untouched but on failed rows), "raw" or
      "processed";
    - `row_controlled` [rows] bool or None: per row, whether `scores` holds its controlled
      scores (`engine::apply_controls` wrote it); False: the row reads `logits` (then given)
      as its scores. None: every row reads `scores`;
    - `kept` a `KeptWeights` or None: also write what rejection verification reads of each
      row's draw (its kept weights, kept mass total and one-hot token).
    - `programs` the programs to spread the rows over (`split`): None, the device's
      (`device_programs`: its SMs on CUDA); 1 keeps one program per row and one launch.
      Fewer rows than programs split each row, at 9 launches (one per phase). The
      results do not depend on it.
    Returns: `out`, written in place: tokens, error (`RowError`), needs_exact (False), and
    with logprobs the token's logprob, rank and the top-N; failed rows hold the placeholder.
    Raises: ValueError on a shape, dtype, device or mode that does not fit, a missing
    `draw_uniforms`, or top-N > V.
    """
    if logprobs not in LOGPROBS_MODES:
        raise ValueError(f"logprobs={logprobs!r}: must be one of {sorted(LOGPROBS_MODES, key=str)}")
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores: {tuple(scores.shape)} {scores.dtype} stride {scores.stride()}, "
                         "expected [rows, V] float32 with unit column stride")
    rows, vocab = scores.shape
    if logits is not None and (logits.shape != scores.shape or logits.dtype != torch.float32 or logits.stride(1) != 1):
        raise ValueError(f"logits: {tuple(logits.shape)} {logits.dtype}, expected {tuple(scores.shape)} float32")
    if params.draw_uniforms is None:
        raise ValueError("params.draw_uniforms is None: the kernel reads the staged uniforms ([rows] float64)")
    if params.num_rows != rows or out.tokens.shape[0] != rows:
        raise ValueError(f"rows: scores {rows}, params {params.num_rows}, out {out.tokens.shape[0]}")
    if out.top_ids.shape[1] > vocab:
        raise ValueError(f"top-N={out.top_ids.shape[1]}: exceeds the vocabulary V={vocab}")
    if programs is None:
        programs = device_programs(scores.device)
    if not 1 <= programs <= MAX_PROGRAMS:
        raise ValueError(f"programs={programs}: must be in [1, {MAX_PROGRAMS}]")
    if scratch.row_top.shape[1] < triton.next_power_of_2(max(out.top_ids.shape[1], 1)):
        raise ValueError(f"scratch: top-N lists of {scratch.row_top.shape[1]}, expected at least "
                         f"{out.top_ids.shape[1]} (SampleScratch.allocate(num_top=...))")
    if scratch.hist.shape[0] < rows or scratch.block_mass.shape[1] != -(-vocab // BLOCK):
        raise ValueError(f"scratch: {tuple(scratch.block_mass.shape)} block masses, expected at least "
                         f"[{rows}, {-(-vocab // BLOCK)}]")
    if row_controlled is not None and logits is None:
        raise ValueError("row_controlled without logits: a skipped row reads its scores from the logits")
    if kept is not None and kept.weights.shape[0] < rows:
        raise ValueError(f"kept: {tuple(kept.weights.shape)} weights, expected at least [{rows}, {vocab}]")
    tensors = [scores, logits, nothing_allowed, row_controlled, params.draw_uniforms, out.tokens, scratch.hist,
               *vars(params).values(), *(vars(kept).values() if kept is not None else ())]
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"tensors on {sorted(map(str, devices))}: expected one device")
    torch.ops.engine.sample_rows(
        scores, logits, params.temperatures, params.top_ks, params.top_ps, params.min_ps, params.row_to_req,
        params.stop_ids, params.eos_suppression_rows, params.forced_tokens, params.draw_uniforms, nothing_allowed,
        scratch.hist, scratch.block_mass, out.tokens, out.logprob, out.rank, out.top_ids, out.top_logprobs,
        out.needs_exact, out.error, LOGPROBS_MODES[logprobs], scratch.state_i, scratch.state_f, scratch.level,
        scratch.part_i, scratch.part_f, scratch.part_top, scratch.row_top, scratch.arrivals, programs, row_controlled,
        None if kept is None else kept.weights[:rows], None if kept is None else kept.mass_total[:rows],
        None if kept is None else kept.one_hot_tokens[:rows])
    return out


def _aot_signature() -> dict[str, str]:
    """Triton types of `_sample_kernel`'s arguments (the ahead-of-time build)."""
    pointers = dict(scores_ptr="*fp32", logits_ptr="*fp32", temperatures_ptr="*fp32", top_ks_ptr="*i32",
                    top_ps_ptr="*fp32", min_ps_ptr="*fp32", row_to_req_ptr="*i64", stop_ids_ptr="*i64",
                    eos_rows_ptr="*i1", forced_ptr="*i64", uniforms_ptr="*fp64", nothing_allowed_ptr="*i1",
                    hist_ptr="*i64", block_mass_ptr="*i64", tokens_ptr="*i64", logprob_ptr="*fp32",
                    rank_ptr="*i64", top_ids_ptr="*i64", top_logprobs_ptr="*fp32", needs_exact_ptr="*i1",
                    error_ptr="*i64", row_controlled_ptr="*i1", kept_weights_ptr="*fp32", mass_total_ptr="*fp64",
                    one_hot_ptr="*i64", state_i_ptr="*i64", state_f_ptr="*fp32", level_ptr="*fp64",
                    part_i_ptr="*i64", part_f_ptr="*fp32", part_top_ptr="*i64", row_top_ptr="*i64",
                    arrivals_ptr="*i32")
    strides = ("stride_scores", "stride_logits", "stride_stop", "stride_hist", "stride_blocks", "stride_top",
               "stride_weights", "stride_part_top", "stride_row_top")
    signature = {name: pointers.get(name, "i64" if name in strides else "i32" if name in ("span", "parts")
                                    else "constexpr")
                 for name in _sample_kernel.arg_names}
    return signature


def _aot_builds() -> list[dict[str, object]]:
    """The configurations the CUDA step launches, for `profiling.kernel_build` (name, fn,
    signature, constexprs): the largest vocabulary (129280: the most draw blocks, the widest
    block cumsum; a smaller one compiles the same code with smaller constants) with 4 stop
    ids and top-20, raw and processed logprobs (no logprobs compiles a subset of raw): every
    phase in one launch (one program per row), and the split's launches of one phase each."""
    builds = []
    for mode in ("raw", "processed"):
        # The kernel head's launch: per-row controlled flags; in raw mode also rejection
        # verification's kept weights (whose graphs keep one program per row).
        for kept in (False, True) if mode == "raw" else (False,):
            phases = [(0, PHASES - 1)] + ([] if kept else [(phase, phase) for phase in range(PHASES)])
            for first, last in phases:
                constants = _launch_constants(129280, 4, 20, LOGPROBS_MODES[mode], True, True, True, kept)
                constants.update(CHUNK=GPU_CHUNK, ACCURATE=True, FIRST_PHASE=first, LAST_PHASE=last,
                                 PARTS_PAD=_parts_pad(129280, GPU_CHUNK, 1 if first != last else 2))
                which = "all phases" if first != last else f"phase {first}"
                builds.append(dict(name=f"sample_rows V=129280 {mode}{' kept' if kept else ''} {which}",
                                   fn=_sample_kernel, signature=_aot_signature(), constexprs=constants,
                                   num_warps=NUM_WARPS))
    return builds


AOT_BUILDS = _aot_builds()
