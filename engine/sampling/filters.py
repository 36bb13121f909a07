"""The kept set (docs/contract.md §2): top-k -> top-p -> min-p, defined on values.

One definition for every path: the fast path applies it to a row's sorted
candidates, the exact path and verification's `target_probs` to the whole
sorted row. Over processed logits z sorted in (z desc, id asc) order with
probabilities p = exp(z - log Z) (the full row's normaliser):

- top-k keeps every token whose z >= the k-th largest z (ties at the cut kept).
- top-p works on the distribution renormalised after top-k (as engines do):
  walking tokens by decreasing z, t* is the probability of the first token at
  which the cumulative kept mass reaches top_p * (mass kept by top-k); it keeps
  every token with p >= t* (ties included), and everything when rounding
  keeps the sum from ever reaching that level.
- min-p keeps p >= min_p * max p; the ratio is the same before or after
  renormalisation, so it is taken on p directly.

Every test is a threshold on a value that falls with z, so the kept set is a
prefix of the sorted row. `top_k_mask` is the same top-k cut over unsorted
values (top-k-space verification and prompt logprobs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.rows import SamplingRows


@dataclass
class KeptSet:
    """The kept set over sorted tokens and the thresholds that define it."""

    kept: torch.Tensor  # [rows, M] bool
    kth_z: torch.Tensor  # [rows] f32: the top-k cut, z of the min(k, M)-th token
    t_star: torch.Tensor  # [rows] f64: the top-p threshold, 0 when top-p keeps everything
    min_p_level: torch.Tensor  # [rows] f64: min_p * max p


def kth_largest(sorted_desc: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k-th value of each row sorted in descending order.

    Parameters: `sorted_desc` [rows, M]; `k` [rows] int64, clamped to [1, M].
    Returns: [rows], the dtype of `sorted_desc`. Capture-safe.
    """
    return sorted_desc.gather(1, (k.clamp(min=1, max=sorted_desc.shape[1]) - 1)[:, None]).squeeze(1)


def sorted_distribution(
    z: torch.Tensor, ids: torch.Tensor | None, log_z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Processed logits sorted for the filters, with their probabilities.

    Parameters: `z` [rows, M] f32 processed logits (-inf where suppressed);
    `ids` [rows, M] int64 their token ids, or None when column = token id
    (a full row); `log_z` [rows] f64, the full row's log normaliser.
    Returns: `zs` [rows, M] f32 in (z desc, id asc) order (a stable sort of
    tokens given in id order, or in the candidates' (raw desc, id asc)
    order), `zs_ids` [rows, M] int64, `p` [rows, M] f64 = exp(zs - log Z).
    Capture-safe.
    """
    if ids is None:
        zs, zs_ids = torch.sort(z, dim=1, descending=True, stable=True)
    else:
        by_z = torch.sort(z, dim=1, descending=True, stable=True).indices
        zs, zs_ids = z.gather(1, by_z), ids.gather(1, by_z)
    return zs, zs_ids, torch.exp(zs.to(torch.float64) - log_z[:, None])


def kept_set(zs: torch.Tensor, p: torch.Tensor, rows: SamplingRows) -> KeptSet:
    """Apply top-k, top-p and min-p to sorted tokens.

    Parameters: `zs` [rows, M] f32 processed logits in (z desc, id asc) order,
    -inf (suppressed) last; `p` [rows, M] f64, their probabilities under the
    full row's normaliser; `rows` the rows' controls. M may be less than V
    (the fast path's candidates): the thresholds are then those of the
    candidates, and the caller decides whether they settle the row.
    Returns: `KeptSet`. Capture-safe.
    """
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    alive = zs > -math.inf
    kth_z = kth_largest(zs, rows.top_k)
    k_mask = ~rows.k_on[:, None] | (zs >= kth_z[:, None])
    k_p = torch.where(rows.k_on[:, None] & k_mask & alive, p, zero)
    # One running sum serves both: its last entry is the top-k mass (the
    # renormaliser of top-p), rounded exactly as the walk that crosses it.
    cum = torch.where(rows.k_on[:, None], k_p, torch.where(alive, p, zero)).cumsum(-1)  # [rows, M] f64
    k_mass = torch.where(rows.k_on, cum[:, -1], torch.ones_like(rows.top_p))
    reached = cum >= (rows.top_p * k_mass)[:, None]
    first = reached.to(torch.int8).argmax(-1, keepdim=True)  # first index that reaches top_p
    t_star = torch.where(reached.any(-1), p.gather(1, first).squeeze(1), zero)
    p_mask = ~rows.p_on[:, None] | (p >= t_star[:, None])
    min_p_level = rows.min_p * p[:, 0]
    m_mask = ~rows.m_on[:, None] | (p >= min_p_level[:, None])
    return KeptSet(alive & k_mask & p_mask & m_mask, kth_z, t_star, min_p_level)


def top_k_mask(values: torch.Tensor, k_rows: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """The top-k of each row of unsorted `values`, every value >= the k-th largest.

    Parameters: `values` [rows, V] (logits or probabilities); `k_rows` [rows]
    int64, k <= 0 keeps the row whole; `max_k` a static bound on every k
    (None: V, a full sort), k is clamped to it. Returns: [rows, V] bool.
    Capture-safe.
    """
    width = values.shape[1] if max_k is None else min(max_k, values.shape[1])
    kth = kth_largest(torch.topk(values, width, dim=1).values, k_rows)  # [rows]
    return (k_rows <= 0)[:, None] | (values >= kth[:, None])
