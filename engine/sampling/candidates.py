"""The fast path's candidates: the top C raw logits of a row and what they settle.

The fast path applies the kept-set definition (`engine.sampling.filters`) to
the top C (`candidate_cap`) raw logits per row with the full row's normaliser,
so nothing over the whole vocabulary is sorted or hashed. Every token outside
the candidates has a raw logit <= the C-th one, the boundary. When the kept
set may reach past the boundary (or a tie there makes the candidate set
ambiguous), the row's `needs_exact` flag sends it to `sample_exact`, whose
results equal what an unlimited C would give.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.draw import greedy_token, gumbel_race
from engine.sampling import filters
from engine.sampling.rows import SamplingRows
from engine.sampling.temperature import processed_logits


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


def top_candidates(raw: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`order_candidates` of the top `cap` of `raw` [rows, V] f32; capture-safe."""
    return order_candidates(*torch.topk(raw, cap), cap)


@dataclass
class CandidateDecision:
    """What the filters and draws decided over a row's candidates."""

    zs: torch.Tensor  # [rows, C] processed logits, (z desc, id asc), suppressed last
    zs_ids: torch.Tensor  # [rows, C]
    p: torch.Tensor  # [rows, C] f64 probabilities under the full-row normaliser
    kept: torch.Tensor  # [rows, C] bool
    filter_ambiguous: torch.Tensor  # [rows] bool: the top-k mass (top-p's renormaliser) is not known
    reaches_tail: torch.Tensor  # [rows] bool: the kept set may extend past the candidates
    raced: torch.Tensor  # [rows] int64: Gumbel race winner over the kept candidates
    greedy_token: torch.Tensor  # [rows] int64
    greedy_tie_in_tail: torch.Tensor  # [rows] bool

    def needs_exact(self, rows: SamplingRows, any_valid: torch.Tensor) -> torch.Tensor:
        """[rows] bool: the candidates cannot settle the row's draw."""
        filtered = ~rows.greedy & ~rows.plain
        return (
            (filtered & (self.reaches_tail | self.filter_ambiguous))
            | (rows.greedy & self.greedy_tie_in_tail)
            | ~any_valid
        )


def decide_on_candidates(
    cand_raw: torch.Tensor,
    cand_ids: torch.Tensor,
    boundary_raw: torch.Tensor,
    valid: torch.Tensor,
    shift: torch.Tensor,
    log_z: torch.Tensor,
    rows: SamplingRows,
    has_tail: bool,
    vocab: int,
) -> CandidateDecision:
    """Filters, race and greedy pick over ordered candidates.

    Parameters: `cand_raw`, `cand_ids` [rows, C] (f32, int64) in (raw desc, id
    asc) order; `boundary_raw` [rows] f32; `valid` [rows, C] bool and `shift`
    [rows] f32 from `suppression_and_shift`; `log_z` [rows] f64, the full
    row's log normaliser; `has_tail`: C < V, tokens exist past the boundary;
    `vocab` V. Returns: `CandidateDecision`. Shared by `sample` and the
    vocab-parallel candidate exchange, which only differ in where these
    inputs come from. Capture-safe.

    The boundary test runs the thresholds themselves, not "is a kept candidate
    at the boundary": the candidate that sits there may be a suppressed stop
    id, never kept, while an unsuppressed token of the same logit outside the
    candidates is kept.
    """
    cand_z = processed_logits(cand_raw, shift, rows.temperature, valid=valid)
    zs, zs_ids, p = filters.sorted_distribution(cand_z, cand_ids, log_z)
    ks = filters.kept_set(zs, p, rows)
    # The best a token outside the candidates can be.
    boundary_z = processed_logits(boundary_raw[:, None], shift, rows.temperature).squeeze(1)
    boundary_p = torch.exp(boundary_z.to(torch.float64) - log_z)
    # A -inf boundary (the token bitmask masked every token past the
    # candidates) leaves nothing outside them to keep: the row is settled.
    tail_masked = boundary_raw == -math.inf
    # The top-k cut is known when the k-th token is a candidate above the
    # boundary; an unknown one leaves top-p's renormaliser unknown.
    k_known = tail_masked | (
        (rows.top_k <= zs.shape[1]) & ((ks.kth_z > boundary_z) if has_tail else torch.ones_like(rows.k_on))
    )
    boundary_kept = (
        ~tail_masked
        & (~rows.k_on | (boundary_z >= ks.kth_z))
        & (~rows.p_on | (boundary_p >= ks.t_star))
        & (~rows.m_on | (boundary_p >= ks.min_p_level))
    )
    neg_inf = torch.full((), -math.inf, dtype=cand_raw.dtype, device=cand_raw.device)
    return CandidateDecision(
        zs=zs,
        zs_ids=zs_ids,
        p=p,
        kept=ks.kept,
        filter_ambiguous=rows.k_on & ~k_known & rows.p_on,
        reaches_tail=boundary_kept if has_tail else torch.zeros_like(rows.greedy),
        raced=gumbel_race(zs, zs_ids, ks.kept, rows.seed, rows.position, vocab),
        greedy_token=greedy_token(cand_raw, cand_ids, valid, vocab),
        greedy_tie_in_tail=has_tail & (torch.where(valid, cand_raw, neg_inf).amax(-1) <= boundary_raw),
    )
