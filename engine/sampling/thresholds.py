"""The kept set over whole rows with a fixed amount of work (docs/contract.md §2).

Every filter is a threshold on the processed logit z, so each row's kept set
is {z >= z_cut}. The sampler finds each cut by a radix select over the row's
order keys instead of sorting it:

- order key: the bits of the float32 -z as an int32 (0 for z = 0, growing as
  z falls; a valid z is <= 0). Equal z, equal key; a smaller key is a larger z.
- min-p: exp(z) >= min_p, elementwise (the largest token has exp(0) = 1);
  first, as vLLM applies it (a logits processor before top-k and top-p).
- top-k: the smallest key t whose count {key <= t} reaches k. Min-p and
  top-k both keep the tokens above a cut, so their order does not matter.
- top-p: the smallest key t whose mass {key <= t, kept by min-p and top-k}
  reaches top_p times the mass that min-p and top-k kept, with the masses
  of `token_masses`: integers held in float64, so every sum is exact in any
  order and the cut is the same on every path, device and batch layout.

The draw then weighs each kept token by its mass (`engine.sampling.draw`).

`radix_threshold` settles a cut in `len(radix_digits(V))` passes over the row (a
histogram of one digit of the keys that share the digits settled so far),
whatever the row's values: a flat row keeping 100,000 tokens costs what a
peaked one does. The sort-based definition in `engine.sampling.filters` gives
the same sets (tested); it stays as the reference path.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.sampling.filters import kth_largest
from engine.sampling.normaliser import block_sums, mass_bits, token_masses
from engine.sampling.rows import SamplingRows
from engine.sampling.temperature import processed_logits

KEY_BITS = 31  # order keys are nonnegative int32 values: the sign bit of -z is never set for z <= 0
KEY_MAX = (1 << KEY_BITS) - 1  # above every key: "keep every token"
MAX_DIGIT_BITS = 11  # a pass's histogram: at most 2048 bins per row (16 KiB of float64, in L1)


@functools.cache  # a per-step question with few answers: hits cost no Python call
def radix_digits(vocab: int) -> tuple[int, ...]:
    """Bits per radix pass, most significant first, adding up to KEY_BITS: as
    few passes as bins of about V per row allow (V = 49152: 11, 10, 10; V =
    64: six passes of 5-6 bits), so a histogram is never much larger than
    the row it counts."""
    width = max(4, min(MAX_DIGIT_BITS, (vocab - 1).bit_length()))
    passes = -(-KEY_BITS // width)
    return tuple(KEY_BITS // passes + (1 if i < KEY_BITS % passes else 0) for i in range(passes))


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """[rows, V] int32 keys from processed logits z [rows, V] f32 (<= 0 or -inf):
    the bits of 0 - z (+0 for both zeros), so smaller key = larger z; -inf
    gets the key of +inf, above every finite z's. A NaN (a failed row) is
    clamped into range."""
    return torch.sub(0.0, z).contiguous().view(torch.int32).clamp_(min=0)


def radix_threshold(keys: torch.Tensor, weights: torch.Tensor | None, level: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest key t with sum(weights[keys <= t]) >= level.

    Parameters: `keys` [rows, V] int32 from `order_keys`; `weights` [rows, V]
    f64 nonnegative integers (masses), or None to count tokens; `level` [rows]
    f64. Returns: [rows] int32; `KEY_MAX` for a row whose weight never
    reaches `level`. Fixed work: one histogram of one digit per pass of
    `radix_digits(V)`. Each pass clamps the keys into the window its predecessors
    settled, so lower keys fall into the first bin and higher ones into the
    last: the running sum over the bins is then the weight at or below each
    bin's top key, with no mask. Exact: counts and masses are integers that
    float32 / float64 hold exactly in any order of addition. Capture-safe.
    """
    rows, vocab = keys.shape
    device = keys.device
    dtype = torch.float32 if weights is None else torch.float64  # counts stay below 2**24
    source = torch.ones((), dtype=dtype, device=device).expand(rows * vocab) if weights is None else weights.reshape(-1)
    lo = torch.zeros(rows, 1, dtype=torch.int32, device=device)  # the smallest key of the settled window
    shift = KEY_BITS
    for bits in radix_digits(vocab):
        shift -= bits
        bins = 1 << bits
        top = shift + bits == KEY_BITS
        window = keys if top else torch.clamp(keys, lo, lo + ((1 << (shift + bits)) - 1))
        digit = (window >> shift) if top else ((window - lo) >> shift)  # [rows, V] in [0, bins)
        flat = digit.add_(torch.arange(0, rows * bins, bins, dtype=torch.int32, device=device)[:, None])
        hist = torch.zeros(rows * bins, dtype=dtype, device=device).index_add_(0, flat.view(-1), source)
        below = hist.view(rows, bins).cumsum(-1)  # weight at or below the top key of each bin
        d = (below < level[:, None]).sum(-1, keepdim=True).clamp_(max=bins - 1)  # the first bin that reaches level
        lo = lo + (d.to(torch.int32) << shift)
    return lo.squeeze(1)


@dataclass
class RowDistribution:
    """A row's processed distribution over the whole vocabulary, by token id."""

    shift: torch.Tensor  # [rows] f32: M, the largest valid score (0 when there is none)
    z: torch.Tensor  # [rows, V] f32 processed logits, -inf where not valid
    kept: torch.Tensor | None  # [rows, V] bool; None: not computed (no filters, or only the weights asked for)
    weights: torch.Tensor  # [rows, V] f32: exp(z) of the kept tokens, 0 elsewhere
    block_mass: torch.Tensor  # [rows, blocks] f64: the kept tokens' masses summed per block (`block_sums`)

    @property
    def mass_total(self) -> torch.Tensor:
        """[rows] f64: the kept set's mass, an exact integer (what the draw and processed logprobs divide by)."""
        return self.block_mass.sum(-1)

    @property
    def total(self) -> torch.Tensor:
        """[rows] f64: the kept set's mass times 2**-S, in the weights' units."""
        return self.mass_total * 2.0 ** -mass_bits(self.z.shape[1])

    def probabilities(self) -> torch.Tensor:
        """[rows, V] f64: each kept token's mass over the kept total, the distribution
        the inverse-CDF draw follows (a row with no valid token: all zeros)."""
        total = self.mass_total[:, None]
        return token_masses(self.weights) / torch.where(total > 0, total, torch.ones_like(total))


def top_k_keys(masked: torch.Tensor, shift: torch.Tensor, rows: SamplingRows, width: int) -> torch.Tensor:
    """The order key of each row's k-th largest z, from a topk of `width`
    scores (every row's k must be <= width, or top-k off). Parameters:
    `masked` [rows, V] f32 scores (invalid -inf), `shift` [rows] f32.
    Returns: [rows] int32. Capture-safe."""
    kth = kth_largest(torch.topk(masked, min(width, masked.shape[1]), dim=1).values, rows.top_k)
    # z is a monotone function of the score: the k-th largest z is the k-th score's z.
    return order_keys(processed_logits(kth[:, None], shift, rows.temperature)).squeeze(1)


def processed_scores(masked: torch.Tensor, best: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The shift M [rows] f32 (the largest valid score, 0 for a row with none:
    it fails) and z = (masked - M) / T [rows, V] f32 (docs/contract.md §2,
    temperature), from `masked` scores and their row maximum `best`. Capture-safe."""
    shift = torch.where(best > -math.inf, best, 0.0)
    return shift, processed_logits(masked, shift, rows.temperature)


def _top_k_cut(keys: torch.Tensor, masked: torch.Tensor, shift: torch.Tensor, rows: SamplingRows, top_k: str,
               top_k_width: int) -> torch.Tensor:
    """[rows, 1] int32: the largest order key top-k keeps (`KEY_MAX` where it is off), by
    the counting radix ("radix") or a topk of `top_k_width` scores ("topk")."""
    if top_k == "radix":
        t_k = radix_threshold(keys, None, rows.top_k.to(torch.float64))
    else:
        t_k = top_k_keys(masked, shift, rows, top_k_width)
    return torch.where(rows.k_on, t_k, KEY_MAX)[:, None]


def _top_p_cut(keys: torch.Tensor, mass: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[rows, 1] int32: the largest order key top-p keeps (`KEY_MAX` where it is off), over
    `mass` [rows, V], the masses of the tokens min-p and top-k kept (0 elsewhere)."""
    t_p = radix_threshold(keys, mass, rows.top_p * mass.sum(-1))
    return torch.where(rows.p_on, t_p, KEY_MAX)[:, None]


def _min_p_floor(rows: SamplingRows) -> torch.Tensor:
    """[rows, 1] f32: the least weight exp(z) min-p keeps; -1 where it is off (keeps all).
    min_p came in as a float32: the float32 comparison is the float64 one."""
    return torch.where(rows.m_on, rows.min_p, -1.0).to(torch.float32)[:, None]


def _filtered_weights(masked: torch.Tensor, shift: torch.Tensor, z: torch.Tensor, weights: torch.Tensor,
                      rows: SamplingRows, top_k: str, top_k_width: int, top_p: bool) -> RowDistribution:
    """`row_distribution`'s weights without its kept mask. An invalid token's weight is
    exp(-inf) = 0 already, so each cut only zeroes the weights past it: min-p's, which
    keeps a weight >= min_p (a NaN, on a failed row, is zeroed), then top-k's, then
    top-p's over the masses of what they left (the same masses as the masked ones)."""
    weights = torch.where(weights >= _min_p_floor(rows), weights, 0.0)
    keys = order_keys(z) if top_k != "none" or top_p else None
    if top_k != "none":
        weights.masked_fill_(keys > _top_k_cut(keys, masked, shift, rows, top_k, top_k_width), 0.0)
    if top_p:
        weights.masked_fill_(keys > _top_p_cut(keys, token_masses(weights), rows), 0.0)
    return RowDistribution(shift, z, None, weights, block_sums(weights))


def row_distribution(masked: torch.Tensor, best: torch.Tensor, rows: SamplingRows, *, filters: bool = True,
                     top_k: str = "radix", top_k_width: int = 0, top_p: bool = True,
                     kept_set: bool = True) -> RowDistribution:
    """Temperature -> min-p -> top-k -> top-p, and the draw's weights, over whole rows.

    Parameters: `masked` [rows, V] f32 scores with invalid tokens at -inf
    (`suppressed_scores`), `best` [rows] f32 their row maximum; `rows` their
    controls; `filters` False when no row has top-k, top-p or min-p (the kept
    set is then every valid token, and the passes are skipped); `top_k`:
    "radix" finds any row's top-k cut by a counting radix select, "topk" by
    a topk of `top_k_width` scores (every k must be at most that), "none"
    skips top-k (no row has it); `top_p` False skips top-p (no row has it);
    `kept_set` False when only the draw's weights are needed (no processed
    logprobs): the same weights, zeroed cut by cut, without the kept mask
    (`kept` None), two to four full-row passes fewer.
    Returns: `RowDistribution`. Fixed work whatever the values. Capture-safe.
    """
    shift, z = processed_scores(masked, best, rows)
    weights = z.exp()
    kept = masked > -math.inf if kept_set else None  # without filters: every valid token
    if filters and not kept_set:
        return _filtered_weights(masked, shift, z, weights, rows, top_k, top_k_width, top_p)
    if filters:
        kept &= weights >= _min_p_floor(rows)
        keys = order_keys(z) if top_k != "none" or top_p else None
        if top_k != "none":
            kept &= keys <= _top_k_cut(keys, masked, shift, rows, top_k, top_k_width)
        if top_p:
            mass = token_masses(weights.masked_fill(~kept, 0.0))  # the masses min-p and top-k kept, 0 elsewhere
            kept &= keys <= _top_p_cut(keys, mass, rows)
        weights.masked_fill_(~kept, 0.0)  # a fresh tensor; a bool-to-float multiply costs 4x more on CPU
    return RowDistribution(shift, z, kept, weights, block_sums(weights))
