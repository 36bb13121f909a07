"""Failed rows (docs/contract.md §2): the error codes and the placeholder outputs.

A row whose logits hold NaN or +-inf, whose controls turn a finite logit into
+inf or NaN, or whose controls leave no token (every token a suppressed stop
id), gets an error code in `SampleOutput.error`,
decided inside the captured step from the row itself. Its outputs are the
placeholder: token `PLACEHOLDER_TOKEN` (in the vocabulary, so nothing
downstream indexes out of range), logprob 0, rank 0, top ids -1, top
logprobs 0, never flagged for the reference path. The caller must not emit it.
Every sampling computation is per row, so a failed row changes no other
row's bits.
"""
from __future__ import annotations

import math
from enum import IntEnum

import torch

from engine.sampling.sample_output import SampleOutput


class RowError(IntEnum):
    """`SampleOutput.error` codes (int64 on the device)."""

    OK = 0
    LOGITS_NOT_FINITE = 1  # a NaN or +-inf logit in the row
    NOTHING_LEFT = 2  # the controls leave no token (EOS / stop suppression covers the vocabulary)
    HIDDEN_NOT_FINITE = 3  # set by the caller that owns the hidden states (`fail_rows`)
    NO_TOKEN_ALLOWED = 4  # the token bitmask (structured output, bad words) allows no token
    SCORES_NOT_FINITE = 5  # the controls turned a finite logit into +inf or NaN (a penalty near 0, a huge bias)


PLACEHOLDER_TOKEN = 0  # the token of a failed row: in the vocabulary, never emitted


def row_errors(raw: torch.Tensor, nothing_left: torch.Tensor | None, nothing_allowed: torch.Tensor | None = None,
               row_max: torch.Tensor | None = None, scores_max: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's `RowError`: logits not finite first, then processed scores not
    finite, then nothing allowed by the token bitmask, then nothing left.

    Parameters: `raw` [rows, V] f32 logits; `nothing_left` [rows] bool, rows
    whose controls leave no token, or None where no row can run out;
    `nothing_allowed` [rows] bool or None, rows whose token bitmask allows
    none; `row_max` [rows] f32, `raw`'s row maximum (NaN where a NaN is in
    the row) when the caller has it; `scores_max` [rows] f32, the processed
    scores' row maximum (+inf or NaN: a control overflowed), or None. Returns:
    [rows] int64 codes. Capture-safe.
    """
    # amax and amin propagate NaN, and an infinity is an extreme: two fast reductions. Two
    # comparisons then settle both (a NaN compares False), where `isfinite` is five ops each.
    row_max = raw.amax(-1) if row_max is None else row_max
    finite = (row_max < math.inf) & (raw.amin(-1) > -math.inf)
    left = int(RowError.OK) if nothing_left is None else torch.where(nothing_left, int(RowError.NOTHING_LEFT), int(RowError.OK))
    if nothing_allowed is not None:
        left = torch.where(nothing_allowed, int(RowError.NO_TOKEN_ALLOWED), left)
    if scores_max is not None:
        left = torch.where(scores_max < math.inf, left, int(RowError.SCORES_NOT_FINITE))  # NaN compares False
    return torch.where(finite, left, int(RowError.LOGITS_NOT_FINITE))


def write_placeholders(out: SampleOutput, failed: torch.Tensor) -> None:
    """The placeholder outputs on `failed` rows [rows] bool of `out`; capture-safe."""
    out.tokens.masked_fill_(failed, PLACEHOLDER_TOKEN)
    out.logprob.masked_fill_(failed, 0.0)
    out.rank.masked_fill_(failed, 0)
    out.top_ids.masked_fill_(failed[:, None], -1)
    out.top_logprobs.masked_fill_(failed[:, None], 0.0)
    out.needs_exact.masked_fill_(failed, False)


def fail_rows(out: SampleOutput, failed: torch.Tensor, code: RowError) -> None:
    """Mark `failed` rows [rows] bool with `code` (overriding the sampler's
    own code) and write the placeholder outputs; capture-safe. For failures
    the sampler cannot see, such as a non-finite hidden state."""
    out.error.masked_fill_(failed, int(code))
    write_placeholders(out, failed)
