"""The kept set over whole rows with a fixed amount of work (docs/contract.md §2).

Every filter is a threshold on the processed logit z, so each row's kept set
is {z >= z_cut}. The sampler finds each cut by a radix select over the row's
order keys instead of sorting it:

- order key: the bits of the float32 -z as an int32 (0 for z = 0, growing as
  z falls; a valid z is <= 0). Equal z, equal key; a smaller key is a larger z.
- top-k: the smallest key t whose count {key <= t} reaches k.
- top-p: the smallest key t whose mass {key <= t, kept by top-k} reaches
  top_p times the top-k set's mass, with the masses of `token_masses`:
  integers held in float64, so every sum is exact in any order and the cut
  is the same on every path, device and batch layout.
- min-p: exp(z) >= min_p, elementwise (the largest token has exp(0) = 1).

`radix_threshold` settles a cut in `len(DIGITS)` passes over the row (a
histogram of one digit of the keys that share the digits settled so far),
whatever the row's values: a flat row keeping 100,000 tokens costs what a
peaked one does. The sort-based definition in `engine.sampling.filters` gives
the same sets (tested); it stays as the reference path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.normaliser import block_sums
from engine.sampling.rows import SamplingRows
from engine.sampling.suppression import suppressed_mask

KEY_BITS = 31  # order keys are nonnegative int32 values: the sign bit of -z is never set for z <= 0
DIGITS = (11, 10, 10)  # bits per radix pass, most significant first; they add up to KEY_BITS


def mass_bits(vocab: int) -> int:
    """S: a token's mass is floor(exp(z) * 2**S). V * 2**S <= 2**52, so any sum
    of a row's masses is an integer below 2**53, exact in float64."""
    return 52 - max(1, (vocab - 1).bit_length())


def token_masses(weights: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """floor(exp(z) * 2**S) per token, float64 integers: `weights` [rows, M] f32
    exp(z) in [0, 1] (0 for invalid tokens) of a whole row (M = V) or of some
    of its tokens (then `vocab` gives V, which sets S). A token with exp(z) <
    2**-S has mass 0 and is never drawn. Capture-safe."""
    scale = float(2 ** mass_bits(weights.shape[1] if vocab is None else vocab))
    # Scaling by a power of two and flooring are exact in float32, and so is the cast.
    return torch.mul(weights, scale).floor_().to(torch.float64)


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """[rows, V] int64 keys from processed logits z [rows, V] f32 (<= 0 or -inf):
    the int32 bits of 0 - z (+0 for both zeros), so smaller key = larger z.
    A NaN key may be negative; `radix_threshold` masks every digit into range."""
    return torch.sub(0.0, z).contiguous().view(torch.int32).to(torch.int64)


def radix_threshold(keys: torch.Tensor, weights: torch.Tensor, level: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest key t with sum(weights[live & keys <= t]) >= level.

    Parameters: `keys` [rows, V] int64 from `order_keys`; `weights` [rows, V]
    f64 nonnegative integers (masses, or ones for counts; broadcastable);
    `level` [rows] f64; `live` [rows, V] bool, the tokens that count.
    Returns: [rows] int64. A row whose live weight never reaches `level`
    gets 2**31 - 1 (every key). Fixed work: one scatter-add histogram per
    digit of DIGITS. Capture-safe.
    """
    rows = keys.shape[0]
    weights = weights.expand_as(keys)
    prefix = torch.zeros(rows, dtype=torch.int64, device=keys.device)  # the digits settled so far
    below = torch.zeros(rows, dtype=torch.float64, device=keys.device)  # live weight at keys under the prefix
    shift = KEY_BITS
    for bits in DIGITS:
        shift -= bits
        bins = 1 << bits
        digit = (keys >> shift) & (bins - 1)
        match = live if shift + bits == KEY_BITS else live & (((keys >> (shift + bits)) & ((1 << (KEY_BITS - shift - bits)) - 1)) == prefix[:, None])
        # Tokens outside the prefix land in an extra bin that is never read.
        index = torch.where(match, digit, bins)
        hist = torch.zeros(rows, bins + 1, dtype=torch.float64, device=keys.device).scatter_add_(1, index, weights)[:, :bins]
        cum = hist.cumsum(-1) + below[:, None]  # integers: exact
        d = (cum < level[:, None]).sum(-1).clamp_(max=bins - 1)  # the first digit whose prefix mass reaches level
        below = (cum.gather(1, d[:, None]) - hist.gather(1, d[:, None])).squeeze(1)
        prefix = (prefix << bits) | d
    return prefix


@dataclass
class RowDistribution:
    """A row's processed distribution over the whole vocabulary, by token id."""

    valid: torch.Tensor  # [rows, V] bool: not a suppressed stop id, not -inf (masked)
    shift: torch.Tensor  # [rows] f32: M, the largest valid score (0 when there is none)
    z: torch.Tensor  # [rows, V] f32 processed logits, -inf where not valid
    weights: torch.Tensor  # [rows, V] f32 exp(z)
    kept: torch.Tensor  # [rows, V] bool
    kept_mass: torch.Tensor  # [rows, V] f64: token_masses where kept, else 0
    block_mass: torch.Tensor  # [rows, blocks] f64: kept_mass summed over the normaliser's blocks
    total: torch.Tensor  # [rows] f64: the kept set's mass (> 0 whenever a token is valid)


def valid_scores(scores: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores` [rows, V] f32 with suppressed stop ids at -inf (a new tensor),
    and [rows, V] bool: the valid tokens (not suppressed, not -inf). Capture-safe."""
    suppressed = suppressed_mask(rows, scores.shape[1])
    masked = scores.masked_fill(suppressed, -math.inf)
    return masked, masked > -math.inf


def row_distribution(masked: torch.Tensor, valid: torch.Tensor, rows: SamplingRows, *, filters: bool = True) -> RowDistribution:
    """Temperature, filters and masses over whole rows.

    Parameters: `masked` [rows, V] f32 scores with invalid tokens at -inf and
    `valid` [rows, V] bool (`valid_scores`); `rows` their controls; `filters`
    False when no row has top-k, top-p or min-p (the kept set is then the
    valid tokens, and the passes are skipped). Returns: `RowDistribution`.
    Fixed work whatever the values. Capture-safe.
    """
    best = masked.amax(-1)
    shift = torch.where(best > -math.inf, best, torch.zeros_like(best))  # a row with no valid token fails
    z = torch.sub(masked, shift[:, None]).div_(rows.temperature[:, None])
    weights = z.exp()
    mass = token_masses(weights)
    kept = valid
    if filters:
        keys = order_keys(z)
        # top-k: the k-th largest z (every valid token when k is off or >= the valid count).
        t_k = radix_threshold(keys, torch.ones((), dtype=torch.float64, device=z.device), rows.top_k.to(torch.float64), valid)
        in_k = valid & (~rows.k_on[:, None] | (keys <= t_k[:, None]))
        k_mass = torch.where(in_k, mass, 0.0).sum(-1)  # integers: exact
        t_p = radix_threshold(keys, mass, rows.top_p * k_mass, in_k)
        keep_p = ~rows.p_on[:, None] | (keys <= t_p[:, None])
        # min_p came in as a float32: the float32 comparison is the float64 one.
        keep_m = ~rows.m_on[:, None] | (weights >= rows.min_p.to(torch.float32)[:, None])
        kept = in_k & keep_p & keep_m
    kept_mass = torch.where(kept, mass, 0.0)
    block_mass = block_sums(kept_mass)
    return RowDistribution(valid, shift, z, weights, kept, kept_mass, block_mass, block_mass.sum(-1))
