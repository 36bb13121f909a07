"""The exact path: rows decided over the whole sorted vocabulary.

The same stages as the fast path (`engine.sampling.sampler.sample`), with the
whole row in place of the top C candidates: its results equal what an
unlimited `candidate_cap` would give. `sample_exact` redoes the rows the fast
path flagged; `sample_reference` runs every row this way (tests and
benchmarks); `kept_sets` lists each row's kept tokens; verification's
`target_probs` builds on `full_row_distribution`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from engine.sampling.draw import drawn_token, greedy_token, gumbel_race, inverse_cdf_draw, plain_uniform
from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError, row_errors, write_placeholders
from engine.sampling import filters
from engine.sampling.logprobs import RowLogprobs, processed_logprobs, token_logprobs, top_n_ids
from engine.sampling.normaliser import block_log_normaliser, raw_log_normaliser
from engine.sampling.rows import SamplingRows, expand_rows
from engine.sampling.sampler import SamplerConfig, controlled_scores
from engine.sampling.suppression import suppressed_mask, unsuppressed_shift
from engine.sampling.temperature import processed_logits
from graphs.step_fields import RowParams, SampleOutput

# Rows the exact path decides at once: it holds about ten [rows, V] tensors,
# so a large flagged batch goes in slices (rows are independent, the bits
# do not depend on the slicing).
EXACT_CHUNK_ROWS = 64


@dataclass
class FullRowDistribution:
    """A row's processed distribution over the whole vocabulary, sorted."""

    valid: torch.Tensor  # [rows, V] bool: not a suppressed stop id, not masked (-inf)
    weights: torch.Tensor  # [rows, V] f32: exp(z) by token id, suppressed ids 0
    block_mass: torch.Tensor  # [rows, blocks] f32
    log_z: torch.Tensor  # [rows] f64
    zs: torch.Tensor  # [rows, V] f32 in (z desc, id asc) order
    zs_ids: torch.Tensor  # [rows, V] int64
    p: torch.Tensor  # [rows, V] f64, sorted like zs
    kept: filters.KeptSet  # over the sorted row


def full_row_distribution(raw: torch.Tensor, rows: SamplingRows) -> FullRowDistribution:
    """Suppression, temperature, normaliser and kept set over whole rows.

    Parameters: `raw` [rows, V] f32 logits; `rows` their controls. A row with
    no unsuppressed token keeps finite numbers (shifted by its largest raw
    logit). Returns: `FullRowDistribution`. Capture-safe (one full-row sort).
    """
    # Sorted outputs keep the input's layout, and float32 sums over them
    # round in memory order: work on row-major logits whatever the caller's.
    raw = raw.contiguous()
    # -inf: a token the token bitmask masked, never valid.
    valid = ~suppressed_mask(rows, raw.shape[1]) & (raw > -math.inf)
    shift = unsuppressed_shift(raw, valid, raw.amax(-1))
    z = processed_logits(raw, shift, rows.temperature, valid=valid)  # [rows, V] f32
    weights = z.exp()
    block_mass, log_z = block_log_normaliser(weights)
    zs, zs_ids, p = filters.sorted_distribution(z, None, log_z)
    return FullRowDistribution(valid, weights, block_mass, log_z, zs, zs_ids, p, filters.kept_set(zs, p, rows))


def _if_any(needed: torch.Tensor, draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`draw()` [rows] int64 when a row of `needed` [rows] bool takes it, else
    zeros: the exact path is eager, so it skips the draws no row uses."""
    return draw() if bool(needed.any()) else torch.zeros_like(needed, dtype=torch.int64)


def _write_exact_rows(
    logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, index: torch.Tensor, out: SampleOutput,
    compute_logprobs: bool = True, unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> None:
    """Rows `index` [n] int64 of `out`, decided over the whole vocabulary (eager)."""
    raw = logits.to(torch.float32)[index]  # [n, V]
    before = raw if unprocessed is None else unprocessed.to(torch.float32)[index]  # [n, V] before the controls
    vocab = raw.shape[1]
    rows = expand_rows(params.rows(index), vocab)
    scores, nothing_allowed = controlled_scores(raw, None if token_bitmask is None else token_bitmask[index])
    d = full_row_distribution(scores, rows)  # a -inf (not allowed) token is no token to choose
    error = row_errors(before, ~d.valid.any(-1), nothing_allowed)
    # The kept set is a prefix of the sorted row: race over the longest one only.
    width = max(1, int(d.kept.kept.sum(-1).max()))
    raced = _if_any(~rows.greedy & ~rows.plain, lambda: gumbel_race(
        d.zs[:, :width], d.zs_ids[:, :width], d.kept.kept[:, :width], rows.seed, rows.position, vocab))
    plain = _if_any(rows.plain, lambda: inverse_cdf_draw(d.weights, d.block_mass, plain_uniform(rows)))
    greedy = _if_any(rows.greedy, lambda: greedy_token(scores, torch.arange(vocab, device=raw.device), d.valid, vocab))
    token = drawn_token(rows, greedy, raced, plain)
    failed = error != RowError.OK
    token = torch.where(failed, PLACEHOLDER_TOKEN, token)
    out.tokens[index] = token
    out.needs_exact[index] = False
    out.error[index] = error
    if compute_logprobs:
        num_top = out.top_ids.shape[1]
        if cfg.logprobs_mode == "raw":
            lse = raw_log_normaliser(before, before.amax(-1))
            logprob, rank = token_logprobs(before, token, log_normaliser=lse)
            top_ids = top_n_ids(before, num_top) if num_top else torch.zeros(len(index), 0, dtype=torch.int64, device=raw.device)
            lp = RowLogprobs(logprob, rank, top_ids, before.gather(1, top_ids).to(torch.float64) - lse[:, None])
        else:
            lp = processed_logprobs(d.log_z, d.zs, d.zs_ids, d.p, d.kept.kept, token, num_top)
        lp.write(out, index)
    write_placeholders(out, torch.zeros_like(out.needs_exact).index_fill_(0, index[failed], True))


def sample_exact(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    rows: torch.Tensor,
    out: SampleOutput,
    *,
    compute_logprobs: bool = True,
    unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> SampleOutput:
    """Redo the given rows over the full vocabulary.

    Parameters: `logits` [rows, V] (any float dtype, read as f32), `params`,
    `cfg`, `unprocessed` and `token_bitmask` as given to `sample`; `rows`
    [rows] bool mask or [n] int64 index of the rows to redo; `out` the fast
    path's `SampleOutput`, written in place on those rows.
    `compute_logprobs=False` leaves logprob, rank and top-N untouched.

    Eager and host-synchronising: it runs after the captured step, only for
    rows the fast path flagged. Results equal an unlimited `candidate_cap`.
    """
    rows = rows.to(logits.device)
    index = torch.nonzero(rows).flatten() if rows.dtype == torch.bool else rows.flatten().to(torch.int64)
    for start in range(0, len(index), EXACT_CHUNK_ROWS):
        _write_exact_rows(logits, params, cfg, index[start : start + EXACT_CHUNK_ROWS], out, compute_logprobs,
                          unprocessed, token_bitmask)
    return out


def sample_reference(logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, num_top: int | None = None,
                     token_bitmask: torch.Tensor | None = None) -> SampleOutput:
    """Every row of `logits` [rows, V] by the exact path (tests and benchmarks).

    Returns: a new `SampleOutput` with top-N = `num_top` (None: cfg.max_logprobs).
    """
    rows_n = logits.shape[0]
    out = SampleOutput.allocate(rows_n, cfg.max_logprobs if num_top is None else num_top, logits.device)
    return sample_exact(logits, params, cfg, torch.arange(rows_n, device=logits.device), out,
                        token_bitmask=token_bitmask)


def kept_sets(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[rows, V] bool: the tokens each row's filters keep, over the whole sorted row.

    Parameters: `logits` [rows, V] (read as f32) and their `params`.
    """
    raw = logits.to(torch.float32)
    mask = torch.zeros(raw.shape, dtype=torch.bool, device=raw.device)
    for start in range(0, raw.shape[0], EXACT_CHUNK_ROWS):
        part = torch.arange(start, min(start + EXACT_CHUNK_ROWS, raw.shape[0]), device=raw.device)
        d = full_row_distribution(raw[part], expand_rows(params.rows(part), raw.shape[1]))
        mask[part] = torch.zeros_like(d.valid).scatter_(1, d.zs_ids, d.kept.kept)
    return mask
