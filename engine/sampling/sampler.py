"""The sampler (docs/contract.md §2): the stages composed, in order, over whole rows.

Per sample row: fp32 logits -> forced token -> penalties, logit bias,
allowed tokens -> token bitmask -> EOS/stop suppression -> temperature ->
top-k -> top-p -> min-p -> draw -> logprobs. One stage per file, each with
its definitions:

- `rows`: per-request controls expanded to sample rows;
- `penalties`, `logit_bias`, `allowed_tokens`: the sampling controls, applied
  to the logits in place before `sample` by the step (`engine/step/controls.py`);
- `token_bitmask`: structured output and bad words, disallowed tokens -inf;
- `suppression`: EOS / stop ids;
- `thresholds`: temperature, the kept set (top-k, top-p, min-p) by radix
  select and the tokens' masses, with a fixed amount of work per row;
- `filters`: the same kept set by sorting (the reference path);
- `draw`: greedy, inverse CDF over the kept weights, the forced token;
- `logprobs`: raw or processed logprobs, rank, top-N;
- `errors`: failed rows and their placeholder;
- `exact`: the same stages over the sorted row (`sample_exact`), a reference.

Every row is decided inside this call: nothing is left to a later eager
pass, whatever the row's values.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from engine.sampling.draw import drawn_token, inverse_cdf_draw, plain_uniform
from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError, row_errors, write_placeholders
from engine.sampling.logprobs import processed_row_logprobs, raw_logprobs
from engine.sampling.row_max import first_max
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.thresholds import RowDistribution, row_distribution, suppress_in_place
from engine.sampling.token_bitmask import apply_token_bitmask

LOGPROBS_MODES = ("raw", "processed")
# What a sampler variant (one graph set) computes: "greedy" only the argmax (every
# row greedy and none with its EOS suppression on), "plain" the draw without
# filters (no sampled row has top-k, top-p or min-p), "filters" the filters too.
# Rows a variant cannot serve must not reach it.
STAGES = ("greedy", "plain", "filters")
# How the "filters" stage finds the top-k cut: "none" (no row has top-k), "topk" (a
# topk of candidate_cap scores: every top-k <= candidate_cap), "radix" (a counting
# radix select: any k).
TOP_K_MODES = ("none", "topk", "radix")


@dataclass(frozen=True)
class SamplerConfig:
    candidate_cap: int = 1024  # C: the largest top-k of the "filters" stages and of top-k-space verification
    max_logprobs: int = 20  # largest top-N the engine allocates for
    logprobs_mode: str = "raw"  # "raw": log-softmax of unprocessed logits; "processed": of the sampled distribution
    stages: str = "filters"  # STAGES: what this variant computes
    top_k: str = "radix"  # TOP_K_MODES: how "filters" finds the top-k cut
    top_p: bool = True  # whether "filters" runs top-p (False: no row has it)
    logprobs: bool = True  # False: this variant never computes logprobs (no request wants them)
    chunk_rows: int = 0  # > 0: sample at most this many rows at a time (on CPU, big temporaries cost page faults)

    def __post_init__(self) -> None:
        for name in ("candidate_cap", "max_logprobs", "chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: must be an int")
        if self.candidate_cap < 1:
            raise ValueError(f"candidate_cap={self.candidate_cap!r}: must be >= 1")
        if self.chunk_rows < 0:
            raise ValueError(f"chunk_rows={self.chunk_rows!r}: must be >= 0 (0: no chunks)")
        if not 0 <= self.max_logprobs <= self.candidate_cap:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must lie in [0, candidate_cap={self.candidate_cap}]")
        if self.stages not in STAGES:
            raise ValueError(f"stages={self.stages!r}: must be one of {STAGES}")
        if self.top_k not in TOP_K_MODES:
            raise ValueError(f"top_k={self.top_k!r}: must be one of {TOP_K_MODES}")
        for name in ("top_p", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a bool")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES}")


def controlled_scores(raw: torch.Tensor, token_bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores the sampler draws from: `raw` after the token bitmask
    (docs/contract.md §2, stage 4; the penalties, logit bias and allowed
    tokens of stage 3 are already in `raw` when the step applies them).

    Parameters: `raw` [rows, V] f32 logits; `token_bitmask` [rows, ceil(V /
    32)] int32 or None (no row restricted). Returns: the scores [rows, V] f32
    (`raw` itself without a bitmask) and [rows] bool, the rows the bitmask
    leaves nothing to sample (None without a bitmask). Capture-safe.
    """
    if token_bitmask is None:
        return raw, None
    return apply_token_bitmask(raw, token_bitmask)


def _greedy(raw: torch.Tensor, params: RowParams, out: SampleOutput) -> SampleOutput:
    """The "greedy" stage: every row greedy, none suppressed, no controls, no logprobs:
    the argmax (ties to the smallest id), the forced token, the finite check, and
    nothing else (the logprob fields stay untouched). `raw` [rows, V] f32. Capture-safe."""
    best, token = first_max(raw)  # the first of the largest; NaN and +inf show in `best`
    # Without suppression or controls a row always has a token: only the finite check can fail it.
    error = row_errors(raw, None, row_max=best)
    forced = params.forced_tokens
    out.tokens.copy_(torch.where(error == RowError.OK, torch.where(forced >= 0, forced, token), PLACEHOLDER_TOKEN))
    out.error.copy_(error)
    out.needs_exact.fill_(False)
    return out


def sample(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    out: SampleOutput | None = None,
    *,
    compute_logprobs: bool = True,
    unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
    distribution: Callable[..., RowDistribution] | None = None,
) -> SampleOutput:
    """Sample one token per row; capture-safe.

    Parameters: `logits` [rows, V] (any float dtype, read as f32) on the
    sampling device (an f32 `logits` is written during the call, at the
    suppressed stop ids, and holds its own values again when it returns,
    raising or not); `params` their controls (same device); `cfg` the
    sampler's; `out` preallocated outputs (None: allocated, top-N =
    cfg.max_logprobs). `compute_logprobs=False` leaves logprob, rank and
    top-N of the rows untouched. `unprocessed` [rows, V] f32 (same device):
    the logits before the sampling controls (penalties, logit bias, allowed
    tokens) when `logits` hold the controlled ones; the finiteness check and
    raw logprobs read it (None: `logits` are unprocessed). `token_bitmask`
    [rows, ceil(V / 32)] int32 (same device) or None: the rows' allowed
    tokens (`token_bitmask.py`). `distribution`: how the kept set is found
    (None: `thresholds.row_distribution`; the reference path passes its
    sorting walk). Returns: `out`: tokens [rows] int64,
    logprob [rows] f32, rank [rows] int64, top_ids / top_logprobs [rows, N],
    needs_exact [rows] bool (always False: every row is decided here), error
    [rows] int64 (`RowError`; nonzero rows hold the placeholder).
    Raises: ValueError when top-N exceeds V.

    No host syncs, no data-dependent shapes, no generator state, and the same
    work whatever the values: a flat row costs what a peaked one does.
    """
    rows_n, vocab = logits.shape
    if out is None:
        out = SampleOutput.allocate(rows_n, cfg.max_logprobs, logits.device)
    num_top = out.top_ids.shape[1]
    if num_top > vocab:
        raise ValueError(f"top-N={num_top}: exceeds the vocabulary V={vocab}")
    if cfg.stages == "greedy" and unprocessed is None and token_bitmask is None and not (compute_logprobs and cfg.logprobs):
        return _greedy(logits.to(torch.float32), params, out)  # no [rows, V] temporaries: no slices
    if cfg.chunk_rows and rows_n > cfg.chunk_rows:  # rows are independent: the same bits in slices
        whole = dataclasses.replace(cfg, chunk_rows=0)
        for start in range(0, rows_n, cfg.chunk_rows):
            stop = min(start + cfg.chunk_rows, rows_n)
            sample(logits[start:stop], params.row_slice(start, stop), whole, out.row_slice(start, stop),
                   compute_logprobs=compute_logprobs, distribution=distribution,
                   unprocessed=None if unprocessed is None else unprocessed[start:stop],
                   token_bitmask=None if token_bitmask is None else token_bitmask[start:stop])
        return out
    raw = logits.to(torch.float32)  # [rows, V]
    # The controls' -inf (tokens not allowed) is no fault of the row: only the model's logits must be finite.
    plain = raw if unprocessed is None else unprocessed.to(torch.float32)  # [rows, V]
    rows = expand_rows(params, vocab)  # the forced token is among them; it overrides the draw below
    # Everything below draws from the controlled scores; the finite check and raw logprobs read `plain`.
    scores, nothing_allowed = controlled_scores(raw, token_bitmask)  # [rows, V] f32
    compute_logprobs = compute_logprobs and cfg.logprobs
    processed = compute_logprobs and cfg.logprobs_mode == "processed"
    d = None
    # Suppressed stop ids -inf, in `scores` itself until `restore` (`scores` may be `plain`,
    # even the caller's `logits`): only the masked scores are read until then.
    masked, restore, at_stops = suppress_in_place(scores, rows)  # at_stops: `scores` at the stop-id slots
    try:
        best, greedy = first_max(masked)  # the first of the largest: ties go to the smallest id
        if cfg.stages != "greedy" or processed:
            # Processed logprobs report the kept set of greedy rows too: every filter runs.
            full = cfg.stages != "filters" and processed
            d = (distribution or row_distribution)(
                masked, best, rows, filters=cfg.stages == "filters" or processed,
                top_k="radix" if full else cfg.top_k, top_k_width=cfg.candidate_cap, top_p=cfg.top_p or full,
                kept_set=processed)
    finally:
        restore()
    drawn = greedy if cfg.stages == "greedy" else inverse_cdf_draw(d.weights, d.block_mass, plain_uniform(rows))
    token = drawn_token(rows, greedy, drawn)  # the forced token overrides both
    # No valid token: an all -inf row's maximum is -inf. A NaN row's picks
    # may be anything in the vocabulary: the placeholder replaces them.
    nothing_left = best == -math.inf
    row_max = None  # the finite check's row maximum of `plain`: one more pass over the rows
    if token_bitmask is None and unprocessed is None:
        # `masked` is `plain` (= `scores`) but at the stop-id slots: their values and `best` give
        # plain's maximum (NaN and +inf included: both reductions and `maximum` propagate NaN).
        row_max = torch.maximum(best, at_stops.amax(-1))
    error = row_errors(plain, nothing_left, nothing_allowed, row_max=row_max)
    failed = error != RowError.OK
    token = torch.where(failed, PLACEHOLDER_TOKEN, token)
    if compute_logprobs:
        lp = processed_row_logprobs(d, token, num_top) if processed else raw_logprobs(plain, token, num_top)
        lp.write(out)
    out.tokens.copy_(token)
    out.needs_exact.fill_(False)
    out.error.copy_(error)
    write_placeholders(out, failed)
    return out
