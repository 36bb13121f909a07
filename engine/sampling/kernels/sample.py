"""The sampler on CUDA: kept set, draw and logprobs of every row in one Triton kernel.

`sample_rows` (torch op `engine::sample_rows`) computes what `engine.sampling.sampler.sample`
computes, in vLLM's stage order (temperature, min-p, top-k, top-p), from the controlled
scores and the unprocessed logits, into a `SampleOutput`. Every row takes its own branch
inside the kernel, so one launch serves greedy, plain, filtered, logprob and processed-
logprob rows alike: no graph-set variants.

Design
- One program per sample row. The cuts are chains of row-wide reductions (each
  histogram pass needs the previous one's bin), which a split row could only share through
  a global barrier per pass; one program keeps the chain on one SM with no barrier. The
  row's repeated passes then hit L2 (a [64, 129280] f32 row block is 33 MB).
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
  Grid: (rows,), 8 warps, 2048 tokens per step of a pass (8 per thread: 128 registers, no
  spills, 512 B of shared memory for sm_90).
  Pass 1: the row maximum M of the masked scores and its first index (the greedy token), the
  finite check of the logits, their maximum and their top-N (raw logprobs). The cuts:
  `kept_set.radix_cut`. The draw's pass: each kept token's mass, summed per block of 1024
  into scratch, the kept total, and the processed top-N. Then the block where the running
  mass passes u * total, and the token inside it. The logprob pass: the raw normaliser and
  the rank.
- Scratch (`SampleScratch`, preallocated, fixed shapes): one int64 histogram of 2048 bins
  and one row of int64 block masses per row.
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
    HIST_BINS, KEY_MAX, chunk_survivors, chunk_values, exp_f32, log_f64, masked_scores, radix_cut,
)
from engine.sampling.kernels.top_n import ABSENT, key_ids, key_values, merge_top, rank_keys
from engine.sampling.normaliser import BLOCK, mass_bits
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput

LOGPROBS_MODES = {None: 0, "raw": 1, "processed": 2}
NUM_WARPS = 8
GPU_CHUNK = 2048  # tokens per step of a pass on a GPU: 8 per thread of 8 warps, no spills
NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.LOGITS_NOT_FINITE))
NO_TOKEN_ALLOWED: tl.constexpr = tl.constexpr(int(RowError.NO_TOKEN_ALLOWED))
NOTHING_LEFT: tl.constexpr = tl.constexpr(int(RowError.NOTHING_LEFT))
SCORES_NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.SCORES_NOT_FINITE))
PLACEHOLDER: tl.constexpr = tl.constexpr(PLACEHOLDER_TOKEN)


@triton.jit
def _sample_kernel(
    scores_ptr, logits_ptr, stride_scores, stride_logits,
    temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, row_to_req_ptr, stop_ids_ptr, stride_stop,
    eos_rows_ptr, forced_ptr, uniforms_ptr, nothing_allowed_ptr,
    hist_ptr, block_mass_ptr, stride_hist, stride_blocks,
    tokens_ptr, logprob_ptr, rank_ptr, top_ids_ptr, top_logprobs_ptr, needs_exact_ptr, error_ptr, stride_top,
    row_controlled_ptr, kept_weights_ptr, mass_total_ptr, one_hot_ptr, stride_weights,
    V: tl.constexpr, NUM_STOP: tl.constexpr, NUM_TOP: tl.constexpr, TOP_PAD: tl.constexpr,
    LOGPROBS: tl.constexpr, SEPARATE_LOGITS: tl.constexpr, HAS_NOTHING_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
    MASS_BITS: tl.constexpr, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    HAS_ROW_CONTROLLED: tl.constexpr, WRITE_KEPT: tl.constexpr,
):
    row = tl.program_id(0)
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
    lane = tl.arange(0, TOP_PAD)

    # Pass 1: M and the greedy token, the logits' finite check, maximum and top-N.
    best = tl.full((), -float("inf"), tl.float32)
    best_id = tl.zeros((), dtype=tl.int64)
    raw_max = tl.full((), -float("inf"), tl.float32)
    not_finite = tl.zeros((), dtype=tl.int1)
    scores_nan = tl.zeros((), dtype=tl.int1)  # a control made a NaN (its +inf shows in `best`)
    raw_top = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
    for start in range(0, V, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        in_row = offs < V
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

    if HAS_NOTHING_ALLOWED:
        nothing_allowed = tl.load(nothing_allowed_ptr + row)
    else:
        nothing_allowed = tl.zeros((), dtype=tl.int1)
    left = tl.where(nothing_allowed, NO_TOKEN_ALLOWED, tl.where(best == -float("inf"), NOTHING_LEFT, 0))
    error = tl.where(not_finite, NOT_FINITE, tl.where(scores_nan | (best == float("inf")), SCORES_NOT_FINITE, left))
    failed = error != 0
    shift = tl.where(best > -float("inf"), best, 0.0)
    token_known = greedy | (forced >= 0)
    known_token = tl.where(forced >= 0, forced, best_id)
    # A forced token skips the draw: its row needs the kept set only for processed logprobs.
    needs_distribution = (~token_known | (LOGPROBS == 2)) & ~failed

    # The cuts, vLLM's order: min-p (elementwise), top-k over every token, top-p over what both leave.
    cut = tl.full((), KEY_MAX, tl.int32)
    if needs_distribution & k_on:
        cut, _ = radix_cut(score_row, stop_row, active, shift, temperature, min_p_floor, cut,
                           top_k.to(tl.float64), 0.0, hist_ptr + row * stride_hist, True, V, CHUNK, NUM_STOP,
                           MASS_SCALE, ACCURATE)
    if needs_distribution & (top_p < 1.0) & ~greedy:
        p_cut, _ = radix_cut(score_row, stop_row, active, shift, temperature, min_p_floor, cut,
                             0.0, top_p.to(tl.float64), hist_ptr + row * stride_hist, False, V, CHUNK,
                             NUM_STOP, MASS_SCALE, ACCURATE)
        cut = tl.minimum(cut, p_cut)

    # The known token's processed logit, kept or not (-inf when not: it ranks after every kept token).
    if LOGPROBS == 2:
        known_offs = known_token + tl.zeros((1,), dtype=tl.int64)
        k_masked, k_z, k_weight, k_key, k_mass = chunk_values(score_row, known_offs, known_offs < V, stop_row, active,
                                                              shift, temperature, NUM_STOP, MASS_SCALE, ACCURATE)
        known_z = tl.sum(tl.where(chunk_survivors(k_masked, k_weight, k_key, min_p_floor, cut), k_z,
                                  -float("inf")), 0)

    # The draw's pass: kept masses per block, their total, the processed top-N and a known token's rank.
    total = tl.zeros((), dtype=tl.int64)
    above = tl.zeros((), dtype=tl.int64)  # kept tokens of larger z than the token (processed rank)
    kept_top = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
    blocks_row = block_mass_ptr + row * stride_blocks
    if needs_distribution:
        for start in range(0, V, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            in_row = offs < V
            masked, z, weight, key, mass = chunk_values(score_row, offs, in_row, stop_row, active, shift, temperature,
                                                        NUM_STOP, MASS_SCALE, ACCURATE)
            kept = chunk_survivors(masked, weight, key, min_p_floor, cut)
            kept_mass = tl.where(kept, mass, 0)
            per_block = tl.sum(tl.reshape(kept_mass, (CHUNK // BLOCK_TOKENS, BLOCK_TOKENS)), 1)
            block_at = start // BLOCK_TOKENS + tl.arange(0, CHUNK // BLOCK_TOKENS)
            tl.store(blocks_row + block_at, per_block, mask=block_at < NUM_BLOCKS)
            total += tl.sum(kept_mass, 0)
            if WRITE_KEPT:
                tl.store(kept_weights_ptr + row.to(tl.int64) * stride_weights + offs, tl.where(kept, weight, 0.0),
                         mask=in_row)
            if LOGPROBS == 2:
                kept_z = tl.where(kept, z, -float("inf"))
                if NUM_TOP > 0:
                    # Every token takes part: past the kept ones, the smallest ids at -inf (as vLLM lists them).
                    kept_top = merge_top(kept_top, rank_keys(kept_z, offs, in_row, ID_BITS, ID_MASK), TOP_PAD)
                above += tl.sum((kept_z > known_z).to(tl.int64), 0)

    # The draw: the first token whose running kept mass exceeds u * total (engine.sampling.draw).
    drawn = best_id
    if needs_distribution & ~token_known:
        tl.debug_barrier()
        block_idx = tl.arange(0, BLOCKS_PAD)
        block_cum = tl.cumsum(tl.load(blocks_row + block_idx, mask=block_idx < NUM_BLOCKS, other=0,
                                      cache_modifier=".cg"), 0)
        target = tl.load(uniforms_ptr + row) * total.to(tl.float64)
        block = tl.minimum(tl.sum(((block_cum.to(tl.float64) <= target) & (block_idx < NUM_BLOCKS)).to(tl.int64), 0),
                           NUM_BLOCKS - 1)
        before = tl.sum(tl.where(block_idx == block - 1, block_cum, 0), 0)
        column = tl.arange(0, BLOCK_TOKENS)
        offs = block * BLOCK_TOKENS + column
        in_row = offs < V
        masked, z, weight, key, mass = chunk_values(score_row, offs, in_row, stop_row, active, shift, temperature,
                                                    NUM_STOP, MASS_SCALE, ACCURATE)
        inner = tl.where(chunk_survivors(masked, weight, key, min_p_floor, cut), mass, 0)
        running = before + tl.cumsum(inner, 0)
        pick = tl.sum((running.to(tl.float64) <= target).to(tl.int64), 0)
        last_positive = tl.maximum(tl.max(tl.where(inner > 0, column, -1), 0), 0).to(tl.int64)
        drawn = tl.minimum(block * BLOCK_TOKENS + tl.minimum(pick, last_positive), V - 1)
    token = tl.where(forced >= 0, forced, tl.where(greedy, best_id, drawn))
    token = tl.where(failed, PLACEHOLDER, token)

    # Logprobs: the last pass where the token was not known before the draw's.
    logprob = tl.zeros((), dtype=tl.float64)
    rank = tl.zeros((), dtype=tl.int64)
    top_ids = tl.full((TOP_PAD,), -1, dtype=tl.int64)
    top_logprobs = tl.zeros((TOP_PAD,), dtype=tl.float64)
    if LOGPROBS == 1:
        raw_mass = tl.zeros((), dtype=tl.int64)
        if SEPARATE_LOGITS:
            token_raw = tl.load(logit_row + token)
        else:
            token_raw = tl.load(score_row + token)
        if ~failed:
            for start in range(0, V, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                in_row = offs < V
                if SEPARATE_LOGITS:
                    plain = tl.load(logit_row + offs, mask=in_row, other=-float("inf"))
                else:
                    plain = tl.load(score_row + offs, mask=in_row, other=-float("inf"))
                raw_weight = exp_f32(plain - raw_max, ACCURATE)
                raw_mass += tl.sum((raw_weight * MASS_SCALE).to(tl.int64), 0)
                above += tl.sum((plain > token_raw).to(tl.int64), 0)
        lse = raw_max.to(tl.float64) + log_f64(raw_mass.to(tl.float64) * (1.0 / MASS_SCALE), ACCURATE)
        logprob = token_raw.to(tl.float64) - lse
        rank = above + 1
        top_ids = key_ids(raw_top, ID_MASK)
        top_logprobs = key_values(raw_top, ID_BITS).to(tl.float64) - lse
    if LOGPROBS == 2:
        if needs_distribution & ~token_known:
            token_offs = token + tl.zeros((1,), dtype=tl.int64)
            t_masked, t_z, t_weight, t_key, t_mass = chunk_values(score_row, token_offs, token_offs < V, stop_row,
                                                                  active, shift, temperature, NUM_STOP, MASS_SCALE,
                                                                  ACCURATE)
            token_z = tl.sum(tl.where(chunk_survivors(t_masked, t_weight, t_key, min_p_floor, cut), t_z,
                                      -float("inf")), 0)
            above = tl.zeros((), dtype=tl.int64)
            for start in range(0, V, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                masked, z, weight, key, mass = chunk_values(score_row, offs, offs < V, stop_row, active, shift,
                                                            temperature, NUM_STOP, MASS_SCALE, ACCURATE)
                kept_z = tl.where(chunk_survivors(masked, weight, key, min_p_floor, cut), z, -float("inf"))
                above += tl.sum((kept_z > token_z).to(tl.int64), 0)
        token_offs = token + tl.zeros((1,), dtype=tl.int64)
        t_masked, t_z, t_weight, t_key, t_mass = chunk_values(score_row, token_offs, token_offs < V, stop_row, active,
                                                              shift, temperature, NUM_STOP, MASS_SCALE, ACCURATE)
        token_mass = tl.sum(tl.where(chunk_survivors(t_masked, t_weight, t_key, min_p_floor, cut), t_mass, 0), 0)
        log_total = log_f64(total.to(tl.float64), ACCURATE)
        logprob = log_f64(token_mass.to(tl.float64), ACCURATE) - log_total
        rank = above + 1
        top_ids = key_ids(kept_top, ID_MASK)
        top_weight = exp_f32(key_values(kept_top, ID_BITS), ACCURATE)
        top_mass = tl.where(top_ids >= 0, (top_weight * MASS_SCALE).to(tl.int64), 0)
        top_logprobs = log_f64(top_mass.to(tl.float64), ACCURATE) - log_total

    tl.store(tokens_ptr + row, token)
    tl.store(error_ptr + row, error.to(tl.int64))
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
        tl.store(top_logprobs_ptr + row * stride_top + lane, tl.where(failed, 0.0, top_logprobs).to(tl.float32),
                 mask=on_top)


@dataclass
class SampleScratch:
    """The kernel's working memory, allocated once per bucket (fixed shapes: capture-safe)."""

    hist: torch.Tensor  # [rows, HIST_BINS] int64: one histogram of one radix digit per row
    block_mass: torch.Tensor  # [rows, ceil(V / BLOCK)] int64: the kept masses per block of the draw

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str) -> SampleScratch:
        return cls(hist=torch.zeros(rows, int(HIST_BINS), dtype=torch.int64, device=device),
                   block_mass=torch.zeros(rows, -(-vocab // BLOCK), dtype=torch.int64, device=device))


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


def _chunk(vocab: int) -> int:
    """Tokens per step of a pass, whole blocks of the draw: GPU_CHUNK on a GPU; in the
    interpreter, whose cost is per operation, the whole row up to 16384."""
    if interpreting():
        return min(16384, max(BLOCK, triton.next_power_of_2(vocab)))
    return GPU_CHUNK if vocab >= GPU_CHUNK else BLOCK


def _launch_constants(vocab: int, num_stop: int, num_top: int, mode: int, separate_logits: bool,
                      has_nothing_allowed: bool, has_row_controlled: bool = False,
                      write_kept: bool = False) -> dict[str, object]:
    num_blocks = -(-vocab // BLOCK)
    id_bits = max(1, (vocab - 1).bit_length())
    return dict(V=vocab, NUM_STOP=num_stop, NUM_TOP=num_top, TOP_PAD=triton.next_power_of_2(max(num_top, 1)),
                LOGPROBS=mode, SEPARATE_LOGITS=separate_logits, HAS_NOTHING_ALLOWED=has_nothing_allowed,
                CHUNK=_chunk(vocab), BLOCK_TOKENS=BLOCK, NUM_BLOCKS=num_blocks,
                BLOCKS_PAD=triton.next_power_of_2(num_blocks), MASS_BITS=mass_bits(vocab),
                ID_BITS=id_bits, ID_MASK=(1 << id_bits) - 1, ACCURATE=not interpreting(),
                HAS_ROW_CONTROLLED=has_row_controlled, WRITE_KEPT=write_kept)


@triton_op("engine::sample_rows", mutates_args={"hist", "block_mass", "tokens", "logprob", "rank", "top_ids",
                                                "top_logprobs", "needs_exact", "error", "kept_weights",
                                                "mass_total", "one_hot_tokens"})
def _sample_rows_op(scores: torch.Tensor, logits: torch.Tensor | None, temperatures: torch.Tensor,
                    top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, row_to_req: torch.Tensor,
                    stop_ids: torch.Tensor, eos_suppression_rows: torch.Tensor, forced_tokens: torch.Tensor,
                    draw_uniforms: torch.Tensor, nothing_allowed: torch.Tensor | None, hist: torch.Tensor,
                    block_mass: torch.Tensor, tokens: torch.Tensor, logprob: torch.Tensor, rank: torch.Tensor,
                    top_ids: torch.Tensor, top_logprobs: torch.Tensor, needs_exact: torch.Tensor,
                    error: torch.Tensor, logprobs_mode: int, row_controlled: torch.Tensor | None = None,
                    kept_weights: torch.Tensor | None = None, mass_total: torch.Tensor | None = None,
                    one_hot_tokens: torch.Tensor | None = None) -> None:
    rows, vocab = scores.shape
    if rows == 0:
        return
    plain = scores if logits is None else logits
    write_kept = kept_weights is not None
    constants = _launch_constants(vocab, stop_ids.shape[1], top_ids.shape[1], logprobs_mode, logits is not None,
                                  nothing_allowed is not None, row_controlled is not None, write_kept)
    wrap_triton(_sample_kernel)[(rows,)](
        scores, plain, scores.stride(0), plain.stride(0),
        temperatures, top_ks, top_ps, min_ps, row_to_req, stop_ids, stop_ids.stride(0),
        eos_suppression_rows, forced_tokens, draw_uniforms,
        eos_suppression_rows if nothing_allowed is None else nothing_allowed,
        hist, block_mass, hist.stride(0), block_mass.stride(0),
        tokens, logprob, rank, top_ids, top_logprobs, needs_exact, error, top_ids.stride(0),
        eos_suppression_rows if row_controlled is None else row_controlled,  # never read without the flags
        kept_weights if write_kept else scores, mass_total if write_kept else logprob,
        one_hot_tokens if write_kept else tokens, kept_weights.stride(0) if write_kept else 0,
        **constants, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
    )


@_sample_rows_op.register_fake
def _sample_rows_fake(*args: object, **kwargs: object) -> None:
    """Fake tensors (the dry run's): the op only writes its preallocated outputs and
    scratch, which keep their shapes, so there is nothing to compute. Registered
    explicitly because under `TRITON_INTERPRET=1` `wrap_triton` hands back the plain
    kernel, which would run on the fake tensors."""


def sample_rows(scores: torch.Tensor, params: RowParams, out: SampleOutput, scratch: SampleScratch, *,
                logits: torch.Tensor | None = None, nothing_allowed: torch.Tensor | None = None,
                logprobs: str | None = None, row_controlled: torch.Tensor | None = None,
                kept: KeptWeights | None = None) -> SampleOutput:
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
        out.needs_exact, out.error, LOGPROBS_MODES[logprobs], row_controlled,
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
                    one_hot_ptr="*i64")
    strides = ("stride_scores", "stride_logits", "stride_stop", "stride_hist", "stride_blocks", "stride_top",
               "stride_weights")
    signature = {name: pointers.get(name, "i64" if name in strides else "constexpr")
                 for name in _sample_kernel.arg_names}
    return signature


def _aot_builds() -> list[dict[str, object]]:
    """The configurations the CUDA step launches, for `profiling.kernel_build` (name, fn,
    signature, constexprs): the largest vocabulary (129280: the most draw blocks, the widest
    block cumsum; a smaller one compiles the same code with smaller constants) with 4 stop
    ids and top-20, raw and processed logprobs (no logprobs compiles a subset of raw)."""
    builds = []
    for mode in ("raw", "processed"):
        # The kernel head's launch: per-row controlled flags; in raw mode also rejection
        # verification's kept weights.
        for kept in (False, True) if mode == "raw" else (False,):
            constants = _launch_constants(129280, 4, 20, LOGPROBS_MODES[mode], True, True, True, kept)
            constants.update(CHUNK=GPU_CHUNK, ACCURATE=True)
            builds.append(dict(name=f"sample_rows V=129280 {mode}{' kept' if kept else ''}", fn=_sample_kernel,
                               signature=_aot_signature(), constexprs=constants, num_warps=NUM_WARPS))
    return builds


AOT_BUILDS = _aot_builds()
