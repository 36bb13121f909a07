"""The kept list: a row's kept set gathered as token ids while the sampling kernel makes a
cut's last radix pass, so that top-p, the draw and the processed logprobs are settled from
the list, not from more passes over the row (`engine.sampling.kernels.sample_kernel`).

- `kept_set.gather_chunk`: in the pass of a cut's last digit (top-k's, else top-p's), each token
  that the cut may still keep (valid, min-p's survivor, top-k's where that cut is known,
  order key at or below the digit window's top) is appended to the row's list, one atomic
  per chunk. The count goes on past LIST_CAP: the merge sees an overflow.
- `settle`: the last arrival, once the cut is known, from a list that fits: top-p's cut
  (the smallest key whose running mass in key order reaches top-p's level), the draw (the
  first token whose running kept mass in id order exceeds u * total), the kept total, the
  processed top-N (past the kept tokens, the smallest other ids at -inf, as vLLM lists
  them) and the token's processed rank, or its raw rank where the scores are the logits (the
  first cut pass summed the raw masses). A row it settles skips the later cut passes, the
  draw's pass and the logprob pass; one whose list overflowed makes them as before.

Exact: every kept token is on the list (each cut keeps a prefix of the key order, and the
window's top is at or above the cut), the masses are integers and every comparison is the
one the passes make, so the cut, the total, the token and the ranks are the passes'. The
values come from `kept_set.chunk_values` at the listed ids: the same function of the same
scores.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.kernels.kept_set import chunk_survivors, chunk_values
from engine.sampling.kernels.top_n import ABSENT, merge_top, rank_keys

_NO_PAIR: tl.constexpr = tl.constexpr(1 << 62)  # above every (key, id) pair packed below 2**(31 + ID_BITS)


@triton.jit
def _stops_above(stop_row, active, score_row, token_raw, V: tl.constexpr, NUM_STOP: tl.constexpr):
    """How many of the row's suppressed stop ids (each id once) have a logit above `token_raw`:
    the tokens above it that the kept list cannot hold."""
    above = tl.zeros((), dtype=tl.int64)
    for j in tl.static_range(NUM_STOP):
        stop = tl.load(stop_row + j)
        first = (stop >= 0) & (stop < V) & active
        for i in tl.static_range(j):
            first = first & (tl.load(stop_row + i) != stop)
        if first:
            above += (tl.load(score_row + stop) > token_raw).to(tl.int64)
    return above


@triton.jit
def settle(list_row, count, score_row, stop_row, active, shift, temperature, min_p, cut, top_p, do_p,
           token_known, known_token, uniform, rank_raw, state_i, row_top, kept_row,
           CUT: tl.constexpr, KEPT_TOTAL: tl.constexpr, DRAWN: tl.constexpr, ABOVE: tl.constexpr,
           LOGPROBS: tl.constexpr, NUM_TOP: tl.constexpr, TOP_PAD: tl.constexpr, V: tl.constexpr,
           NUM_BLOCKS: tl.constexpr, BLOCK_TOKENS: tl.constexpr, NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr,
           ACCURATE: tl.constexpr, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr, WRITE_KEPT: tl.constexpr,
           LIST: tl.constexpr):
    """Settles the row from its list of `count` ids (module doc) where it can, storing the
    state columns CUT, KEPT_TOTAL, DRAWN and ABOVE (the token's processed rank count; with
    `rank_raw`, a drawn row whose scores are its logits, its raw rank count), the
    processed top-N (`row_top`) and, with WRITE_KEPT, the kept weights at the listed ids (the
    pass zeroed the row). `cut`: the cut so far (int32); `do_p`: top-p is still to cut.
    Returns whether it settled the row. LIST: LIST_CAP."""
    slot = tl.arange(0, LIST)
    settled = count <= LIST
    if settled:
        ids = tl.sort(tl.load(list_row + slot, mask=slot < count, other=V).to(tl.int64))  # id order, padding last
        valid = ids < V
        masked, z, weight, key, mass = chunk_values(score_row, ids, valid, stop_row, active, shift, temperature,
                                                    NUM_STOP, MASS_SCALE, ACCURATE)
        if do_p:
            # Top-p over what min-p and top-k leave, in key order (ties by id): the first place
            # whose running mass reaches the level holds the cut, as the radix select finds it.
            survives = chunk_survivors(masked, weight, key, min_p, cut) & valid
            order = tl.sort(tl.where(survives, (key.to(tl.int64) << ID_BITS) | ids, _NO_PAIR))
            listed = order < _NO_PAIR
            key_sorted = (order >> ID_BITS).to(tl.int32)
            by_key = order & ID_MASK
            _, _, _, _, mass_sorted = chunk_values(score_row, by_key, listed, stop_row, active, shift, temperature,
                                                   NUM_STOP, MASS_SCALE, ACCURATE)
            mass_sorted = tl.where(listed, mass_sorted, 0)
            level = top_p * tl.sum(mass_sorted, 0).to(tl.float64)
            first = tl.sum((tl.cumsum(mass_sorted, 0).to(tl.float64) < level).to(tl.int32), 0)
            cut = tl.minimum(cut, tl.sum(tl.where(slot == first, key_sorted, 0), 0))
        kept = chunk_survivors(masked, weight, key, min_p, cut) & valid
        kept_mass = tl.where(kept, mass, 0)
        total = tl.sum(kept_mass, 0)
        drawn = known_token
        if ~token_known:
            # The first token (id order) whose running kept mass exceeds u * total; none (u * total
            # rounded up to the total): the last positive token of the last block, as the blocks draw.
            target = uniform * total.to(tl.float64)
            hit = tl.min(tl.where((kept_mass > 0) & (tl.cumsum(kept_mass, 0).to(tl.float64) > target), ids, V), 0)
            last_block = (NUM_BLOCKS - 1) * BLOCK_TOKENS
            tail = tl.max(tl.where((kept_mass > 0) & (ids >= last_block), ids, last_block), 0)
            drawn = tl.minimum(tl.where(hit < V, hit, tail), V - 1)
        tl.store(state_i + CUT, cut.to(tl.int64))
        tl.store(state_i + KEPT_TOTAL, total)
        tl.store(state_i + DRAWN, drawn)
        if LOGPROBS == 1:
            if rank_raw:
                # Every token of a larger logit than the drawn one is kept (each cut keeps a prefix
                # of the order), so on the list, but for a suppressed stop id.
                token_raw = tl.load(score_row + drawn)
                above = tl.sum((valid & (masked > token_raw)).to(tl.int64), 0)
                above += _stops_above(stop_row, active, score_row, token_raw, V, NUM_STOP)
                tl.store(state_i + ABOVE, above)
        if LOGPROBS == 2:
            kept_z = tl.where(kept, z, -float("inf"))
            token_z = tl.max(tl.where(kept & (ids == drawn), z, -float("inf")), 0)
            tl.store(state_i + ABOVE, tl.sum((kept_z > token_z).to(tl.int64), 0))
            if NUM_TOP > 0:
                # The top-N of every token at its kept z, -inf past the kept set: after the kept
                # tokens come the smallest ids that are not kept (fewer than 2 x TOP_PAD to look at).
                near = tl.arange(0, 2 * TOP_PAD)
                early = kept & (ids < 2 * TOP_PAD)
                # Kept ids per early id; the others counted into bin 0, then taken out of it.
                hits = tl.histogram(tl.where(early, ids, 0).to(tl.int32), 2 * TOP_PAD)
                hits -= tl.where(near == 0, tl.sum((~early).to(tl.int32), 0), 0)
                pad = rank_keys(tl.full((2 * TOP_PAD,), -float("inf"), tl.float32), near, (hits == 0) & (near < V),
                                ID_BITS, ID_MASK)
                lane = tl.arange(0, TOP_PAD)
                kept_top = merge_top(tl.full((TOP_PAD,), ABSENT, dtype=tl.int64),
                                     rank_keys(kept_z, ids, kept, ID_BITS, ID_MASK), TOP_PAD)
                tl.store(row_top + lane, merge_top(kept_top, pad, TOP_PAD))
        if WRITE_KEPT:
            tl.store(kept_row + ids, weight, mask=kept)
    return settled
