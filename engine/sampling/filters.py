"""The kept set by sorting (docs/contract.md §2): min-p -> top-k -> top-p, defined on values.

The reference path (`engine.sampling.exact`) sorts each row by (z desc, id asc)
and applies the definitions in a walk; the sampler finds the same thresholds by radix select
(`engine.sampling.thresholds`) and the two agree bit for bit. Over processed
logits z with masses w (`thresholds.token_masses`, float64 integers):

- min-p keeps exp(z) >= min_p (the largest token has exp(0) = 1: this is
  p >= min_p * max p).
- top-k keeps every token whose z >= the k-th largest z (ties at the cut
  kept). Both cuts keep the tokens above a value: their order does not matter.
- top-p works on the set min-p and top-k kept (as vLLM does: min-p is a
  logits processor that runs before its top-k / top-p): walking tokens by
  decreasing z, z* is the z of the first token at which the running mass
  reaches top_p * (that set's mass); it keeps every token with z >= z*,
  ties included. The sums are exact, so the walk's order within a tie does
  not matter and the cut is the smallest set of whole z-levels that holds that
  much mass.

Every test is a threshold on z, so the kept set is a prefix of the sorted row.
`top_k_mask` is the same top-k cut over unsorted values (top-k-space
verification and prompt logprobs).
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
    p_z: torch.Tensor  # [rows] f32: the top-p cut z*


def kth_largest(sorted_desc: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k-th value of each row sorted in descending order.

    Parameters: `sorted_desc` [rows, M]; `k` [rows] int64, clamped to [1, M].
    Returns: [rows], the dtype of `sorted_desc`. Capture-safe.
    """
    return sorted_desc.gather(1, (k.clamp(min=1, max=sorted_desc.shape[1]) - 1)[:, None]).squeeze(1)


def kept_set(zs: torch.Tensor, weights: torch.Tensor, masses: torch.Tensor, rows: SamplingRows) -> KeptSet:
    """Apply min-p, top-k and top-p to sorted tokens.

    Parameters: `zs` [rows, M] f32 processed logits in (z desc, id asc) order,
    -inf (not valid) last; `weights` [rows, M] f32 their exp(z); `masses`
    [rows, M] f64 their `token_masses`; `rows` the rows' controls. M may be
    less than V (candidates): the caller decides whether they settle the
    row. Returns: `KeptSet`. Capture-safe.
    """
    alive = zs > -math.inf
    keep_m = alive & (~rows.m_on[:, None] | (weights >= rows.min_p[:, None]))
    kth_z = kth_largest(zs, rows.top_k)
    in_k = keep_m & (~rows.k_on[:, None] | (zs >= kth_z[:, None]))
    cum = torch.where(in_k, masses, 0.0).cumsum(-1)  # [rows, M] f64 integers: exact
    reached = cum >= (rows.top_p * cum[:, -1])[:, None]
    first = reached.to(torch.int8).argmax(-1, keepdim=True)  # the first index whose running mass reaches the level
    p_z = zs.gather(1, first).squeeze(1)
    keep_p = ~rows.p_on[:, None] | (zs >= p_z[:, None])
    return KeptSet(in_k & keep_p, kth_z, p_z)


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
