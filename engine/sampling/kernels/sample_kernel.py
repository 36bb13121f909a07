"""The sampler on CUDA, the kernel: kept set, draw and logprobs of every row (its launcher,
scratch and ahead-of-time builds: `engine.sampling.kernels.sample`).

`sample_rows` (torch op `engine::sample_rows`) computes what `engine.sampling.sampler.sample`
computes, in vLLM's stage order (temperature, min-p, top-k, top-p), from the controlled
scores and the unprocessed logits, into a `SampleOutput`. Every row takes its own branch
inside the kernel, so one launch serves greedy, plain, filtered, logprob and processed-
logprob rows alike: no step variants.

Design
- Phases. The work of a row is a chain of nine phases, each one pass over the row (or
  nothing, where the row's kind skips it) followed by a merge: pass 1 (0), three radix
  digits of top-k (1-3), three of top-p (4-6), the draw's pass (7), the logprob pass and
  the outputs (8). Each phase needs the merged result of the one before (the next digit's
  window, the cut, the drawn token). A cut's last digit (3, or 6 without top-k) also lists
  the ids it may keep; where the list fits (`kept_list`, 1024 ids) its merge settles top-p,
  the draw and the logprobs' ranks (the raw masses sum in the cut's first pass where the
  scores are the logits): the row skips phases 4-7 and the logprob pass.
- Split rows. A launch is (rows, parts): program (r, c) streams one span of whole chunks of
  row r (`split`); its partials merge into the row's state (`SampleScratch`) by `arrivals`.
  One part per row runs all nine phases in one launch; more parts (rows fewer than the SMs)
  make one launch per phase.
- Passes over the row, by row kind (V tokens read per pass; the draw also reads the one
  block of 1024 tokens it lands in), whatever the row's values but the lists' fit
  (tests/test_kernel_passes.py counts the interpreter's loads and holds the kernel to it):
    greedy or forced, no logprobs ...................... 1 (pass 1 finds the token; nothing else runs)
    greedy or forced + raw logprobs .................... 2
    greedy + processed logprobs ........................ 2 (no cuts: a greedy request has no filters, as vLLM)
    forced + processed logprobs ........................ 2 (+ 3 for its request's cuts)
    sampled, no cut or min-p only ...................... 2, 3 with logprobs
    top-k and/or top-p, the list fits .................. 4 (pass 1, 3 radix passes; raw logprobs with controls: 5)
    top-k's list overflows, top-p's fits ............... 7
    worst: both overflow (thousands kept), logprobs .... 9
  A controlled row handed its pass 1 (`PassOne`) skips it: 3 with top-k and raw logprobs;
  handed its raw masses too (`handed_raw`), no logprob pass if its token is on the raw top-N.
  Each exact cut is a selection over 31-bit keys (top-p's after top-k's) in three radix
  passes: no program holds a row or a wide histogram on chip. Grid: (rows, parts), 8 warps,
  1024 tokens per step of a pass. Pass 1: the masked maximum M and its first index (the
  greedy token), the logits' finite check, maximum and top-N. The cuts: `kept_set`. The
  draw's pass: the kept masses per block of 1024, the processed top-N; its merge draws.
  The logprob pass: the raw normaliser and the rank.
- Scratch (`SampleScratch`, fixed shapes): per row a histogram, the kept list, block masses,
  the state, top-N and arrival counter; per program slot its partials.
- Exact: counts and masses are integers, so every sum is the torch path's whatever the order
  of addition; the kernel compiles without FMA contraction and divides with IEEE rounding.
  What may differ is `exp` by an ulp between implementations (docs/contract.md §2): on CUDA
  the kernel calls libdevice's, which torch's CUDA kernels call too.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError
from engine.sampling.kernels.kept_list import settle
from engine.sampling.kernels.kept_set import (
    KEY_MAX, LIST_CAP, chunk_survivors, chunk_values, exp_f32, fold_max, log_f64, masked_scores, raw_partials,
)
from engine.sampling.kernels.arrivals import arrive, row_part_slots
from engine.sampling.kernels.sample_state import (
    ABOVE, BEST, BEST_ID, CUT, CUT_K, DRAWN, ERROR, KEPT_TOTAL, LISTED, LO, P_ABOVE, P_BEST_ID, P_MASS, P_NOT_FINITE,
    RAW_MAX, SETTLED, STATE_COLS, TOTAL, cut_digit,
)
from engine.sampling.kernels.top_n import (ABSENT, key_ids, key_values, merge_top, on_list, rank_keys, token_key,
                                           top_of_lists)

LOGPROBS_MODES = {None: 0, "raw": 1, "processed": 2}
NUM_WARPS = 8
GPU_CHUNK = 1024  # tokens per step of a pass on a GPU: 4 per thread of 8 warps (2048 spills once the phases merge)
MAX_PROGRAMS = 512  # programs a split launch spreads its rows over at most (the scratch's partial slots)
NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.LOGITS_NOT_FINITE))
NO_TOKEN_ALLOWED: tl.constexpr = tl.constexpr(int(RowError.NO_TOKEN_ALLOWED))
NOTHING_LEFT: tl.constexpr = tl.constexpr(int(RowError.NOTHING_LEFT))
SCORES_NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.SCORES_NOT_FINITE))
PLACEHOLDER: tl.constexpr = tl.constexpr(PLACEHOLDER_TOKEN)


PHASES = 9  # pass 1, three top-k digits, three top-p digits, the draw's pass, the logprob pass


@triton.jit
def sample_kernel(
    scores_ptr, logits_ptr, stride_scores, stride_logits,
    temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, row_to_req_ptr, stop_ids_ptr, stride_stop,
    eos_rows_ptr, forced_ptr, uniforms_ptr, nothing_allowed_ptr,
    hist_ptr, block_mass_ptr, stride_hist, stride_blocks,
    tokens_ptr, logprob_ptr, rank_ptr, top_ids_ptr, top_logprobs_ptr, error_ptr, stride_top,
    row_controlled_ptr, kept_weights_ptr, mass_total_ptr, one_hot_ptr, stride_weights,
    state_i_ptr, state_f_ptr, level_ptr, part_i_ptr, part_f_ptr, part_top_ptr, row_top_ptr, arrivals_ptr, list_ptr,
    handed_f_ptr, handed_i_ptr, handed_top_ptr, stride_part_top, stride_row_top, stride_handed_top, span, parts,
    V: tl.constexpr, NUM_STOP: tl.constexpr, NUM_TOP: tl.constexpr, TOP_PAD: tl.constexpr,
    LOGPROBS: tl.constexpr, SEPARATE_LOGITS: tl.constexpr, HAS_NOTHING_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
    MASS_BITS: tl.constexpr, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    HAS_ROW_CONTROLLED: tl.constexpr, WRITE_KEPT: tl.constexpr, FIRST_PHASE: tl.constexpr,
    LAST_PHASE: tl.constexpr, PARTS_PAD: tl.constexpr, HANDED: tl.constexpr, HANDED_RAW: tl.constexpr,
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
    # wins ties, as the first chunk does in a part) and opens the row's state. HANDED: the
    # controls kernel found them for each row it controlled (`PassOne`), which skips the pass.
    if FIRST_PHASE == 0:
        handed = tl.zeros((), dtype=tl.int1)
        if HANDED:
            handed = tl.load(row_controlled_ptr + row) != 0
        best = tl.full((), -float("inf"), tl.float32)
        best_id = tl.zeros((), dtype=tl.int64)
        raw_max = tl.full((), -float("inf"), tl.float32)
        not_finite = tl.zeros((), dtype=tl.int1)
        raw_top = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
        for base in range(start, tl.where(handed, start, stop), CHUNK):
            offs = base + tl.arange(0, CHUNK)
            in_row = offs < stop
            score, masked = masked_scores(score_row, offs, in_row, stop_row, active, NUM_STOP)
            best, best_id = fold_max(masked, offs, in_row, best, best_id, V)
            if SEPARATE_LOGITS:
                plain = tl.load(logit_row + offs, mask=in_row, other=0.0)
            else:
                plain = tl.where(in_row, score, 0.0)
            not_finite = not_finite | (tl.max(((plain != plain) | (tl.abs(plain) == float("inf"))).to(tl.int32), 0) > 0)
            # Lanes past the row read 0 (finite): they take no part in the maximum.
            raw_max = tl.maximum(raw_max, tl.max(tl.where(in_row & (plain == plain), plain, -float("inf")), 0))
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                raw_top = merge_top(raw_top, rank_keys(plain, offs, in_row, ID_BITS, ID_MASK), TOP_PAD)
        tl.store(part_f_ptr + slot * 2 + BEST, best)
        tl.store(part_f_ptr + slot * 2 + RAW_MAX, raw_max)
        tl.store(part_i_ptr + slot * 4 + P_BEST_ID, best_id)
        tl.store(part_i_ptr + slot * 4 + P_NOT_FINITE, not_finite.to(tl.int64))
        if (LOGPROBS == 1) and (NUM_TOP > 0):
            tl.store(part_top_ptr + slot * stride_part_top + lane, raw_top)
        if arrive(arrivals_ptr, row, parts):
            # Every part's partials in one load each (no round trip per part). M's first index is
            # the first part's holding M (ids grow with the parts).
            part_slots, my_parts = row_part_slots(row, parts, PARTS_PAD)
            part_best = tl.load(part_f_ptr + part_slots * 2 + BEST, mask=my_parts, other=-float("inf"),
                                cache_modifier=".cg")
            best = tl.max(part_best, 0)
            first_part = tl.argmax(part_best, 0, tie_break_left=True)  # masked-off parts read -inf
            best_id = tl.load(part_i_ptr + (row * parts + first_part) * 4 + P_BEST_ID, cache_modifier=".cg")
            raw_max = tl.max(tl.load(part_f_ptr + part_slots * 2 + RAW_MAX, mask=my_parts, other=-float("inf"),
                                     cache_modifier=".cg"), 0)
            not_finite = tl.max(tl.load(part_i_ptr + part_slots * 4 + P_NOT_FINITE, mask=my_parts, other=0,
                                        cache_modifier=".cg").to(tl.int32), 0) != 0
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                raw_top = top_of_lists(tl.load(part_top_ptr + part_slots[:, None] * stride_part_top + lane[None, :],
                                               mask=my_parts[:, None], other=ABSENT, cache_modifier=".cg"), TOP_PAD)
            if handed:
                best = tl.load(handed_f_ptr + row * 2, cache_modifier=".cg")
                raw_max = tl.load(handed_f_ptr + row * 2 + 1, cache_modifier=".cg")
                best_id = tl.load(handed_i_ptr + row * 3, cache_modifier=".cg")
                not_finite = tl.load(handed_i_ptr + row * 3 + 1, cache_modifier=".cg") != 0
                if (LOGPROBS == 1) and (NUM_TOP > 0):
                    raw_top = tl.load(handed_top_ptr + row * stride_handed_top + lane, cache_modifier=".cg")
            if HAS_NOTHING_ALLOWED:
                nothing_allowed = tl.load(nothing_allowed_ptr + row)
            else:
                nothing_allowed = tl.zeros((), dtype=tl.int1)
            left = tl.where(nothing_allowed, NO_TOKEN_ALLOWED, tl.where(best == -float("inf"), NOTHING_LEFT, 0))
            # A control that makes a finite logit +inf (a penalty near 0) fails the row; it shows in
            # `best`. The validated controls (finite bias and penalties) make no NaN of a finite logit.
            error = tl.where(not_finite, NOT_FINITE, tl.where(best == float("inf"), SCORES_NOT_FINITE, left))
            tl.store(state_f + BEST, best)
            tl.store(state_f + RAW_MAX, raw_max)
            tl.store(state_i + BEST_ID, best_id)
            tl.store(state_i + ERROR, error.to(tl.int64))
            tl.store(state_i + CUT_K, tl.full((), KEY_MAX, tl.int64))
            tl.store(state_i + CUT, tl.full((), KEY_MAX, tl.int64))
            tl.store(state_i + LO, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + TOTAL, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + KEPT_TOTAL, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + ABOVE, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + SETTLED, tl.zeros((), dtype=tl.int64))
            tl.store(state_i + LISTED, tl.zeros((), dtype=tl.int64))
            tl.store(level_ptr + row, top_k.to(tl.float64))  # top-k's level; top-p counts its own
            if (LOGPROBS == 1) and (NUM_TOP > 0):
                tl.store(row_top + lane, raw_top)
        if LAST_PHASE > 0:
            tl.debug_barrier()

    # What pass 1 left: the row's failure, and whether it needs its kept set.
    best_id = tl.load(state_i + BEST_ID, cache_modifier=".cg")
    failed = tl.load(state_i + ERROR, cache_modifier=".cg") != 0
    # A forced token skips the draw: its row needs the kept set only for processed logprobs.
    needs_distribution = (~token_known | (LOGPROBS == 2)) & ~failed
    do_k = needs_distribution & k_on
    do_p = needs_distribution & (top_p < 1.0) & ~greedy
    top_p64 = top_p.to(tl.float64)

    # Phases 1-6, the cuts in vLLM's order: min-p (elementwise), top-k over every token,
    # top-p over what both leave; three radix digits each. A cut's last digit also lists the
    # tokens it may keep; the merge settles the row from a list that fits (`kept_list`), and
    # a settled row skips the later cuts and the draw's pass.
    known_token = tl.where(forced >= 0, forced, best_id)
    raw_early = (LOGPROBS == 1) & ~token_known & (do_k | do_p)  # raw logprobs from the cuts' passes
    if SEPARATE_LOGITS:
        raw_early = raw_early & HAS_ROW_CONTROLLED & (tl.load(row_controlled_ptr + row) == 0)
    best = tl.load(state_f + BEST, cache_modifier=".cg")
    shift = tl.where(best > -float("inf"), best, 0.0)
    list_row = list_ptr + row * LIST_CAP
    kept_row = kept_weights_ptr + row.to(tl.int64) * stride_weights
    for d in tl.static_range(6):
        if (FIRST_PHASE <= d + 1) and (LAST_PHASE >= d + 1):
            settled = tl.load(state_i + SETTLED, cache_modifier=".cg") != 0
            do_cut = do_k if d < 3 else do_p & ~settled
            merged = cut_digit(row, parts, start, stop, score_row, stop_row, active, temperature, min_p_floor,
                                top_p64, state_i, state_f, level_ptr, hist_row, arrivals_ptr, do_cut, do_cut,
                                list_row, kept_row, raw_early & (do_k == (d == 0)), part_i_ptr + slot * 4 + P_MASS,
                                d < 3, (2 - d % 3) * 10, 11 if d % 3 == 0 else 10, d % 3 == 0,
                                d % 3 == 2, CHUNK, NUM_STOP, MASS_SCALE, ACCURATE, WRITE_KEPT)
            if d % 3 == 2:
                tl.debug_barrier()
                if merged:
                    cut = tl.load(state_i + CUT, cache_modifier=".cg").to(tl.int32)
                    settled = settle(list_row, tl.load(state_i + LISTED, cache_modifier=".cg"), score_row, stop_row,
                                     active, shift, temperature, min_p_floor, cut, top_p64, do_p & (d < 3),
                                     token_known, known_token, tl.load(uniforms_ptr + row), raw_early, state_i,
                                     row_top, kept_row, CUT, KEPT_TOTAL, DRAWN, ABOVE, LOGPROBS, NUM_TOP, TOP_PAD,
                                     V, NUM_BLOCKS, BLOCK_TOKENS, NUM_STOP, MASS_SCALE, ACCURATE, ID_BITS, ID_MASK,
                                     WRITE_KEPT, LIST_CAP)
                    tl.store(state_i + SETTLED, settled.to(tl.int64))
                    tl.store(state_i + LISTED, tl.zeros((), dtype=tl.int64))
            tl.debug_barrier()

    settled = tl.load(state_i + SETTLED, cache_modifier=".cg") != 0

    # Phase 7, the draw's pass over the part: kept masses per block, the processed top-N and
    # a known token's rank; the last arrival totals the blocks, draws, merges the top-N.
    if (FIRST_PHASE <= 7) and (LAST_PHASE >= 7):
        if needs_distribution & ~settled:
            cut = tl.load(state_i + CUT, cache_modifier=".cg").to(tl.int32)
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
            tl.store(part_i_ptr + slot * 4 + P_ABOVE, above)
            if (LOGPROBS == 2) and (NUM_TOP > 0):
                tl.store(part_top_ptr + slot * stride_part_top + lane, kept_top)
            if arrive(arrivals_ptr, row, parts):
                block_idx = tl.arange(0, BLOCKS_PAD)
                block_cum = tl.cumsum(tl.load(blocks_row + block_idx, mask=block_idx < NUM_BLOCKS, other=0,
                                              cache_modifier=".cg"), 0)
                total = tl.sum(tl.where(block_idx == NUM_BLOCKS - 1, block_cum, 0), 0)
                part_slots, my_parts = row_part_slots(row, parts, PARTS_PAD)
                above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + P_ABOVE, mask=my_parts, other=0,
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
                tl.store(state_i + KEPT_TOTAL, total)
                tl.store(state_i + DRAWN, drawn)
                tl.store(state_i + ABOVE, above)
                if (LOGPROBS == 2) and (NUM_TOP > 0):
                    tl.store(row_top + lane, kept_top)
        tl.debug_barrier()

    # Phase 8, the logprob pass over the part where the token was not known before the draw;
    # the last arrival (every row arrives) writes the row's outputs.
    if LAST_PHASE == 8:
        cut = tl.load(state_i + CUT, cache_modifier=".cg").to(tl.int32)
        drawn = tl.load(state_i + DRAWN, cache_modifier=".cg")
        token = tl.where(forced >= 0, forced, tl.where(greedy, best_id, drawn))
        token = tl.where(failed, PLACEHOLDER, token)
        raw_max = tl.load(state_f + RAW_MAX, cache_modifier=".cg")
        if LOGPROBS == 1:
            if SEPARATE_LOGITS:
                token_raw = tl.load(logit_row + token)
            else:
                token_raw = tl.load(score_row + token)
            # A handed row's raw masses were summed by the controls kernel; its token's rank comes
            # from the raw top list where the token is on it (every larger logit is then too).
            listed_rank = tl.zeros((), dtype=tl.int1)
            if HANDED_RAW:
                listed_rank = (tl.load(row_controlled_ptr + row) != 0) & \
                    on_list(token_key(token_raw, token, ID_BITS, ID_MASK),
                            tl.load(handed_top_ptr + row * stride_handed_top + lane))
            if ~failed & ~(raw_early & settled):  # else the first cut pass and the kept list did
                if listed_rank:  # the controls kernel's sum and the list's count, as the first part's
                    raw_mass = tl.zeros((), dtype=tl.int64)
                    above = tl.zeros((), dtype=tl.int64)
                    if part == 0:
                        raw_mass = tl.load(handed_i_ptr + row * 3 + 2)
                        value_bits = token_key(token_raw, token, ID_BITS, ID_MASK) >> ID_BITS
                        handed_top = tl.load(handed_top_ptr + row * stride_handed_top + lane)
                        above = tl.sum(((handed_top >> ID_BITS) > value_bits).to(tl.int64), 0)
                else:
                    raw_mass, above = raw_partials(logit_row if SEPARATE_LOGITS else score_row, start, stop, raw_max,
                                                   token_raw, CHUNK, MASS_SCALE, ACCURATE)
                tl.store(part_i_ptr + slot * 4 + P_MASS, raw_mass)
                tl.store(part_i_ptr + slot * 4 + P_ABOVE, above)
        if LOGPROBS == 2:
            if needs_distribution & ~token_known & ~settled:
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
                tl.store(part_i_ptr + slot * 4 + P_ABOVE, above)
        if arrive(arrivals_ptr, row, parts):
            part_slots, my_parts = row_part_slots(row, parts, PARTS_PAD)
            total = tl.load(state_i + KEPT_TOTAL, cache_modifier=".cg")
            error = tl.load(state_i + ERROR, cache_modifier=".cg")
            logprob = tl.zeros((), dtype=tl.float64)
            rank = tl.zeros((), dtype=tl.int64)
            top_ids = tl.full((TOP_PAD,), -1, dtype=tl.int64)
            top_logprobs = tl.zeros((TOP_PAD,), dtype=tl.float64)
            if LOGPROBS == 1:
                raw_mass = tl.zeros((), dtype=tl.int64)
                above = tl.zeros((), dtype=tl.int64)
                if ~failed:
                    raw_mass = tl.sum(tl.load(part_i_ptr + part_slots * 4 + P_MASS, mask=my_parts, other=0,
                                              cache_modifier=".cg"), 0)
                    above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + P_ABOVE, mask=my_parts, other=0,
                                           cache_modifier=".cg"), 0)
                    if raw_early & settled:
                        above = tl.load(state_i + ABOVE, cache_modifier=".cg")
                lse = raw_max.to(tl.float64) + log_f64(raw_mass.to(tl.float64) * (1.0 / MASS_SCALE), ACCURATE)
                logprob = token_raw.to(tl.float64) - lse
                rank = above + 1
                raw_top = tl.load(row_top + lane, cache_modifier=".cg")
                top_ids = key_ids(raw_top, ID_MASK)
                top_logprobs = key_values(raw_top, ID_BITS).to(tl.float64) - lse
            if LOGPROBS == 2:
                above = tl.load(state_i + ABOVE, cache_modifier=".cg")
                if needs_distribution & ~token_known & ~settled:
                    above = tl.sum(tl.load(part_i_ptr + part_slots * 4 + P_ABOVE, mask=my_parts, other=0,
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
