"""The vocab-parallel head's candidates: the top C raw logits of a row and what they settle.

The candidate strategy (`engine.parallel.vocab_parallel`) decides a row from
its global top C raw logits, in (raw desc, id asc) order, by the sampler's own
definitions (`engine.sampling.thresholds`, `engine.sampling.filters`,
`engine.sampling.draw`): nothing over the whole vocabulary is sorted,
summed or exchanged for the draw. Every token outside the candidates has a
raw logit <= the C-th one, the boundary, so a z <= the boundary's z.

- The kept set: top-k keeps z >= the k-th largest z. When that cut is a valid
  candidate's z strictly above the boundary's, every token top-k keeps is a
  candidate, and min-p and top-p (its level is a fraction of the mass min-p
  and top-k keep) only remove tokens from that set: the filters over the
  candidates give the full row's kept set.
- The masses are the full row's (`token_masses` with the row's V), integers
  whose sums are exact, so top-p's walk over the candidates crosses its
  level where the full row's does.
- The draw: the kept candidates' weights exp(z) are laid out by token id in
  a zero row of V tokens, which is bit for bit the full row's kept weights,
  and drawn from by the same inverse CDF over the same fixed blocks.
- Greedy: the largest valid raw logit, ties to the smallest id, settled when
  that maximum lies strictly above the boundary.

A row the candidates cannot settle (the top-k cut not strictly above the
boundary, no valid candidate, a greedy maximum tied with the boundary) is
flagged; the caller redoes it over the full row with `sample_exact`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling import filters
from engine.sampling.draw import drawn_token, greedy_token, inverse_cdf_draw, plain_uniform
from engine.sampling.normaliser import block_sums
from engine.sampling.rows import SamplingRows
from engine.sampling.temperature import processed_logits
from engine.sampling.thresholds import token_masses


def order_candidates(values: torch.Tensor, ids: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first `cap` candidates in (value desc, id asc) order, and the boundary.

    Parameters: `values` [rows, M >= cap] f32 raw logits, `ids` [rows, M]
    int64 their token ids (a topk's output, or a merge of shards' topks).
    Returns: values and ids [rows, cap], and the boundary [rows] f32: every
    token not among them has a raw logit <= it. The id sort first, then a
    stable value sort, fixes the order of ties that topk (or a merge of
    shards) leaves unspecified. Capture-safe.
    """
    by_id = torch.argsort(ids, dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :cap]
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    return values, ids, values[:, cap - 1]


@dataclass
class CandidateDecision:
    """What a row's candidates decide, and whether it holds."""

    token: torch.Tensor  # [rows] int64: greedy pick, draw over the kept candidates, or forced token
    unsettled: torch.Tensor  # [rows] bool: the full row may decide otherwise (the exact path decides)


def decide_on_candidates(
    cand_raw: torch.Tensor,
    cand_ids: torch.Tensor,
    boundary_raw: torch.Tensor,
    valid: torch.Tensor,
    shift: torch.Tensor,
    rows: SamplingRows,
    vocab: int,
) -> CandidateDecision:
    """Kept set, draw and greedy pick over ordered candidates.

    Parameters: `cand_raw`, `cand_ids` [rows, C] (f32, int64) in (raw desc, id
    asc) order, C < V; `boundary_raw` [rows] f32, the C-th candidate's value;
    `valid` [rows, C] bool and `shift` [rows] f32 (M) from
    `suppression_and_shift`; `rows` the rows' controls; `vocab` V (it sets
    the masses' scale, and is the greedy answer of a row without a valid
    candidate). Returns: `CandidateDecision`. Capture-safe.

    A sampled row without top-k is never settled (its kept set may be the
    whole row): the candidate strategy only serves greedy rows and rows with
    0 < top_k <= its k_cap. A forced row is settled whatever its candidates
    (unless none is valid: the full row fails it for having no token left);
    its token may lie outside them, which the caller's logprobs must check.
    """
    cand_z = processed_logits(cand_raw, shift, rows.temperature, valid=valid)  # [rows, C] f32
    # (z desc, id asc), invalid (-inf) last: the filters' walk order. Equal raw
    # logits give equal z, but distinct ones may round to the same z.
    zs, zs_ids, _ = order_candidates(cand_z, cand_ids, cand_z.shape[1])
    ws = zs.exp()
    masses = token_masses(ws, vocab)  # the full row's scale: the sums are the full row's
    ks = filters.kept_set(zs, ws, masses, rows)
    # The best z a token outside the candidates can have (z is monotone in raw).
    boundary_z = processed_logits(boundary_raw[:, None], shift, rows.temperature).squeeze(1)
    # A k-th z strictly above the boundary's puts every token top-k keeps among
    # the candidates; at the boundary, equal z may continue past them. A -inf
    # k-th z (fewer than k valid candidates) is never above it.
    k_settled = rows.k_on & (ks.kth_z > boundary_z)

    # The draw: the full row's kept weights are these, by token id, and zeros.
    # Padding candidates (id V, never kept) land in a spare last column.
    spare = torch.zeros(cand_raw.shape[0], vocab + 1, dtype=ws.dtype, device=ws.device)
    weights = spare.scatter_(1, zs_ids.clamp(max=vocab), torch.where(ks.kept, ws, 0.0))[:, :vocab].contiguous()
    drawn = inverse_cdf_draw(weights, block_sums(weights), plain_uniform(rows))

    neg_inf = torch.full((), -math.inf, dtype=cand_raw.dtype, device=cand_raw.device)
    best = torch.where(valid, cand_raw, neg_inf).amax(-1)  # -inf: no valid candidate
    any_valid = best > -math.inf
    # A greedy maximum equal to the boundary may be shared by a smaller id
    # outside: a topk (a shard's) returns any of the tokens tied at its cut.
    greedy_settled = best > boundary_raw
    settled = (rows.forced >= 0) | torch.where(rows.greedy, greedy_settled, k_settled)
    return CandidateDecision(
        token=drawn_token(rows, greedy_token(cand_raw, cand_ids, valid, vocab), drawn),
        unsettled=~any_valid | ~settled,
    )
