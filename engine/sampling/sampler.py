"""The sampler's fast path (docs/contract.md §2): the stages composed, in order.

Per sample row: fp32 logits -> forced token -> penalties, logit bias,
allowed tokens -> token bitmask -> EOS/stop suppression -> temperature ->
top-k -> top-p -> min-p -> draw -> logprobs. One stage per file, each with
its definitions:

- `rows`: per-request controls expanded to sample rows;
- `penalties`, `logit_bias`, `allowed_tokens`: the sampling controls, applied
  to the logits in place before `sample` by the step (`engine/step/controls.py`);
- `token_bitmask`: structured output and bad words, disallowed tokens -inf;
- `candidates`: the top C raw logits, and what they settle;
- `suppression`: EOS / stop ids, and the shift M;
- `temperature`: processed logits z = (raw - M) / T;
- `normaliser`: the fixed-block log Z;
- `filters`: the kept set (top-k, top-p, min-p), one definition for every path;
- `draw`: greedy, the Gumbel race, inverse CDF, the forced token;
- `logprobs`: raw or processed logprobs, rank, top-N;
- `errors`: failed rows and their placeholder;
- `exact`: the same stages over the whole sorted row (`sample_exact`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.candidates import decide_on_candidates, top_candidates
from engine.sampling.draw import drawn_token, inverse_cdf_draw, plain_uniform
from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError, row_errors, write_placeholders
from engine.sampling.logprobs import RowLogprobs, candidate_raw_logprobs, processed_logprobs
from engine.sampling.normaliser import block_log_normaliser, raw_log_normaliser
from engine.sampling.rows import SamplingRows, expand_rows
from engine.sampling.suppression import suppression_and_shift, zero_suppressed_
from engine.sampling.temperature import processed_logits
from engine.sampling.token_bitmask import apply_token_bitmask
from graphs.step_fields import RowParams, SampleOutput

LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplerConfig:
    candidate_cap: int = 1024  # C: candidates per row on the fast path
    max_logprobs: int = 20  # largest top-N the engine allocates for
    logprobs_mode: str = "raw"  # "raw": log-softmax of unprocessed logits; "processed": of the sampled distribution

    def __post_init__(self) -> None:
        for name in ("candidate_cap", "max_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: must be an int")
        if self.candidate_cap < 1:
            raise ValueError(f"candidate_cap={self.candidate_cap!r}: must be >= 1")
        if not 0 <= self.max_logprobs <= self.candidate_cap:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must lie in [0, candidate_cap={self.candidate_cap}]")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES}")


def _exp_processed(raw: torch.Tensor, shift: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """exp(z) over the full row, [rows, V] f32, suppressed stop ids 0 (no [rows, V] mask)."""
    return zero_suppressed_(processed_logits(raw, shift, rows.temperature).exp_(), rows)


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


def _unprocessed_logprobs(plain: torch.Tensor, token: torch.Tensor, num_top: int) -> tuple[RowLogprobs, torch.Tensor]:
    """Raw logprobs from the unprocessed logits `plain` [rows, V] f32 when the
    candidates are those of the controlled scores: the top-N come from N + 1
    candidates of their own (a tie at the N-th sends the row to the exact path)."""
    vocab = plain.shape[1]
    cap = min(num_top + 1, vocab)
    cand_raw, cand_ids, _ = top_candidates(plain, cap)  # [rows, N + 1]
    lse = raw_log_normaliser(plain, cand_raw[:, 0])
    return candidate_raw_logprobs(plain, token, cand_raw, cand_ids, lse, num_top, cap < vocab)


def sample(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    out: SampleOutput | None = None,
    *,
    compute_logprobs: bool = True,
    unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample one token per row; capture-safe.

    Parameters: `logits` [rows, V] (any float dtype, read as f32) on the
    sampling device; `params` their controls (same device); `cfg` the
    sampler's; `out` preallocated outputs (None: allocated, top-N =
    cfg.max_logprobs). `compute_logprobs=False` leaves logprob, rank and
    top-N of the rows untouched. `unprocessed` [rows, V] f32 (same device):
    the logits before the sampling controls (penalties, logit bias, allowed
    tokens) when `logits` hold the controlled ones; the finiteness check and
    raw logprobs read it (None: `logits` are unprocessed). `token_bitmask`
    [rows, ceil(V / 32)] int32 (same device) or None: the rows' allowed
    tokens (`token_bitmask.py`). Returns: `out`: tokens [rows] int64,
    logprob [rows] f32, rank [rows] int64, top_ids / top_logprobs [rows, N],
    needs_exact [rows] bool (redo those rows with `sample_exact`), error
    [rows] int64 (`RowError`; nonzero rows hold the placeholder).
    Raises: ValueError when top-N exceeds min(candidate_cap, V).

    No host syncs, no data-dependent shapes, no generator state.
    """
    rows_n, vocab = logits.shape
    if out is None:
        out = SampleOutput.allocate(rows_n, cfg.max_logprobs, logits.device)
    num_top = out.top_ids.shape[1]
    cap = min(cfg.candidate_cap, vocab)
    if num_top > cap:
        raise ValueError(f"top-N={num_top}: exceeds the candidate count min(candidate_cap, V)={cap}")
    has_tail = cap < vocab
    raw = logits.to(torch.float32)  # [rows, V]
    # The controls' -inf (tokens not allowed) is no fault of the row: only the model's logits must be finite.
    plain = raw if unprocessed is None else unprocessed.to(torch.float32)  # [rows, V]
    rows = expand_rows(params, vocab)  # the forced token is among them; it overrides the draw below
    # Everything below draws from the controlled scores; the finite check and raw logprobs read `plain`.
    scores, nothing_allowed = controlled_scores(raw, token_bitmask)  # [rows, V] f32

    cand_raw, cand_ids, boundary_raw = top_candidates(scores, cap)  # [rows, C] (score desc, id asc)
    valid, any_valid, shift = suppression_and_shift(cand_raw, cand_ids, boundary_raw, rows)
    weights = _exp_processed(scores, shift, rows)  # temperature over the full row: [rows, V] f32 exp(z)
    block_mass, log_z = block_log_normaliser(weights)
    # top-k -> top-p -> min-p over the candidates, the race among the kept ones, the greedy pick.
    d = decide_on_candidates(cand_raw, cand_ids, boundary_raw, valid, shift, log_z, rows, has_tail, vocab)
    token = drawn_token(rows, d.greedy_token, d.raced, inverse_cdf_draw(weights, block_mass, plain_uniform(rows)))
    # A NaN row's picks may be V (no candidate equals the NaN maximum): the
    # placeholder goes in before anything indexes by token. Without a tail,
    # no valid candidate (neither a suppressed stop id nor -inf) means no
    # valid token at all; with one, the exact path decides, unless the
    # controls set the whole tail to -inf (a -inf boundary).
    nothing_left = ~any_valid & (boundary_raw == -math.inf) if has_tail else ~any_valid
    error = row_errors(plain, nothing_left, nothing_allowed)
    failed = error != RowError.OK
    token = torch.where(failed, PLACEHOLDER_TOKEN, token)

    needs_exact = d.needs_exact(rows, any_valid)
    if compute_logprobs:
        if cfg.logprobs_mode == "raw" and scores is plain:
            lse = raw_log_normaliser(raw, cand_raw[:, 0])
            lp, top_tie_in_tail = candidate_raw_logprobs(raw, token, cand_raw, cand_ids, lse, num_top, has_tail)
            needs_exact = needs_exact | top_tie_in_tail
        elif cfg.logprobs_mode == "raw":
            lp, top_tie_in_tail = _unprocessed_logprobs(plain, token, num_top)
            needs_exact = needs_exact | top_tie_in_tail
        else:
            lp = processed_logprobs(log_z, d.zs, d.zs_ids, d.p, d.kept, token, num_top)
            # A plain row's processed distribution covers the whole row: its
            # logprobs (like those of any kept set reaching the tail) come
            # from the exact path.
            needs_exact = needs_exact | (has_tail & (rows.plain | d.reaches_tail | d.filter_ambiguous))
        lp.write(out)
    out.tokens.copy_(token)
    out.needs_exact.copy_(needs_exact)
    out.error.copy_(error)
    write_placeholders(out, failed)
    return out
