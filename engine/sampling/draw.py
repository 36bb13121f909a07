"""The draw (docs/contract.md §2): greedy, inverse CDF over the kept weights.

- Greedy (T = 0): the largest raw logit among valid tokens, ties to the
  smallest id. Filters do not change it (the maximum is always kept).
- Every other row draws by inverse CDF with one uniform u per row (stream
  TARGET, counter `INVERSE_CDF_COUNTER`) over its kept tokens' masses in
  token-id order (`engine.sampling.thresholds`; 0 outside the kept set):
  the first token whose running mass exceeds u * total (float64). Masses are
  integers whose sums are exact, so any order of addition finds the same
  token; this one looks for the block of `BLOCK` tokens first (the block
  masses of `engine.sampling.thresholds.RowDistribution`), then the token
  inside it. Any path that lays the same weights out over the whole row (the
  Triton kernels) gets the same bits.
- A forced token, when set, replaces whatever the row drew.
Verification draws from explicit distributions by their integer masses with `inverse_cdf`;
its top-k-space bonus token races Gumbel noise keyed by token id (`gumbel_race`).
"""
from __future__ import annotations

import math

import torch

from engine.sampling.thresholds import BLOCK, token_masses
from engine.host.counter_hash import INVERSE_CDF_COUNTER
from engine.sampling.rng import TARGET, gumbel, uniform
from engine.sampling.rows import SamplingRows



def _min_id_of_max(score: torch.Tensor, ids: torch.Tensor, fill: int) -> torch.Tensor:
    """Per row, the smallest id among entries whose score equals the row maximum."""
    best = score.amax(-1, keepdim=True)
    return torch.where(score == best, ids, torch.full_like(ids, fill)).amin(-1)


def greedy_token(raw: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, vocab: int) -> torch.Tensor:
    """The largest valid raw logit's token, ties to the smallest id.

    Parameters: `raw` [rows, M] f32 logits; `ids` [rows, M] or [M] int64,
    their token ids; `valid` [rows, M] bool, False for suppressed stop ids;
    `vocab` V, the answer where no token is valid. Returns: [rows] int64.
    Capture-safe.
    """
    neg_inf = torch.full((), -math.inf, dtype=raw.dtype, device=raw.device)
    return _min_id_of_max(torch.where(valid, raw, neg_inf), ids, vocab)


def gumbel_race(
    score: torch.Tensor,
    ids: torch.Tensor,
    kept: torch.Tensor | None,
    seed: torch.Tensor,
    position: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """The winner of score + G(token id), ties to the smallest id.

    Parameters: `score` [rows, M] (processed logits z, or log p); `ids`
    [rows, M] or [M] int64 token ids; `kept` [rows, M] bool or None (every
    token races; a -inf score never wins); `seed` [rows] int64 (uint64 bits)
    and `position` [rows] int64, the noise's keys; `vocab` V, the answer
    where nothing races. Returns: [rows] int64. Capture-safe.
    """
    noise = gumbel(seed[:, None], position[:, None], TARGET, ids)  # [rows, M] f64
    race = score.to(torch.float64) + noise
    if kept is not None:
        race = torch.where(kept, race, -math.inf)
    return _min_id_of_max(race, ids, vocab)


def plain_uniform(rows: SamplingRows) -> torch.Tensor:
    """[rows] f64: the one uniform of each row's inverse-CDF draw: the staged one where the
    host hashed it (`engine.host.draw_uniforms`, the same bits), else hashed here. Capture-safe."""
    if rows.uniform is not None:
        return rows.uniform
    counter = torch.full((), INVERSE_CDF_COUNTER, device=rows.seed.device)
    return uniform(rows.seed, rows.position, TARGET, counter)


def inverse_cdf_draw(weights: torch.Tensor, block_mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF over the kept tokens' masses.

    Parameters: `weights` [rows, V] f32 nonnegative (the kept weights), 0
    for tokens never drawn; `block_mass` [rows, blocks] f64 their masses
    summed per block (`normaliser.block_sums` of these weights); `u` [rows]
    f64 in (0, 1). Returns: [rows] int64 token ids: the first token whose
    running mass exceeds u * total, always a token of positive mass where
    the total is positive. A row of total 0 (no token of positive weight:
    the sampler fails such a row) gets a token of the last block.
    Capture-safe.
    """
    rows, vocab = weights.shape
    block_cum = block_mass.cumsum(-1)  # [rows, blocks] f64 integers: exact
    blocks = block_cum.shape[1]
    target = u[:, None] * block_cum[:, -1:]  # [rows, 1] f64, below the total for u < 1
    block = torch.searchsorted(block_cum, target, right=True).clamp_(max=blocks - 1)  # [rows, 1]
    # The mass before the block: the exclusive running sum, exact as every partial sum is.
    before = (block_cum - block_mass).gather(1, block)  # [rows, 1] f64
    width = min(BLOCK, vocab)
    ids = torch.arange(width, device=weights.device) + block * BLOCK  # [rows, width]
    if vocab % width:  # the last block is partial: its columns past the vocabulary weigh 0
        in_vocab = ids < vocab
        ids = ids.clamp_(max=vocab - 1)
        inner = torch.where(in_vocab, weights.gather(1, ids), 0.0)
    else:
        inner = weights.gather(1, ids)
    # before + the running mass inside the block: integers, so the comparison with target is
    # exact. The block holds the first running mass above target (before <= target < before
    # + the block's mass), and a running sum passes target only at a token of positive mass;
    # the clamp only keeps a total-0 row's search inside the block.
    cum = token_masses(inner, vocab).cumsum_(-1).add_(before)  # [rows, width] f64
    pick = torch.searchsorted(cum, target, right=True).clamp_(max=width - 1)
    return ids.gather(1, pick).squeeze(1)


MASS_SCALE = 2.0**60  # a probability's mass in `probability_masses`: 2**60 for p = 1


def probability_masses(probs: torch.Tensor) -> torch.Tensor:
    """[rows, V] int64: floor(p * 2**60) per token, 0 for NaN.

    Parameters: `probs` [rows, V] f64, probabilities in [0, 1] whose row sums
    are at most about 1 (a distribution or a part of one, e.g. a residual), so
    a row's masses add up to less than 2**62: every sum of them is exact in
    int64, in any order. A probability below 2**-60 has mass 0. Capture-safe.
    """
    # The cast truncates, which is floor for p >= 0 (a power-of-two scale is exact).
    return torch.mul(probs, MASS_SCALE).nan_to_num_(0.0).to(torch.int64)


def inverse_cdf(masses: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from explicit integer masses by inverse CDF.

    Parameters: `masses` [rows, V] int64, nonnegative (`probability_masses`);
    `u` [rows] f64 in (0, 1). Returns: [rows] int64: the first token whose
    running mass exceeds floor(u * total) (total rounded to float64); a
    token of mass 0 is never picked; an all-zero row gives token 0. The
    running masses are exact integers, so a kernel that sums them in another
    order picks the same token. Capture-safe.
    """
    cum = masses.cumsum(-1)  # [rows, V] int64: exact
    total = cum[:, -1:]
    # floor(u * total) < total for u < 1 - 2**-33: the search stops at a token of positive mass.
    level = torch.mul(u[:, None], total.to(torch.float64)).floor_().to(torch.int64)
    pick = torch.searchsorted(cum, level, right=True).squeeze(1)
    return torch.where(total.squeeze(1) > 0, pick, 0)


def drawn_token(rows: SamplingRows, greedy: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """Each row's token: greedy rows take `greedy`, the others `drawn`; a
    forced token overrides both. All [rows] int64. Capture-safe."""
    token = torch.where(rows.greedy, greedy, drawn)
    return torch.where(rows.forced >= 0, rows.forced, token)
