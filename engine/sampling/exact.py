"""The reference path: the sampler with its kept set found by sorting.

`engine.sampling.sampler.sample` finds each row's filter thresholds by radix
select (`engine.sampling.thresholds`); this path sorts the whole row and walks
it (`engine.sampling.filters`), and otherwise runs the same stages. Both give
the same bits (tested): the exact sums of integer masses make the walk and the
radix passes agree. Nothing in a step calls it; tests and benchmarks do.
`sample_exact` redoes given rows of a `SampleOutput`, `sample_reference`
every row, `kept_sets` lists each row's kept tokens.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from engine.sampling import filters as filters_module
from engine.sampling.thresholds import RowDistribution, block_sums, processed_scores, token_masses
from engine.sampling.row_params import RowParams
from engine.sampling.rows import SamplingRows, expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, TorchStages, sample
from engine.sampling.rows import suppressed_scores

# Rows sorted at once: a large batch goes in slices (rows are independent,
# the bits do not depend on the slicing).
EXACT_CHUNK_ROWS = 64


def sorted_row_distribution(masked: torch.Tensor, best: torch.Tensor, rows: SamplingRows, **_variant: object
                            ) -> RowDistribution:
    """`thresholds.row_distribution`, with the kept set from a full-row sort
    and walk. Same parameters; the variant's keywords are ignored: the walk
    always runs every filter (a row without one keeps every valid token)
    and takes any k. Capture-safe (one sort per row)."""
    shift, z = processed_scores(masked, best, rows)
    # Sorted outputs keep the input's layout: work on row-major values.
    zs, zs_ids = torch.sort(z.contiguous(), dim=1, descending=True, stable=True)
    ws = zs.exp()
    ks = filters_module.kept_set(zs, ws, token_masses(ws), rows)
    kept = torch.zeros_like(masked, dtype=torch.bool).scatter_(1, zs_ids, ks.kept) & (masked > -math.inf)
    weights = z.exp() * kept.to(z.dtype)
    return RowDistribution(shift, z, kept, weights, block_sums(weights))


class ReferenceStages(TorchStages):
    """The sampler's stages with the kept set (temperature, min-p, top-k, top-p) found
    by the sorted walk."""

    def kept_set(self, masked: torch.Tensor, best: torch.Tensor, rows: SamplingRows, **variant: object
                 ) -> RowDistribution:
        return sorted_row_distribution(masked, best, rows, **variant)


REFERENCE_STAGES = ReferenceStages()


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
    """Redo the given rows by the reference path (eager).

    Parameters: `logits` [rows, V] (any float dtype, read as f32), `params`,
    `cfg`, `unprocessed` and `token_bitmask` as given to `sample`; `rows`
    [rows] bool mask or [n] int64 index of the rows to redo; `out` a
    `SampleOutput`, written in place on those rows. `compute_logprobs=False`
    leaves logprob, rank and top-N untouched.
    """
    rows = rows.to(logits.device)
    index = torch.nonzero(rows).flatten() if rows.dtype == torch.bool else rows.flatten().to(torch.int64)
    full = dataclasses.replace(cfg, stages="filters", top_k="radix", top_p=True)  # the reference serves any row
    for start in range(0, len(index), EXACT_CHUNK_ROWS):
        part = index[start : start + EXACT_CHUNK_ROWS]
        sub = SampleOutput.allocate(len(part), out.top_ids.shape[1], logits.device)
        sample(logits[part], params.rows(part), full, sub, compute_logprobs=compute_logprobs,
               unprocessed=None if unprocessed is None else unprocessed[part],
               token_bitmask=None if token_bitmask is None else token_bitmask[part],
               stages=REFERENCE_STAGES)
        names = ("tokens", "error") + (("logprob", "rank", "top_ids", "top_logprobs") if compute_logprobs else ())
        for name in names:
            getattr(out, name)[part] = getattr(sub, name)
    return out


def sample_reference(logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, num_top: int | None = None,
                     token_bitmask: torch.Tensor | None = None) -> SampleOutput:
    """Every row of `logits` [rows, V] by the reference path (tests and benchmarks).

    Returns: a new `SampleOutput` with top-N = `num_top` (None: cfg.max_logprobs).
    """
    rows_n = logits.shape[0]
    out = SampleOutput.allocate(rows_n, cfg.max_logprobs if num_top is None else num_top, logits.device)
    return sample_exact(logits, params, cfg, torch.arange(rows_n, device=logits.device), out,
                        token_bitmask=token_bitmask)


def kept_sets(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[rows, V] bool: the tokens each row's filters keep, by the sorted walk.

    Parameters: `logits` [rows, V] (read as f32) and their `params`.
    """
    raw = logits.to(torch.float32)
    mask = torch.zeros(raw.shape, dtype=torch.bool, device=raw.device)
    for start in range(0, raw.shape[0], EXACT_CHUNK_ROWS):
        part = torch.arange(start, min(start + EXACT_CHUNK_ROWS, raw.shape[0]), device=raw.device)
        rows = expand_rows(params.rows(part), raw.shape[1])
        masked = suppressed_scores(raw[part], rows)
        mask[part] = sorted_row_distribution(masked, masked.amax(-1), rows).kept
    return mask
