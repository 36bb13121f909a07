"""The sampling controls as one Triton kernel (launched by `engine::apply_controls`,
engine/sampling/kernels/controls.py), the CUDA twin of
`SamplingControls.apply` plus the sampler's token bitmask and EOS/stop suppression.

Per sample row, vLLM V1's order as the torch path runs it (docs/contract.md §2,
`engine.sampling.sampler`): allowed tokens -> token bitmask (structured output, bad
words) -> EOS/stop suppression under min_tokens -> logit bias -> penalties (repetition
over prompt + output, frequency and presence over the output; row j of a request counts
the drafts of its rows 0..j-1 as generated). The kernel computes the masks last: a
masked token is -inf, which the bias and the penalties leave as it is, so the values
are the same. The order matters for one flag, `nothing_allowed`: no token the bitmask
allows has a finite score after the allowed tokens, before the bias and the penalties
(`token_bitmask.apply_token_bitmask`); a penalty that overflows a huge logit to -inf
does not fail the row as the bitmask's.

Design
- Grid (rows, split): program (r, c) owns tokens [c * chunk, (c + 1) * chunk) of row r,
  so a small bucket still spreads over the SMs (`programs_per_row`). chunk is a
  multiple of BLOCK; every program of a row exists (no empty parts).
- The row's flag, read on the device: a row with control slot 0, no active stop id
  and no bitmask (`masked_rows` False) is skipped: it reads and writes no logit, and
  `row_controlled[r]` False tells the consumer to read `logits` itself. Every other
  row reads its logits once and writes the controlled row to `out` (no copy of the
  unprocessed logits: `logits` stays unprocessed for raw logprobs and the finite check).
- Pass 1, per BLOCK of tokens: the logits; the allowed-token, prompt and bitmask
  words (one int32 word per 32 tokens; the 32 lanes of a word read one address, a
  broadcast); the counts [slots, V] int32 only when the slot has penalties; the
  drafts of the row's earlier rows (at most MAX_DRAFTS scalars, resolved from the
  draft-info pool here) compared per token. Every value is computed as the torch
  ops round it: IEEE division (`div_rn`: Triton's `/` on f32 is approximate), no FMA.
- Logit bias: pass 1 leaves the biased tokens unbiased; after a barrier, the
  program recomputes each token of its chunk that has a nonzero bias (`bias_ids`,
  at most max_logit_bias, their real ids distinct; padding is (0, +0.0) and a zero
  bias changes no value) and overwrites it. The scan stops at the first all-padding
  block of entries.
- `nothing_allowed`: each program of a masked row adds its verdict to the row's
  arrival counter (`arrivals`, int32 scratch, zero between launches: the last
  program resets it). The last program to arrive knows the whole row; when no token
  is allowed it rewrites the row without the bitmask (the torch path keeps such a
  row's scores), and writes the flag. Rare (the row fails), so it costs nothing else.
- With `MAX_DRAFTS > 0` program (r, 0) also writes `resolved_drafts[r]`, the draft
  row r verifies (staged, or read from the pool when staged as -2), which the
  verification kernels read after the sampler.
- The sampler's pass 1, handed over (`PassOne`, the kernel head's launch): while a
  program holds its tokens' logits and controlled scores it also takes what the
  sampler's pass 1 would read them again for: the scores' maximum M and its first
  index, the logits' maximum, finite check and top-N. The bias step folds the biased
  scores in; where a biased token held the maximum and the bias lowered it, the
  program reads its range's scores back (rare). Every program of a controlled row then
  arrives on the row's counter and the last merges the partials in program order
  (and, for a row the bitmask leaves nothing, takes M from its rewrite). The sampler
  reads a controlled row's scores and logits once less (`sample_rows(handed=...)`).
  With `raw_max` (raw logprobs: each row's largest logit, keyed by the LM head's
  epilogue before this kernel runs) the programs also sum the row's raw masses
  floor(exp(x - max) * 2**S), integers in any order, so the sampler makes no logprob pass
  where the token is on the raw top-N; the kernel then sets `raw_max` back to 0 for the
  next step's LM head (the last program of a controlled row, program 0 of any other).

Temperature is not applied here. The processed logit is z = (s - M) / T with M the
row maximum of the controlled scores s; M is known only after a whole pass over the
row, and dividing before subtracting rounds differently. The sampler's kernels
compute z on the fly from s, M and T in the passes they make anyway.

Scratch: `arrivals` [rows] int32, zero-initialised once; `PassOne`'s partial slots. No
host syncs, no data-dependent shapes: capture-safe.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.kernels.kept_set import fold_max, raw_masses
from engine.sampling.kernels.top_n import ABSENT, key_values, merge_top, rank_keys, top_of_lists

BLOCK = 1024  # tokens per iteration of a program (H200: 8 warps, 4 f32 per thread)
BIAS_BLOCK = 128  # logit-bias entries per iteration
NUM_WARPS = 8
PROGRAMS_PER_LAUNCH = 264  # about two programs per SM of an H200 (132 SMs)
READ_FROM_POOL: tl.constexpr = tl.constexpr(-2)  # engine.host.step_fields.READ_FROM_POOL: a draft from the pool
# `arrivals` per row: programs arrived in the low 16 bits, programs that saw an allowed token above.
_ARRIVAL: tl.constexpr = tl.constexpr(1)
_ALLOWED: tl.constexpr = tl.constexpr(1 << 16)


@triton.jit
def _resolved_draft(row, row_drafts_ptr, read_rows_ptr, pool_tokens_ptr):
    """The draft row `row` verifies: the staged token, or the pool's when staged as -2."""
    staged = tl.load(row_drafts_ptr + row)
    pool_row = tl.load(read_rows_ptr + row, mask=staged == READ_FROM_POOL, other=0)
    from_pool = tl.load(pool_tokens_ptr + pool_row, mask=staged == READ_FROM_POOL, other=-1)
    return tl.where(staged == READ_FROM_POOL, from_pool, staged)


@triton.jit
def _controlled(x, tokens, mask, bias, slot, restricted, pen_on, rp, fp, pp, drafts, use_bitmask, stops,
                bitmask_row_ptr, counts_ptr, prompt_words_ptr, allowed_words_ptr, vocab, words,
                ADD_BIAS: tl.constexpr, MAX_DRAFTS: tl.constexpr, DRAFT_P2: tl.constexpr, NUM_STOPS: tl.constexpr,
                STOP_P2: tl.constexpr):
    """The controls of `tokens` [N] int, raw logits `x` [N] f32, lanes `mask`. Returns (the
    output [N] f32, the score after the allowed tokens alone [N] f32, the bitmask's verdict [N] i1).

    A flag that is a scalar masks a load through `tl.where(flag, mask, False)`: Triton's
    interpreter types `mask & flag` as int32 there, which a load refuses as its mask.
    A word of a packed bitmask holds tokens 32w .. 32w + 31, bit (token % 32)."""
    # Allowed tokens.
    word = tl.load(allowed_words_ptr + slot * words + (tokens >> 5), mask=tl.where(restricted, mask, False), other=0)
    x = tl.where(restricted, tl.where(((word >> (tokens & 31)) & 1) != 0, x, float("-inf")), x)
    permitted = x  # what the bitmask's verdict reads (vLLM's order: the masks before the bias)
    # Logit bias.
    if ADD_BIAS:
        x = x + bias
    # Penalties: counts over the output, the drafts of earlier rows included; the prompt for repetition.
    count = tl.load(counts_ptr + slot * vocab + tokens, mask=tl.where(pen_on, mask, False), other=0)
    lanes = tl.arange(0, DRAFT_P2)
    for d in tl.static_range(MAX_DRAFTS):
        count += (tokens == tl.sum(tl.where(lanes == d, drafts, 0), axis=0)).to(tl.int32)  # -1 matches none
    generated = count > 0
    word = tl.load(prompt_words_ptr + slot * words + (tokens >> 5), mask=tl.where(pen_on, mask, False), other=0)
    seen = generated | (((word >> (tokens & 31)) & 1) != 0)
    penalised = tl.where(x > 0, tl.math.div_rn(x, rp), x * rp)
    x = tl.where(seen, penalised, x)
    x = x - fp * count.to(tl.float32)
    x = x - pp * generated.to(tl.float32)
    # The token bitmask, then the suppressed stop ids (-1 in `stops`: none).
    word = tl.load(bitmask_row_ptr + (tokens >> 5), mask=tl.where(use_bitmask, mask, False), other=-1)
    allowed = ((word >> (tokens & 31)) & 1) != 0
    y = tl.where(allowed, x, float("-inf"))
    lanes = tl.arange(0, STOP_P2)
    for s in tl.static_range(NUM_STOPS):
        y = tl.where(tokens == tl.sum(tl.where(lanes == s, stops, 0), axis=0), float("-inf"), y)
    return y, permitted, allowed


@triton.jit
def _control_range(logits_row_ptr, out_row_ptr, lo, hi, use_bitmask, bitmask_row_ptr, stops, slot, restricted,
                   pen_on, rp, fp, pp, drafts, counts_ptr, prompt_words_ptr, allowed_words_ptr,
                   bias_ids_ptr, bias_values_ptr, vocab, words, num_bias,
                   BLOCK: tl.constexpr, BIAS_BLOCK: tl.constexpr, MAX_DRAFTS: tl.constexpr, DRAFT_P2: tl.constexpr,
                   NUM_STOPS: tl.constexpr, STOP_P2: tl.constexpr, HANDOFF: tl.constexpr, RAW_TOP: tl.constexpr,
                   TOP_PAD: tl.constexpr, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr, raw_max_row,
                   RAW_MASS: tl.constexpr, MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr):
    """Controlled tokens [lo, hi) of one row into `out`. Returns (1 if the bitmask allows one
    with a finite score; with HANDOFF, the sampler's pass 1 over the range: the masked maximum
    and its first index, the logits' maximum, whether one is not finite, their top-N keys;
    with RAW_MASS, the raw masses floor(exp(x - raw_max_row) * 2**S) summed)."""
    any_allowed = tl.zeros([], dtype=tl.int32)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], dtype=tl.int64)
    raw_max = tl.full([], float("-inf"), tl.float32)
    not_finite = tl.zeros([], dtype=tl.int32)
    raw_top = tl.full([TOP_PAD], ABSENT, dtype=tl.int64)
    raw_mass = tl.zeros([], dtype=tl.int64)
    for start in range(lo, hi, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        inside = tokens < hi
        x = tl.load(logits_row_ptr + tokens, mask=inside, other=0.0)
        y, v, allowed = _controlled(x, tokens, inside, 0.0, slot, restricted, pen_on, rp, fp, pp, drafts, use_bitmask,
                                    stops, bitmask_row_ptr, counts_ptr, prompt_words_ptr, allowed_words_ptr, vocab,
                                    words, False, MAX_DRAFTS, DRAFT_P2, NUM_STOPS, STOP_P2)
        # The verdict reads the scores before the bias: the bias pass below need not redo it.
        seen = inside & allowed & (v > float("-inf"))
        any_allowed = tl.maximum(any_allowed, tl.max(seen.to(tl.int32), axis=0))
        tl.store(out_row_ptr + tokens, y, mask=inside)
        if HANDOFF:
            best, best_id = fold_max(y, tokens, inside, best, best_id, vocab)
            odd = inside & ((x != x) | (tl.abs(x) == float("inf")))
            not_finite = tl.maximum(not_finite, tl.max(odd.to(tl.int32), axis=0))
            plain = tl.where(inside & (x == x), x, float("-inf"))  # the range's logits, NaN left out
            raw_max = tl.maximum(raw_max, tl.max(plain, axis=0))
            if RAW_TOP:
                raw_top = merge_top(raw_top, rank_keys(x, tokens, inside, ID_BITS, ID_MASK), TOP_PAD)
            if RAW_MASS:
                raw_mass += raw_masses(plain, raw_max_row, MASS_SCALE, ACCURATE)
    # The biased tokens are written again below: this program's stores must land first.
    tl.debug_barrier()
    live = num_bias > 0
    stale = tl.zeros([], dtype=tl.int32)  # a biased token held the maximum and the bias lowered it
    for first in range(0, num_bias, BIAS_BLOCK):
        entry = first + tl.arange(0, BIAS_BLOCK)
        in_list = tl.where(live, entry < num_bias, False)
        ids = tl.load(bias_ids_ptr + entry, mask=in_list, other=0)
        value = tl.load(bias_values_ptr + entry, mask=in_list, other=0.0)
        # Real entries come first; a block of nothing but padding (0, +0.0) ends the list.
        live = live & (tl.max(((ids != 0) | (value != 0.0)).to(tl.int32), axis=0) > 0)
        mine = in_list & (value != 0.0) & (ids >= lo) & (ids < hi)
        x = tl.load(logits_row_ptr + ids, mask=mine, other=0.0)
        y, v, allowed = _controlled(x, ids, mine, value, slot, restricted, pen_on, rp, fp, pp, drafts, use_bitmask,
                                    stops, bitmask_row_ptr, counts_ptr, prompt_words_ptr, allowed_words_ptr, vocab,
                                    words, True, MAX_DRAFTS, DRAFT_P2, NUM_STOPS, STOP_P2)
        tl.store(out_row_ptr + ids, y, mask=mine)
        if HANDOFF:
            # The maximum above saw these tokens unbiased: one that held it and is now lower
            # makes it stale (the range is read again below); a higher one is folded in.
            was, _, _ = _controlled(x, ids, mine, value, slot, restricted, pen_on, rp, fp, pp, drafts, use_bitmask,
                                    stops, bitmask_row_ptr, counts_ptr, prompt_words_ptr, allowed_words_ptr, vocab,
                                    words, False, MAX_DRAFTS, DRAFT_P2, NUM_STOPS, STOP_P2)
            was = tl.where(mine & (was == was), was, float("-inf"))
            now = tl.where(mine & (y == y), y, float("-inf"))
            stale = tl.maximum(stale, tl.max((mine & (was == best) & (now < was)).to(tl.int32), axis=0))
            best, best_id = fold_max(y, ids, mine, best, best_id, vocab)
    if HANDOFF:
        if stale != 0:  # rare: read the range's scores back
            tl.debug_barrier()
            best = tl.full([], float("-inf"), tl.float32)
            best_id = tl.zeros([], dtype=tl.int64)
            for start in range(lo, hi, BLOCK):
                tokens = start + tl.arange(0, BLOCK)
                inside = tokens < hi
                best, best_id = fold_max(tl.load(out_row_ptr + tokens, mask=inside, other=float("-inf")), tokens,
                                          inside, best, best_id, vocab)
    return any_allowed, best, best_id, raw_max, not_finite, raw_top, raw_mass


@triton.jit
def _store_pass_one(f_ptr, i_ptr, top_ptr, at, best, raw_max, best_id, not_finite, raw_mass, raw_top, lane,
                    RAW_TOP: tl.constexpr, TOP_PAD: tl.constexpr):
    """Pass 1's results into entry `at` of a `PassOne` layout (f [., 2], i [., 3], top [., TOP_PAD])."""
    tl.store(f_ptr + at * 2, best)
    tl.store(f_ptr + at * 2 + 1, raw_max)
    tl.store(i_ptr + at * 3, best_id)
    tl.store(i_ptr + at * 3 + 1, not_finite.to(tl.int64))
    tl.store(i_ptr + at * 3 + 2, raw_mass)
    if RAW_TOP:
        tl.store(top_ptr + at * TOP_PAD + lane, raw_top)


@triton.jit
def controls_kernel(
    logits_ptr, out_ptr, row_controlled_ptr, nothing_allowed_ptr, arrivals_ptr, resolved_ptr,
    row_to_req_ptr, local_step_ptr, control_slots_ptr, row_drafts_ptr, read_rows_ptr, pool_tokens_ptr,
    counts_ptr, prompt_words_ptr, penalties_ptr, bias_ids_ptr, bias_values_ptr, allowed_words_ptr, restricted_ptr,
    stop_ids_ptr, eos_rows_ptr, bitmask_ptr, masked_rows_ptr,
    pass_f_ptr, pass_i_ptr, pass_top_ptr, part_f_ptr, part_i_ptr, part_top_ptr, raw_max_ptr,
    vocab, words, num_bias, chunk, logits_stride, out_stride,
    BLOCK: tl.constexpr, BIAS_BLOCK: tl.constexpr, MAX_DRAFTS: tl.constexpr, DRAFT_P2: tl.constexpr,
    NUM_STOPS: tl.constexpr, STOP_P2: tl.constexpr, HAS_BITMASK: tl.constexpr, HAS_MASKED_ROWS: tl.constexpr,
    HANDOFF: tl.constexpr, RAW_TOP: tl.constexpr, TOP_PAD: tl.constexpr, ID_BITS: tl.constexpr,
    ID_MASK: tl.constexpr, PARTS_PAD: tl.constexpr, RAW_MASS: tl.constexpr, MASS_SCALE: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    split = tl.num_programs(1)
    req = tl.load(row_to_req_ptr + row)
    step = tl.load(local_step_ptr + row)
    slot = tl.load(control_slots_ptr + req)

    drafts = tl.full([DRAFT_P2], -1, tl.int64)  # lane d: the draft of row - (d + 1), if that row is earlier
    if MAX_DRAFTS > 0:
        lanes = tl.arange(0, DRAFT_P2)
        for d in tl.static_range(MAX_DRAFTS):
            # Row r at local step s >= d + 1 counts the draft row r - d - 1 verifies (same request).
            earlier = tl.maximum(row - d - 1, 0)
            draft = _resolved_draft(earlier, row_drafts_ptr, read_rows_ptr, pool_tokens_ptr)
            drafts = tl.where(lanes == d, tl.where(step > d, draft, -1), drafts)
        if part == 0:
            tl.store(resolved_ptr + row, _resolved_draft(row, row_drafts_ptr, read_rows_ptr, pool_tokens_ptr))

    stop_lanes = tl.arange(0, STOP_P2)
    stops = tl.load(stop_ids_ptr + req * NUM_STOPS + stop_lanes, mask=stop_lanes < NUM_STOPS, other=-1)
    stops = tl.where(tl.load(eos_rows_ptr + row) != 0, stops, -1)  # -1: never equals a token
    suppressing = tl.max(stops, axis=0) >= 0
    masked = tl.full([], HAS_BITMASK, tl.int1)
    if HAS_MASKED_ROWS:
        masked = masked & (tl.load(masked_rows_ptr + row) != 0)
    active = (slot > 0) | suppressing | masked

    if active:
        rp = tl.load(penalties_ptr + slot * 3)
        fp = tl.load(penalties_ptr + slot * 3 + 1)
        pp = tl.load(penalties_ptr + slot * 3 + 2)
        pen_on = (rp != 1.0) | (fp != 0.0) | (pp != 0.0)
        restricted = tl.load(restricted_ptr + slot) != 0
        logits_row = logits_ptr + row.to(tl.int64) * logits_stride
        out_row = out_ptr + row.to(tl.int64) * out_stride
        bitmask_row = bitmask_ptr + row.to(tl.int64) * words
        bias_ids = bias_ids_ptr + slot * num_bias
        bias_values = bias_values_ptr + slot * num_bias
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        raw_max_row = tl.zeros([], dtype=tl.float32)
        if RAW_MASS:  # the LM head's maximum of the row (`row_max_keys`), known before this pass
            raw_max_row = key_values(tl.load(raw_max_ptr + row) - 2**31, 0)  # a rank key with no id bits
        any_allowed, best, best_id, raw_max, not_finite, raw_top, raw_mass = _control_range(
            logits_row, out_row, lo, hi, masked, bitmask_row, stops, slot, restricted, pen_on, rp, fp, pp, drafts,
            counts_ptr, prompt_words_ptr, allowed_words_ptr, bias_ids, bias_values, vocab, words, num_bias,
            BLOCK, BIAS_BLOCK, MAX_DRAFTS, DRAFT_P2, NUM_STOPS, STOP_P2, HANDOFF, RAW_TOP, TOP_PAD, ID_BITS, ID_MASK,
            raw_max_row, RAW_MASS, MASS_SCALE, ACCURATE)
        lane = tl.arange(0, TOP_PAD)
        if HANDOFF:  # this program's part of the sampler's pass 1, merged by the row's last program
            _store_pass_one(part_f_ptr, part_i_ptr, part_top_ptr, row * split + part, best, raw_max, best_id,
                            not_finite, raw_mass, raw_top, lane, RAW_TOP, TOP_PAD)
        if masked | HANDOFF:
            # Every thread's stores before the arrival: the last program may overwrite them.
            tl.debug_barrier()
            before = tl.atomic_add(arrivals_ptr + row, any_allowed * _ALLOWED + _ARRIVAL)
            if (before & (_ALLOWED - 1)) == split - 1:  # the last program of the row
                tl.atomic_xchg(arrivals_ptr + row, 0)
                nothing = masked & ((before >> 16) + any_allowed == 0)
                if masked:
                    tl.store(nothing_allowed_ptr + row, nothing)
                if HANDOFF:
                    # Every part's partials in one load each; M's first index is the first part's holding M.
                    parts = tl.arange(0, PARTS_PAD)
                    mine = parts < split
                    slots = row * split + parts
                    part_best = tl.load(part_f_ptr + slots * 2, mask=mine, other=float("-inf"), cache_modifier=".cg")
                    best = tl.max(part_best, axis=0)
                    first_part = tl.argmax(part_best, 0, tie_break_left=True)
                    best_id = tl.load(part_i_ptr + (row * split + first_part) * 3, cache_modifier=".cg")
                    raw_max = tl.max(tl.load(part_f_ptr + slots * 2 + 1, mask=mine, other=float("-inf"),
                                             cache_modifier=".cg"), axis=0)
                    not_finite = tl.max(tl.load(part_i_ptr + slots * 3 + 1, mask=mine, other=0,
                                                cache_modifier=".cg"), axis=0).to(tl.int32)
                    raw_mass = tl.sum(tl.load(part_i_ptr + slots * 3 + 2, mask=mine, other=0, cache_modifier=".cg"),
                                      axis=0)
                    if RAW_TOP:
                        raw_top = top_of_lists(tl.load(part_top_ptr + slots[:, None] * TOP_PAD + lane[None, :],
                                                       mask=mine[:, None], other=ABSENT, cache_modifier=".cg"),
                                               TOP_PAD)
                if nothing:  # the row fails; its scores stay as the controls left them (no bitmask)
                    _, again, again_id, _, _, _, _ = _control_range(
                        logits_row, out_row, 0, vocab, ~masked, bitmask_row, stops, slot, restricted, pen_on, rp, fp,
                        pp, drafts, counts_ptr, prompt_words_ptr, allowed_words_ptr, bias_ids, bias_values, vocab,
                        words, num_bias, BLOCK, BIAS_BLOCK, MAX_DRAFTS, DRAFT_P2, NUM_STOPS, STOP_P2, HANDOFF, False,
                        TOP_PAD, ID_BITS, ID_MASK, raw_max_row, False, MASS_SCALE, ACCURATE)
                    if HANDOFF:
                        best = again
                        best_id = again_id
                if HANDOFF:
                    _store_pass_one(pass_f_ptr, pass_i_ptr, pass_top_ptr, row, best, raw_max, best_id, not_finite,
                                    raw_mass, raw_top, lane, RAW_TOP, TOP_PAD)
                if RAW_MASS:
                    tl.store(raw_max_ptr + row, 0)  # the next step's LM head maxes into 0 (every part has read it)
    if part == 0:
        tl.store(row_controlled_ptr + row, active)
        if not masked:
            tl.store(nothing_allowed_ptr + row, False)
        if RAW_MASS:
            if not active:
                tl.store(raw_max_ptr + row, 0)
