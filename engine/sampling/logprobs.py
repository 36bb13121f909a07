"""Logprobs (docs/contract.md §2): the emitted token's logprob and rank, and top-N.

"raw" mode: log-softmax of the unprocessed logits, with the fixed-block
normaliser (`raw_log_normaliser`), so a logprob does not depend on which path
reported it: the fast path, the exact path, the step engine's rescoring of a
residual draw, or prompt logprobs. The rank is 1 + the number of tokens with
a strictly larger logit (ties share a rank); top-N lists the N largest
logits, best first, ties to the smaller id.

"processed" mode: the logprobs of the distribution the row drew from, the
kept set renormalised; a token outside it has logprob -inf and ranks after
every kept token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.normaliser import raw_log_normaliser
from graphs.step_fields import SampleOutput


@dataclass
class RowLogprobs:
    """Logprobs of a set of rows, before they are written into a `SampleOutput`."""

    logprob: torch.Tensor  # [rows] f64: the emitted token's
    rank: torch.Tensor  # [rows] int64
    top_ids: torch.Tensor  # [rows, N] int64, -1 where the distribution has fewer tokens
    top_logprobs: torch.Tensor  # [rows, N] f64

    def write(self, out: SampleOutput, index: torch.Tensor | None = None) -> None:
        """Into `out`: every row (capture-safe), or rows `index` [rows] int64 of it."""
        for name, value in vars(self).items():
            target = getattr(out, name)
            if index is None:
                target.copy_(value)
            else:
                target[index] = value.to(target.dtype)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    log_normaliser: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logprob and rank of each row's token.

    Parameters: `logits` [rows, V] f32 raw logits (or [rows, M] candidates,
    with `ids`); `tokens` [rows] int64; `log_normaliser` [rows] f64 from
    `raw_log_normaliser` when the caller has it (None: computed over
    `logits`); `ids` [rows, M] int64 the token id of each column of
    `logits`, when those are candidates holding every token that outranks
    the given one (None: column = token id). Returns: `logprob` [rows] f64
    and `rank` [rows] int64. Capture-safe.
    """
    if ids is None:
        value = logits.gather(1, tokens[:, None])  # [rows, 1]
    else:
        neg_inf = torch.full((), -math.inf, dtype=logits.dtype, device=logits.device)
        value = torch.where(ids == tokens[:, None], logits, neg_inf).amax(-1, keepdim=True)
    if log_normaliser is None:
        log_normaliser = raw_log_normaliser(logits, logits.amax(-1))
    rank = (logits > value).sum(-1) + 1
    return value.squeeze(1).to(torch.float64) - log_normaliser, rank


def candidate_raw_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    cand_raw: torch.Tensor,
    cand_ids: torch.Tensor,
    log_normaliser: torch.Tensor,
    num_top: int,
    has_tail: bool,
    *,
    ids: torch.Tensor | None = None,
) -> tuple[RowLogprobs, torch.Tensor]:
    """Raw logprobs with the top-N taken from ordered candidates.

    Parameters: `logits`, `tokens`, `log_normaliser`, `ids` as in
    `token_logprobs`; `cand_raw`, `cand_ids` [rows, C] in (raw desc, id asc)
    order, C >= `num_top`; `has_tail`: tokens exist past the C-th candidate.
    Returns: the logprobs, and [rows] bool: rows whose N-th value ties all the
    way to the C-th candidate, where smaller ids outside the candidates may
    belong in the top-N (the exact path decides them). Capture-safe.
    """
    logprob, rank = token_logprobs(logits, tokens, log_normaliser=log_normaliser, ids=ids)
    top = RowLogprobs(logprob, rank, cand_ids[:, :num_top], cand_raw[:, :num_top].to(torch.float64) - log_normaliser[:, None])
    if num_top == 0 or not has_tail:
        return top, torch.zeros_like(tokens, dtype=torch.bool)
    return top, cand_raw[:, num_top - 1] <= cand_raw[:, -1]


def processed_logprobs(
    log_z: torch.Tensor,
    zs: torch.Tensor,
    zs_ids: torch.Tensor,
    p: torch.Tensor,
    kept: torch.Tensor,
    tokens: torch.Tensor,
    num_top: int,
) -> RowLogprobs:
    """Logprobs of the processed, renormalised distribution over the kept tokens.

    Parameters: `log_z` [rows] f64; `zs`, `zs_ids`, `p` [rows, M] from
    `sorted_distribution`; `kept` [rows, M] bool from `kept_set`; `tokens`
    [rows] int64; `num_top` N <= M. Returns: `RowLogprobs`. Capture-safe.
    """
    log_mass = torch.log(torch.where(kept, p, torch.zeros_like(p)).cumsum(-1)[:, -1])  # [rows] f64
    lq = torch.where(kept, zs.to(torch.float64) - log_z[:, None] - log_mass[:, None], -math.inf)  # [rows, M]
    at_token = (zs_ids == tokens[:, None]) & kept
    # A filtered or suppressed token has logprob -inf: every kept token outranks it.
    token_z = torch.where(at_token, zs, -math.inf).amax(-1)
    return RowLogprobs(
        logprob=torch.where(at_token, lq, -math.inf).amax(-1),
        rank=(kept & (zs > token_z[:, None])).sum(-1) + 1,
        top_ids=torch.where(kept[:, :num_top], zs_ids[:, :num_top], -1),
        top_logprobs=lq[:, :num_top],
    )


def top_n_ids(logits: torch.Tensor, n: int) -> torch.Tensor:
    """The ids of the n largest logits per row, best first, ties to the smaller id.

    Parameters: `logits` [rows, V] f32; `n` in [1, V]. Returns: [rows, n]
    int64. Eager: rows where topk's tie order matters are re-picked with a
    data-dependent shape.
    """
    values, ids = torch.topk(logits, n, dim=1)  # tie order among equal values is unspecified
    cut = values[:, -1:]  # [rows, 1] the n-th largest value
    # Where a token equal to the cut was left out, topk chose among the tied
    # tokens arbitrarily: re-pick those rows, taking tied tokens by id.
    redo = torch.nonzero((logits == cut).sum(1) > (values == cut).sum(1)).squeeze(1)
    if len(redo):
        sub = logits[redo]  # [redo, V]
        above = sub > cut[redo]
        at_cut = sub == cut[redo]
        need = n - above.sum(1, keepdim=True)
        keep = above | (at_cut & (at_cut.cumsum(1) <= need))  # exactly n per row
        ids[redo] = keep.nonzero()[:, 1].view(-1, n)  # row-major, so ids ascend within a row
    ids = ids.sort(dim=1).values
    order = torch.sort(logits.gather(1, ids), dim=1, descending=True, stable=True).indices
    return ids.gather(1, order)
