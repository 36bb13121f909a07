"""EOS / stop-id suppression (docs/contract.md §2): which tokens a row must not produce.

While a request has generated fewer than `min_tokens` tokens, its rows flagged
in `eos_suppression_rows` give the EOS / stop ids z = -inf. One definition,
`suppressed_at`, decides whether a (row, token id) pair is suppressed; the
sampler applies it to whole rows (`thresholds.suppress_in_place`; verification
to a copy, `suppressed_scores`), the vocab-parallel candidate exchange to its
candidates (`suppression_and_shift`).

Duplicate slots. A row's stop-id slots may name the same id twice, and a
padding slot (-1, clamped to 0) lands on token 0 even when 0 is a real,
suppressed stop id. Scatter order is unspecified on CUDA, so every scatter
of a verdict writes a value that depends only on the target token, never on
which slot wrote it: duplicates always agree.
"""
from __future__ import annotations

import math

import torch

from engine.sampling.rows import SamplingRows


def suppressed_at(ids: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Whether each token id is suppressed on its row.

    Parameters: `ids` [rows, M] int64 token ids (candidates, or a row's own
    stop-id slots); `rows` the rows' controls. Returns: [rows, M] bool.
    Capture-safe.
    """
    return ((ids[:, :, None] == rows.stop_ids[:, None, :]) & rows.stop_active[:, None, :]).any(-1)


def unsuppressed_shift(raw: torch.Tensor, valid: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """M, the largest raw logit of a valid (unsuppressed) token.

    Parameters: `raw` [rows, M] f32 logits; `valid` [rows, M] bool; `fallback`
    [rows] f32, used where no valid token has a finite logit, so the row's
    numbers stay finite (such a row fails, or the candidate exchange flags it).
    Returns: [rows] f32. Capture-safe.
    """
    neg_inf = torch.full((), -math.inf, dtype=raw.dtype, device=raw.device)
    best = torch.where(valid, raw, neg_inf).amax(-1)
    return torch.where(best > -math.inf, best, fallback)


def suppression_and_shift(
    cand_raw: torch.Tensor, cand_ids: torch.Tensor, boundary_raw: torch.Tensor, rows: SamplingRows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Suppression over a row's candidates and the shift M.

    Parameters: `cand_raw`, `cand_ids` [rows, C] the candidates' raw logits
    (f32) and ids (int64); `boundary_raw` [rows] f32, the C-th candidate's
    value; `rows` the rows' controls. Returns: `valid` [rows, C] bool (the
    candidate is not a suppressed stop id, nor -inf: masked by the token
    bitmask), `any_valid` [rows] bool, and `shift` [rows] f32, M. M is a
    candidate unless every candidate is a suppressed stop id (C <= the number
    of stop ids); the candidate exchange flags such a row and the boundary value
    keeps its numbers finite. Capture-safe.
    """
    valid = ~suppressed_at(cand_ids, rows) & (cand_raw > -math.inf)
    return valid, valid.any(-1), unsuppressed_shift(cand_raw, valid, boundary_raw)
