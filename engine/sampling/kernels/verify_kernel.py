"""Draft verification as Triton kernels, the CUDA twin of `engine/step/lm_head.py`'s
`verify_drafts`, the draft-pool writes of `verify_and_store_drafts` and
`SamplingControls.count` (docs/contract.md §1.3, §2.1).

Three custom ops; a step launches one, or two of them:
- `engine::verify_step` (always, the last): grid (requests,). Program i loads the
  step's per-row vectors ([ROWS_P2] lanes, the row layout is flat and small) and
  keeps its own rows (`row_to_req == i`, padding rows included, as the torch path's
  scatter-min does). It decides each row's acceptance, `num_accepted[i]` (the local
  step of its first non-accepted row), the emitted token of every row (rejection
  mode: the accepted draft, the residual draw, or the row's own token as the bonus),
  writes the draft head's proposals into the request's write slot of the pool (never
  slot 0: such a request writes nothing) and adds the emitted tokens to its control
  slot's counts (`counted_index` keeps what it added, for the host's rollback).
  Strict mode: a draft is accepted when it equals the row's draw. Rejection mode:
  when u * q(d) < p(d), u from stream ACCEPT; the first rejected row draws from the
  residual, with one inverse-CDF search over the chunk sums of
  `engine::verify_residual_chunks` and one pass over the chunk that holds the token.
- `engine::verify_residual_chunks` (rejection mode, before): grid (requests, split).
  Program (i, c) finds request i's first rejected row the same way and sums the
  residual's masses and the target's masses over its chunk of tokens into
  `residual_sums[i, c]` (int64, exact in any order). One pass over one row per
  request, spread over `split` programs.
- `engine::verify_rank_chunks` (strict top-k-space mode, before): grid (rows,
  split). Program (r, c) counts the tokens of its chunk that rank above the row's
  draft (a larger score, or NaN as `torch.topk` sorts it); only rows whose draw
  equals their draft need it, the others store 0.

The target distribution p is read from the sampler's kept weights w [rows, V] f32
(exp(z) on the kept set, 0 elsewhere) and the kept mass total T [rows] f64:
p(t) = floor(w(t) * 2**S) / T (S = `thresholds.mass_bits(V)`, the sampler's masses;
T = 1 where it is 0), or one-hot at `one_hot_tokens` for greedy and forced rows. No
[rows, V] f64 p exists: at B = 64 x 4 rows x V = 129280 it would be 265 MB, and w is
a quarter of that. The residual max(p - q, 0) enters the draw as integer masses
floor(r * 2**60) (`engine.sampling.verify.probability_masses`), so its sums are
exact in any order and the kernel's parallel sums give the torch path's token. The
uniforms are `engine.sampling.draw`'s hash (`hash_rng.uniform_at`), to the same bits.

Scratch: `residual_sums` [requests, split, 2] int64 and `rank_counts` [rows, split]
int32, fully rewritten by every launch. No host syncs, fixed shapes: capture-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from engine.sampling.kernels import FP_FUSION
from engine.sampling.draw import ACCEPT, RESIDUAL
from engine.sampling.kernels.hash_rng import uniform_at

BLOCK = 1024  # tokens per iteration (8 warps: 4 per thread)
NUM_WARPS = 8
PROGRAMS_PER_LAUNCH = 264  # about two programs per SM of an H200 (132 SMs)
MODES = ("none", "strict", "rejection")  # verify_step: no drafts (counts and pool only), or how drafts are verified
_NONE: tl.constexpr = tl.constexpr(2**62)  # "no row": above every row index and local step
_MASS_SCALE: tl.constexpr = tl.constexpr(2.0**60)  # a probability's integer mass, as `probability_masses`
_ACCEPT: tl.constexpr = tl.constexpr(ACCEPT)
_RESIDUAL: tl.constexpr = tl.constexpr(RESIDUAL)


@triton.jit
def _target_p(weights, tokens, one_hot, total, MASS_BITS: tl.constexpr):
    """p(t) [N] f64 from the kept weights [N] f32 of `tokens`: the mass over the kept total,
    or one-hot at `one_hot` (>= 0) for greedy and forced rows."""
    mass = tl.floor(weights * (2.0**MASS_BITS)).to(tl.float64)  # exact in f32: a power-of-two scale
    return tl.where(one_hot >= 0, tl.where(tokens == one_hot, 1.0, 0.0).to(tl.float64), mass / total)


@triton.jit
def _masses(probs):
    """floor(p * 2**60) as int64 for p in [0, 1]; NaN: 0 (`verify.probability_masses`)."""
    return tl.where(probs == probs, tl.floor(probs * _MASS_SCALE), 0.0).to(tl.int64)


@triton.jit
def _row_residual(weights_ptr, q_ptr, row, tokens, inside, draft, one_hot, total, has_q, vocab,
                  MASS_BITS: tl.constexpr):
    """(residual masses, target masses) [N] int64 of `tokens` on `row`: max(p - q, 0) with q the
    staged draft distribution, or one-hot at the draft without one."""
    w = tl.load(weights_ptr + row * vocab + tokens, mask=inside, other=0.0)
    p = _target_p(w, tokens, one_hot, total, MASS_BITS)
    q = tl.load(q_ptr + row * vocab + tokens, mask=tl.where(has_q, inside, False), other=0.0).to(tl.float64)
    q = tl.where(has_q, q, tl.where(tokens == draft, 1.0, 0.0).to(tl.float64))
    residual = tl.maximum(p - q, 0.0)  # NaN stays NaN (as clamp(min=0)); its mass is 0
    return tl.where(inside, _masses(residual), 0), tl.where(inside, _masses(p), 0)


@triton.jit
def _request_rows(req, rows, row_to_req_ptr, local_step_ptr, drafts_ptr, ROWS_P2: tl.constexpr):
    """The step's rows as lanes: (lane ids, which are request `req`'s, their local steps, their drafts)."""
    lane = tl.arange(0, ROWS_P2)
    owner = tl.load(row_to_req_ptr + lane, mask=lane < rows, other=-1)
    mine = owner == req
    step = tl.load(local_step_ptr + lane, mask=mine, other=_NONE)
    draft = tl.load(drafts_ptr + lane, mask=mine, other=-1)
    return lane, mine, step, draft


@triton.jit
def _rejection_accepts(req, lane, mine, step, draft, weights_ptr, total_ptr, one_hot_ptr, q_ptr, has_q_ptr,
                       seeds_ptr, positions_ptr, vocab, MASS_BITS: tl.constexpr):
    """Rejection mode per row lane: (accepted, has a draft, staged q, one-hot token, kept total)."""
    has_draft = mine & (draft >= 0)
    d = tl.maximum(draft, 0)
    one_hot = tl.load(one_hot_ptr + lane, mask=mine, other=-1)
    total = tl.load(total_ptr + lane, mask=mine, other=1.0)
    total = tl.where(total > 0, total, 1.0)
    has_q = tl.load(has_q_ptr + lane, mask=mine, other=0) != 0
    w = tl.load(weights_ptr + lane.to(tl.int64) * vocab + d, mask=has_draft, other=0.0)
    p = _target_p(w, d, one_hot, total, MASS_BITS)
    q = tl.load(q_ptr + lane.to(tl.int64) * vocab + d, mask=has_draft & has_q, other=0.0).to(tl.float64)
    q = tl.where(has_q, q, 1.0)
    position = tl.load(positions_ptr + req) + step
    u = uniform_at(tl.load(seeds_ptr + req) + tl.zeros_like(step), position, _ACCEPT)
    return has_draft & (u * q < p), has_draft, has_q, one_hot, total


@triton.jit
def _first_rejection(lane, mine, step, accepted, has_draft):
    """(num_accepted, the lane of the rejected draft row or _NONE): the local step of the first
    non-accepted row (0 for a request without rows), and that row if it holds a draft."""
    first = tl.min(tl.where(mine & ~accepted, step, _NONE), axis=0)
    rejected_lane = tl.min(tl.where(mine & (step == first) & has_draft & ~accepted, lane.to(tl.int64), _NONE), axis=0)
    return tl.where(first == _NONE, 0, first), rejected_lane


@triton.jit
def _residual_chunks_kernel(
    drafts_ptr, row_to_req_ptr, local_step_ptr, weights_ptr, total_ptr, one_hot_ptr, q_ptr, has_q_ptr,
    seeds_ptr, positions_ptr, sums_ptr, rows, vocab, chunk,
    BLOCK: tl.constexpr, ROWS_P2: tl.constexpr, MASS_BITS: tl.constexpr,
):
    req = tl.program_id(0)
    part = tl.program_id(1)
    split = tl.num_programs(1)
    lane, mine, step, draft = _request_rows(req, rows, row_to_req_ptr, local_step_ptr, drafts_ptr, ROWS_P2)
    accepted, has_draft, has_q, one_hot, total = _rejection_accepts(
        req, lane, mine, step, draft, weights_ptr, total_ptr, one_hot_ptr, q_ptr, has_q_ptr, seeds_ptr,
        positions_ptr, vocab, MASS_BITS)
    _, rejected = _first_rejection(lane, mine, step, accepted, has_draft)
    residual_sum = tl.zeros([], dtype=tl.int64)
    target_sum = tl.zeros([], dtype=tl.int64)
    if rejected != _NONE:
        at = lane == rejected
        row = rejected.to(tl.int64)
        r_draft = tl.sum(tl.where(at, draft, 0), axis=0)
        r_one_hot = tl.sum(tl.where(at, one_hot, 0), axis=0)
        r_total = tl.sum(tl.where(at, total, 0.0), axis=0)
        r_has_q = tl.max(tl.where(at, has_q, False).to(tl.int32), axis=0) != 0
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for start in range(lo, hi, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            residual, target = _row_residual(weights_ptr, q_ptr, row, tokens, tokens < hi, r_draft, r_one_hot,
                                             r_total, r_has_q, vocab, MASS_BITS)
            residual_sum += tl.sum(residual, axis=0)
            target_sum += tl.sum(target, axis=0)
    tl.store(sums_ptr + (req * split + part) * 2, residual_sum)
    tl.store(sums_ptr + (req * split + part) * 2 + 1, target_sum)


@triton.jit
def _rank_chunks_kernel(scores_ptr, tokens_ptr, drafts_ptr, row_to_req_ptr, top_ks_ptr, counts_ptr, vocab, chunk,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    split = tl.num_programs(1)
    draft = tl.load(drafts_ptr + row)
    k = tl.load(top_ks_ptr + tl.load(row_to_req_ptr + row))
    above = tl.zeros([], dtype=tl.int32)
    # Only a row whose draw equals its draft asks whether the draft is in the top-k.
    if (draft >= 0) & (tl.load(tokens_ptr + row) == draft) & (k > 0):
        scores_row = scores_ptr + row.to(tl.int64) * vocab
        score = tl.load(scores_row + draft)
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for start in range(lo, hi, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            s = tl.load(scores_row + tokens, mask=tokens < hi, other=float("-inf"))
            # torch.topk ranks NaN above every number; a NaN draft score is in no top-k.
            above += tl.sum(((s > score) | (s != s)).to(tl.int32), axis=0)
        above = tl.where(score == score, above, vocab + 1)
    tl.store(counts_ptr + row * split + part, above)


@triton.jit
def _residual_token(req, row, draft, one_hot, total, has_q, weights_ptr, q_ptr, sums_ptr, seeds_ptr, positions_ptr,
                    position, vocab, chunk, split, BLOCK: tl.constexpr, SPLIT_P2: tl.constexpr,
                    MASS_BITS: tl.constexpr):
    """The inverse-CDF draw from the residual's masses (the target's where they are all 0):
    the first token whose running mass exceeds floor(u * total), u from stream RESIDUAL."""
    part = tl.arange(0, SPLIT_P2)
    in_split = part < split
    residual = tl.load(sums_ptr + (req * split + part) * 2, mask=in_split, other=0)
    target = tl.load(sums_ptr + (req * split + part) * 2 + 1, mask=in_split, other=0)
    degenerate = tl.sum(residual, axis=0) == 0
    sums = tl.where(degenerate, target, residual)
    total_mass = tl.sum(sums, axis=0)
    u = uniform_at(tl.load(seeds_ptr + req), position, _RESIDUAL)
    level = tl.floor(u * total_mass.to(tl.float64)).to(tl.int64)  # < total_mass: a token is found
    running = tl.cumsum(sums, axis=0)
    hit = tl.min(tl.where(running > level, part, SPLIT_P2), axis=0)
    before = tl.sum(tl.where(part < hit, sums, 0), axis=0)
    token = tl.zeros([], dtype=tl.int64) + _NONE
    lo = hit * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        # Masked loads once the token is found: the remaining blocks move no memory.
        inside = tl.where(token == _NONE, tokens < hi, False)
        masses, target_masses = _row_residual(weights_ptr, q_ptr, row, tokens, inside, draft, one_hot, total, has_q,
                                              vocab, MASS_BITS)
        masses = tl.where(degenerate, target_masses, masses)
        cum = before + tl.cumsum(masses, axis=0)
        token = tl.minimum(token, tl.min(tl.where(inside & (cum > level), tokens.to(tl.int64), _NONE), axis=0))
        before += tl.sum(masses, axis=0)
    return tl.where(total_mass > 0, token, 0)  # nothing to draw from (a failed row): token 0


@triton.jit
def _verify_step_kernel(
    tokens_ptr, errors_ptr, drafts_ptr, row_to_req_ptr, local_step_ptr, num_accepted_ptr, emitted_ptr,
    weights_ptr, total_ptr, one_hot_ptr, q_ptr, has_q_ptr, seeds_ptr, positions_ptr, sums_ptr,
    rank_counts_ptr, top_ks_ptr,
    write_slots_ptr, next_tokens_ptr, next_logprobs_ptr, pool_tokens_ptr, pool_logprobs_ptr,
    control_slots_ptr, counts_ptr, counted_index_ptr,
    rows, rows_per_req, vocab, chunk, split, top_k_width, next_stride,
    MODE: tl.constexpr, TOP_K_SPACE: tl.constexpr, MAX_DRAFTS: tl.constexpr, HAS_POOL: tl.constexpr,
    HAS_COUNTS: tl.constexpr, ROWS_P2: tl.constexpr, DRAFT_P2: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr,
    MASS_BITS: tl.constexpr,
):
    req = tl.program_id(0)
    lane, mine, step, draft = _request_rows(req, rows, row_to_req_ptr, local_step_ptr, drafts_ptr, ROWS_P2)
    token = tl.load(tokens_ptr + lane, mask=mine, other=0)
    emitted_token = token
    if MODE == "strict":
        accepted = mine & (draft >= 0) & (token == draft)
        if TOP_K_SPACE:
            k = tl.load(top_ks_ptr + req).to(tl.int64)
            above = tl.zeros_like(step)
            for part in range(0, split):
                above += tl.load(rank_counts_ptr + lane * split + part, mask=mine, other=0).to(tl.int64)
            in_top_k = tl.where(k <= 0, True, above < tl.minimum(tl.maximum(k, 1), top_k_width))
            accepted = accepted & in_top_k
        num_accepted, _ = _first_rejection(lane, mine, step, accepted, accepted)
    elif MODE == "rejection":
        accepted, has_draft, has_q, one_hot, total = _rejection_accepts(
            req, lane, mine, step, draft, weights_ptr, total_ptr, one_hot_ptr, q_ptr, has_q_ptr, seeds_ptr,
            positions_ptr, vocab, MASS_BITS)
        num_accepted, rejected = _first_rejection(lane, mine, step, accepted, has_draft)
        emitted_token = tl.where(accepted, draft, token)  # the bonus: the row's own draw
        if rejected != _NONE:
            at = lane == rejected
            residual = _residual_token(
                req, rejected.to(tl.int64), tl.sum(tl.where(at, draft, 0), axis=0),
                tl.sum(tl.where(at, one_hot, 0), axis=0), tl.sum(tl.where(at, total, 0.0), axis=0),
                tl.max(tl.where(at, has_q, False).to(tl.int32), axis=0) != 0, weights_ptr, q_ptr, sums_ptr,
                seeds_ptr, positions_ptr, tl.load(positions_ptr + req) + num_accepted, vocab, chunk, split,
                BLOCK, SPLIT_P2, MASS_BITS)
            emitted_token = tl.where(at, residual, emitted_token)
    else:
        num_accepted = tl.zeros([], dtype=tl.int64)
    emits = mine & (step <= num_accepted)
    if MODE != "none":
        tl.store(num_accepted_ptr + req, num_accepted)
    if MODE == "rejection":
        tl.store(emitted_ptr + lane, tl.where(emits, emitted_token, -1), mask=mine)
    if HAS_POOL:
        # Slot 0 is padding and never written: a request without a write slot writes nothing.
        slot = tl.load(write_slots_ptr + req)
        j = tl.arange(0, DRAFT_P2)
        proposal = tl.where(slot > 0, j < MAX_DRAFTS, False)
        tl.store(pool_tokens_ptr + slot * MAX_DRAFTS + j,
                 tl.load(next_tokens_ptr + req * next_stride + j, mask=proposal), mask=proposal)
        tl.store(pool_logprobs_ptr + slot * MAX_DRAFTS + j,
                 tl.load(next_logprobs_ptr + req * next_stride + j, mask=proposal), mask=proposal)
    if HAS_COUNTS:
        # A request emits the tokens of its rows up to its accepted drafts plus one, none when a row failed.
        real = mine & (step < rows_per_req)
        failed = tl.max((real & (tl.load(errors_ptr + lane, mask=mine, other=0) != 0)).to(tl.int32), axis=0) > 0
        slot = tl.load(control_slots_ptr + req)
        counted = tl.where(failed | (slot <= 0), False, emits & real)
        index = slot * vocab + emitted_token
        tl.atomic_add(counts_ptr + index, 1, mask=counted)
        tl.store(counted_index_ptr + lane, tl.where(counted, index, -1), mask=mine)


def chunk_for(vocab: int, split: int, block: int) -> int:
    """Tokens per program when a row is split `split` ways: whole blocks."""
    return -(-(-(-vocab // split)) // block) * block


def split_for(lanes: int, vocab: int, block: int = BLOCK, programs: int = PROGRAMS_PER_LAUNCH) -> int:
    """How many ways to split a row over `lanes` rows (or requests): about `programs` programs in all.
    The scratch buffers are allocated with it ([lanes, split]); the kernels read it from their shape."""
    return max(1, min(-(-programs // max(lanes, 1)), -(-vocab // block)))


@triton_op("engine::verify_residual_chunks", mutates_args={"residual_sums"})
def verify_residual_chunks(
    drafts: torch.Tensor,
    row_to_req: torch.Tensor,
    local_step: torch.Tensor,
    weights: torch.Tensor,
    mass_total: torch.Tensor,
    one_hot_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    has_draft_probs: torch.Tensor,
    seeds: torch.Tensor,
    sample_positions: torch.Tensor,
    residual_sums: torch.Tensor,
    block: int = BLOCK,
) -> None:
    """Per request and chunk of tokens, the residual's and the target's masses at the request's
    first rejected draft row (rejection mode, before `verify_step`).

    Parameters, on one device: `drafts` [rows] int64 (the resolved drafts, -1 none);
    `row_to_req`, `local_step` [rows] int64; `weights` [rows, V] f32, the sampler's kept
    weights exp(z) (0 outside the kept set); `mass_total` [rows] f64, their masses' total;
    `one_hot_tokens` [rows] int64, the token of a greedy or forced row (-1: p from the
    weights); `draft_probs` [rows, V] f32, q of each row's draft where `has_draft_probs`
    [rows] bool, else one-hot at the draft; `seeds` [reqs] int64 (uint64 bits);
    `sample_positions` [reqs] int64; `residual_sums` [reqs, split, 2] int64, written (every
    entry; zeros for a request with no rejection). Returns: None. Capture-safe.
    """
    reqs, split, _ = residual_sums.shape
    rows, vocab = weights.shape
    if reqs == 0 or rows == 0:
        return
    wrap_triton(_residual_chunks_kernel)[(reqs, split)](
        drafts, row_to_req, local_step, weights, mass_total, one_hot_tokens, draft_probs, has_draft_probs,
        seeds, sample_positions, residual_sums, rows, vocab, chunk_for(vocab, split, block),
        BLOCK=block, ROWS_P2=triton.next_power_of_2(rows), MASS_BITS=52 - max(1, (vocab - 1).bit_length()),
        num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION)


@triton_op("engine::verify_rank_chunks", mutates_args={"rank_counts"})
def verify_rank_chunks(scores: torch.Tensor, row_tokens: torch.Tensor, drafts: torch.Tensor,
                       row_to_req: torch.Tensor, top_ks: torch.Tensor, rank_counts: torch.Tensor,
                       block: int = BLOCK) -> None:
    """Per row and chunk, how many tokens rank above the row's draft (strict top-k-space mode).

    Parameters: `scores` [rows, V] f32, contiguous, the scores the row's top-k is taken
    over; `row_tokens` [rows] int64, the rows' draws; `drafts` [rows] int64; `row_to_req`
    [rows] int64; `top_ks` [reqs] int32 (<= 0: any draft allowed); `rank_counts` [rows,
    split] int32, written: a count per chunk (V + 1 when the draft's score is NaN; 0 where
    the draw differs from the draft or there is none). Returns: None. Capture-safe.
    """
    rows, split = rank_counts.shape
    vocab = scores.shape[1]
    if rows == 0:
        return
    if not scores.is_contiguous():
        raise ValueError(f"verify_rank_chunks: scores with strides {scores.stride()}: expected contiguous")
    wrap_triton(_rank_chunks_kernel)[(rows, split)](
        scores, row_tokens, drafts, row_to_req, top_ks, rank_counts, vocab, chunk_for(vocab, split, block),
        BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION)


@triton_op("engine::verify_step",
           mutates_args={"num_accepted", "emitted", "pool_tokens", "pool_logprobs", "counts", "counted_index"})
def verify_step(
    row_tokens: torch.Tensor,
    row_errors: torch.Tensor,
    drafts: torch.Tensor,
    row_to_req: torch.Tensor,
    local_step: torch.Tensor,
    num_accepted: torch.Tensor,
    emitted: torch.Tensor,
    weights: torch.Tensor | None,
    mass_total: torch.Tensor | None,
    one_hot_tokens: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    has_draft_probs: torch.Tensor | None,
    seeds: torch.Tensor | None,
    sample_positions: torch.Tensor | None,
    residual_sums: torch.Tensor | None,
    rank_counts: torch.Tensor | None,
    top_ks: torch.Tensor | None,
    write_slots: torch.Tensor | None,
    next_tokens: torch.Tensor | None,
    next_logprobs: torch.Tensor | None,
    pool_tokens: torch.Tensor | None,
    pool_logprobs: torch.Tensor | None,
    control_slots: torch.Tensor | None,
    counts: torch.Tensor | None,
    counted_index: torch.Tensor | None,
    mode: str,
    max_drafts: int,
    rows_per_req: int,
    top_k_width: int = 0,
    block: int = BLOCK,
) -> None:
    """Verify the step's drafts, write the draft pool and count the emitted tokens: one program per request.

    Parameters, on one device ([rows] and [reqs] are the bucket's sample rows and requests):
    - `row_tokens` [rows] int64, the sampler's draws; `row_errors` [rows] int64 (`RowError`);
      `drafts` [rows] int64, the resolved drafts (-1 none); `row_to_req`, `local_step` [rows] int64;
    - `num_accepted` [reqs] int64, written unless `mode` is "none"; `emitted` [rows] int64,
      written in rejection mode: the emitted token per row, -1 where none;
    - rejection mode: `weights` .. `sample_positions` as `verify_residual_chunks` takes
      them, and `residual_sums` [reqs, split, 2] int64 that it wrote;
    - strict top-k-space mode (`rank_counts` given): `rank_counts` [rows, split] int32 from
      `verify_rank_chunks`, `top_ks` [reqs] int32, `top_k_width` the static bound on k
      (`SamplerConfig.candidate_cap`, at most V);
    - the draft pool (`write_slots` given): `write_slots` [reqs] int64, `next_tokens`
      [reqs, W] int64 and `next_logprobs` [reqs, W] f32 (W >= `max_drafts`), into
      `pool_tokens` / `pool_logprobs` [(slots + 1) * max_drafts], slot 0 never written;
    - the counts (`counts` given): `control_slots` [reqs] int64, `counts` [slots, V] int32
      (+1 per emitted token of a request with a slot and no failed row), `counted_index`
      [rows] int64, written: slot * V + token where a row added one, else -1;
    - `mode` one of `MODES`; `max_drafts` K; `rows_per_req` 1 + K (padding rows lie past it).
    Returns: None. Raises: ValueError for an unknown mode. Capture-safe.
    """
    if mode not in MODES:
        raise ValueError(f"verify_step: mode={mode!r}: must be one of {MODES}")
    reqs, rows = num_accepted.shape[0], row_tokens.shape[0]
    if reqs == 0 or rows == 0:
        return
    rejection = mode == "rejection"
    vocab = weights.shape[1] if rejection else counts.shape[1] if counts is not None else 1
    split = residual_sums.shape[1] if rejection else rank_counts.shape[1] if rank_counts is not None else 1
    dummy = row_tokens  # a pointer for every operand this mode never reads (its code is compiled out)

    def arg(tensor: torch.Tensor | None) -> torch.Tensor:
        return dummy if tensor is None else tensor

    wrap_triton(_verify_step_kernel)[(reqs,)](
        row_tokens, row_errors, drafts, row_to_req, local_step, num_accepted, arg(emitted),
        arg(weights), arg(mass_total), arg(one_hot_tokens), arg(draft_probs), arg(has_draft_probs), arg(seeds),
        arg(sample_positions), arg(residual_sums), arg(rank_counts), arg(top_ks),
        arg(write_slots), arg(next_tokens), arg(next_logprobs), arg(pool_tokens), arg(pool_logprobs),
        arg(control_slots), arg(counts), arg(counted_index),
        rows, rows_per_req, vocab, chunk_for(vocab, split, block), split, top_k_width,
        next_tokens.stride(0) if next_tokens is not None else 0,
        MODE=mode, TOP_K_SPACE=mode == "strict" and rank_counts is not None, MAX_DRAFTS=max_drafts,
        HAS_POOL=write_slots is not None, HAS_COUNTS=counts is not None, ROWS_P2=triton.next_power_of_2(rows),
        DRAFT_P2=triton.next_power_of_2(max(max_drafts, 1)), SPLIT_P2=triton.next_power_of_2(split), BLOCK=block,
        MASS_BITS=52 - max(1, (vocab - 1).bit_length()), num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION)


def _signature(fn: object, pointers: dict[str, str]) -> dict[str, str]:
    """Every argument's Triton type: named pointers, other pointers int64, CAPS constexpr, the rest i32."""
    return {name: "constexpr" if name.isupper() else pointers.get(name, "*i64" if name.endswith("_ptr") else "i32")
            for name in fn.arg_names}


def _aot_builds() -> list[dict[str, object]]:
    """What the CUDA step launches, for `profiling.kernel_build`: both real vocabularies, 64
    requests x 4 rows (256 row lanes) with each mode of `verify_step`, and 256 x 8 (2048 lanes)
    for the kernels that keep the most per-lane state."""
    probs = dict(weights_ptr="*fp32", total_ptr="*fp64", q_ptr="*fp32", has_q_ptr="*i1")
    step_pointers = dict(probs, rank_counts_ptr="*i32", top_ks_ptr="*i32", next_logprobs_ptr="*fp32",
                         pool_logprobs_ptr="*fp32", counts_ptr="*i32")
    builds = []
    for vocab in (129280, 49152):
        mass_bits = 52 - (vocab - 1).bit_length()
        builds.append(dict(name=f"verify_rank_chunks V={vocab}", fn=_rank_chunks_kernel,
                           signature=_signature(_rank_chunks_kernel, dict(scores_ptr="*fp32", top_ks_ptr="*i32",
                                                                          counts_ptr="*i32")),
                           constexprs=dict(BLOCK=BLOCK), num_warps=NUM_WARPS))
        for rows, drafts in ((256, 3), (2048, 7)):
            builds.append(dict(name=f"verify_residual_chunks V={vocab} rows={rows}", fn=_residual_chunks_kernel,
                               signature=_signature(_residual_chunks_kernel, probs),
                               constexprs=dict(BLOCK=BLOCK, ROWS_P2=rows, MASS_BITS=mass_bits), num_warps=NUM_WARPS))
            for mode in MODES if rows == 256 else ("rejection",):  # the other modes hold fewer lanes' state
                constexprs = dict(MODE=mode, TOP_K_SPACE=mode == "strict", MAX_DRAFTS=drafts if mode != "none" else 0,
                                  HAS_POOL=mode != "none", HAS_COUNTS=True, ROWS_P2=rows,
                                  DRAFT_P2=triton.next_power_of_2(drafts), SPLIT_P2=8, BLOCK=BLOCK, MASS_BITS=mass_bits)
                builds.append(dict(name=f"verify_step V={vocab} rows={rows} {mode}", fn=_verify_step_kernel,
                                   signature=_signature(_verify_step_kernel, step_pointers), constexprs=constexprs,
                                   num_warps=NUM_WARPS))
    return builds


AOT_BUILDS = _aot_builds()
