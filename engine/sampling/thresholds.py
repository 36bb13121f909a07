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

The same module holds what the cuts stand on:

- processed logits (temperature): z = (raw - M) / T, with M the largest raw logit that
  is not suppressed (`engine.sampling.rows`) and T the row's temperature (1 for
  greedy rows); shifting by M before dividing is part of the definition (dividing first
  rounds differently in float32). `processed_logits`.
- each row's largest value and its first index (`first_max`), in two short passes: the
  row cut into blocks, one `amax` pass over them, then the first block holding the
  maximum searched (`torch.max(dim)` tracks an index beside every compared value and
  runs 13 to 30 times slower on a CPU). The result is `torch.max(dim)`'s, NaN the largest.
- masses and the normaliser: every sum over a row, exact.
  A token's weight exp(z) (a float32 in [0, 1]) enters every sum as its
  *mass*, the integer floor(exp(z) * 2**S) with S = 52 - bit_length(V - 1)
  (`mass_bits`): V masses add up to less than 2**53, so any sum of a row's
  masses, partial or whole, is an exact integer in float64 whatever the order
  of the additions. That one definition serves every consumer:

  - top-p's level and its cut (above);
  - the inverse-CDF draw: the first token whose running kept mass exceeds u
    times the kept total (`engine.sampling.draw`);
  - the normaliser Z of processed and raw logprobs: the masses' total times
    2**-S (`block_log_normaliser`, `raw_log_normaliser`).

  So a CPU sum, a CUDA reduction and a Triton kernel's tree of partial sums all
  give the same bits, and no result depends on
  how many rows share the call. The price is resolution: a weight below 2**-S
  (exp(z) < 2.9e-11 at V = 129280) has mass 0 and is never drawn, and Z falls
  short of the float sum of the weights by less than V * 2**-S (< 4e-6 at
  V = 129280, < 7e-7 at V = 49152).

  Masses are summed over fixed blocks of `BLOCK` tokens: the draw finds the
  block first and then the token inside it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.sampling.filters import kth_largest
from engine.sampling.rows import SamplingRows

BLOCK = 1024  # tokens per block of the block masses and the inverse-CDF draw
# exp(z) for z below -87.34 is a subnormal float32, which x86 cores make by a microcode
# assist: a row of LM-like logits (z down to -94) took 4.0 ms of `exp` at [16, 128256]
# against 1.7 ms with none (2 Zen 4 cores, 1 thread). exp(-87) is normal and, like every
# weight below 2**-S (S <= 51), has mass 0, so the draw cannot tell the two apart.
SUBNORMAL_Z = -87.0
TEMPORARY_BYTES = 1 << 20  # the largest masses temporary `block_sums` makes (see there)
CANDIDATE_BLOCK = 64  # tokens per block of min-p's candidate search on a CPU (`_min_p_candidates`)


@functools.cache  # a per-step question with few answers: hits cost no Python call
def mass_bits(vocab: int) -> int:
    """S: a token's mass is floor(exp(z) * 2**S). V * 2**S <= 2**52, so any sum
    of a row's masses is an integer below 2**53, exact in float64."""
    return 52 - max(1, (vocab - 1).bit_length())


def token_masses(weights: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """floor(exp(z) * 2**S) per token, float64 integers: `weights` [rows, M] f32
    exp(z) in [0, 1] (0 for tokens outside the set being weighed) of a whole
    row (M = V) or of some of its tokens (then `vocab` gives V, which sets
    S). Capture-safe."""
    scale = float(2 ** mass_bits(weights.shape[1] if vocab is None else vocab))
    # The cast, the scaling by a power of two and the floor are exact: the float32 floor's
    # integers. One new tensor, scaled and floored in place (each [rows, V] temporary costs
    # page faults on a CPU).
    return weights.to(torch.float64, copy=True).mul_(scale).floor_()


def block_sums(weights: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """[rows, ceil(M / BLOCK)] f64: the masses of `weights` [rows, M] f32
    (nonnegative exp(z), 0 outside the set being weighed) summed over each
    block of BLOCK tokens (the last block may be partial); exact integers.
    `vocab` V sets the masses' scale when M < V (a vocab-parallel shard of
    whole blocks). Capture-safe."""
    rows, width = weights.shape
    scale = float(2 ** mass_bits(width if vocab is None else vocab))
    # The masses are held in float32 here: a float32 times a power of two is exact (the
    # same significand), and so is its floor, so they are `token_masses`' integers; the
    # sums are taken in float64 (`dtype=`), where they are exact in any order. Whole blocks
    # at a time, at most TEMPORARY_BYTES of masses each: on a CPU a [rows, V] temporary
    # costs more in page faults than the arithmetic (4x the sampler's time at [64, 49152]
    # in float64). Float32 masses, half the bytes of float64 ones, took 15 to 25% less time
    # at [16 to 64, 49152] and [16, 128256] (2 Zen 4 cores, thread CPU time, load 10).
    step = _span(rows)
    parts = []
    for start in range(0, width, step):
        parts += _block_totals(weights[:, start : start + step], scale)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _span(rows: int) -> int:
    """Tokens per span of a [rows, V] pass made a span at a time: whole blocks, at most
    TEMPORARY_BYTES of float32 per temporary."""
    return max(1, TEMPORARY_BYTES // (4 * BLOCK * max(rows, 1))) * BLOCK


def _masses(weights: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`token_masses`' integers floor(weights * scale), held in float32 (in `out` when given):
    a float32 times a power of two keeps its significand, and its floor is exact."""
    return torch.mul(weights, scale, out=out).floor_()


def _block_totals(weights: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The masses floor(weights * scale) of `weights` [rows, M] f32 (M a whole number of
    blocks, but for a last partial one), held in float32 (in `out` when given), summed in
    float64 over each block: [rows, whole blocks] and, where there is a partial block,
    [rows, 1]. Exact in any order."""
    masses = _masses(weights, scale, out)
    rows, width = masses.shape
    full = width // BLOCK
    totals = [masses[:, : full * BLOCK].view(rows, full, BLOCK).sum(-1, dtype=torch.float64)] if full else []
    if width % BLOCK:
        totals.append(masses[:, full * BLOCK :].sum(-1, keepdim=True, dtype=torch.float64))
    return totals


def log_block_total(block_mass: torch.Tensor, vocab: int) -> torch.Tensor:
    """log Z from block masses [rows, blocks] f64 (a row's, or gathered from
    vocab-parallel shards) of a `vocab`-wide row: [rows] f64, the log of
    their total times 2**-S (an exact scaling). Capture-safe."""
    return torch.log(block_mass.sum(-1) * 2.0 ** -mass_bits(vocab))


def block_log_normaliser(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block masses and the log of their total.

    Parameters: `weights` [rows, V] f32, nonnegative (exp of processed or raw
    logits). Returns: `block_mass` [rows, ceil(V / BLOCK)] f64 (`block_sums`)
    and `log_z` [rows] f64 (`log_block_total`). Capture-safe.
    """
    block_mass = block_sums(weights)
    return block_mass, log_block_total(block_mass, weights.shape[1])


def raw_log_normaliser(raw: torch.Tensor, raw_max: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """log-sum-exp of raw logits by the same masses as every other normaliser.

    Parameters: `raw` [rows, V] f32 logits; `raw_max` [rows] f32, their row
    maximum; `kept` [rows, V] bool or None, the tokens to sum over (None:
    all; top-k-space prompt logprobs restrict the sum, and the row maximum
    must then be a kept token). Returns: [rows] f64, raw_max + log Z.
    Capture-safe.
    """
    weights = torch.sub(raw, raw_max[:, None]).exp_()  # [rows, V] f32
    if kept is not None:
        weights.masked_fill_(~kept, 0.0)
    _, log_z = block_log_normaliser(weights)
    return raw_max.to(torch.float64) + log_z


def processed_logits(
    raw: torch.Tensor,
    shift: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    valid: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """z = (raw - shift) / temperature, -inf where a token is not valid.

    Parameters: `raw` [rows, M] f32 logits (a full row or candidates);
    `shift` [rows] f32, the row's M; `temperature` [rows] f32, or None where
    every row's is 1 (x / 1 is x: no division); `valid`
    [rows, M] bool or None: False for suppressed stop ids; `out` [rows, M]
    f32 or None, where to write. Returns: [rows, M] f32 z. Capture-safe.
    """
    z = torch.sub(raw, shift[:, None], out=out)
    if temperature is not None:
        z.div_(temperature[:, None])
    if valid is not None:
        z.masked_fill_(~valid, -math.inf)
    return z


@functools.cache
def block_width(vocab: int) -> int | None:
    """The block the two-pass search cuts a `vocab`-wide row into: the divisor of vocab
    closest to its square root (so both passes over small tensors stay short), at
    least 32 wide; None when vocab has no such divisor below itself (then one pass)."""
    root = math.sqrt(vocab)
    divisors = [w for w in range(32, min(vocab, 1 << 16)) if vocab % w == 0]
    return min(divisors, key=lambda w: abs(math.log(w / root)), default=None)


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [rows, V] float -> (values [rows], indices [rows] int64), as `x.max(-1)` gives."""
    rows, vocab = x.shape
    width = block_width(vocab)
    if width is None or not x.is_contiguous():
        values, indices = x.max(-1)
        return values, indices
    blocks = x.view(rows, vocab // width, width)
    values, block = blocks.amax(-1).max(-1)  # the first block that holds the row's maximum
    inside = blocks.gather(1, block.view(rows, 1, 1).expand(rows, 1, width)).view(rows, width).max(-1).indices
    return values, inside.add_(block, alpha=width)


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
    z: torch.Tensor | None  # [rows, V] f32 processed logits, -inf where not valid; None: only the draw reads it
    kept: torch.Tensor | None  # [rows, V] bool; None: not computed (no filters, or only the weights asked for)
    # [rows, V] f32: exp(z) of the kept tokens, 0 elsewhere; without a kept set (`kept` None)
    # a weight of mass 0 below exp(SUBNORMAL_Z) may read as exp(SUBNORMAL_Z) instead.
    weights: torch.Tensor
    block_mass: torch.Tensor  # [rows, blocks] f64: the kept tokens' masses summed per block (`block_sums`)

    @property
    def mass_total(self) -> torch.Tensor:
        """[rows] f64: the kept set's mass, an exact integer (what the draw and processed logprobs divide by)."""
        return self.block_mass.sum(-1)

    @property
    def total(self) -> torch.Tensor:
        """[rows] f64: the kept set's mass times 2**-S, in the weights' units."""
        return self.mass_total * 2.0 ** -mass_bits(self.weights.shape[1])

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
    shift = row_shift(best)
    return shift, processed_logits(masked, shift, rows.temperature)


def row_shift(best: torch.Tensor) -> torch.Tensor:
    """M [rows] f32: the row maximum `best` of the valid scores, 0 for a row with none
    (-inf, or NaN: the row fails); one op where a comparison and a `where` are two."""
    return torch.nan_to_num(best, nan=0.0, neginf=0.0, posinf=math.inf)


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
    min_p comes in as a float32 (`RowParams.min_ps`), compared as it is."""
    return torch.where(rows.m_on, rows.min_p, -1.0)[:, None]


def _filtered_weights(masked: torch.Tensor, shift: torch.Tensor, z: torch.Tensor, weights: torch.Tensor,
                      rows: SamplingRows, top_k: str, top_k_width: int, top_p: bool) -> RowDistribution:
    """`row_distribution`'s weights without its kept mask. An invalid token's weight is
    exp(-inf) = 0 already, so each cut only zeroes the weights past it: min-p's, which
    keeps a weight >= min_p, then top-k's, then top-p's over the masses of what they left
    (the same masses as the masked ones). Each cut multiplies the weights by its verdict
    as a float32 1 or 0 (`_times_verdict`): the same weights, NaN on a failed row
    included (its outputs are the placeholder's)."""
    weights = _times_verdict(torch.ge, weights, _min_p_floor(rows), weights)
    keys = order_keys(z) if top_k != "none" or top_p else None
    if top_k != "none":
        weights = _times_verdict(torch.le, keys, _top_k_cut(keys, masked, shift, rows, top_k, top_k_width), weights)
    if top_p:
        weights = _times_verdict(torch.le, keys, _top_p_cut(keys, token_masses(weights), rows), weights)
    return RowDistribution(shift, z, None, weights, block_sums(weights))


def _times_verdict(compare, left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`weights` [rows, V] f32 where `compare(left, right)` holds, 0 elsewhere: a new
    tensor. The comparison writes float32 1 and 0, not bools, and a multiply applies it: on
    a CPU a comparison into bools and a `where` over them took 6x as long (2.3 ms against
    0.4 at [16, 128256], 2 Zen 4 cores, 1 thread)."""
    return compare(left, right, out=torch.empty_like(weights)).mul_(weights)


def draw_weights(masked: torch.Tensor, shift: torch.Tensor, temperature: torch.Tensor | None,
                 floor: torch.Tensor | None) -> RowDistribution:
    """The draw's weights and block masses where min-p is the only cut (or there is none):
    what `processed_logits`, exp (of z raised to SUBNORMAL_Z), min-p's verdict and
    `block_sums` give, the same bits, computed one span of whole blocks at a time on a CPU
    (TEMPORARY_BYTES of each temporary), so every step of the chain reads what the one
    before left in cache: at [64, 128256], 2 Zen 4 cores, 1 thread, 18.3 ms against 23.5
    for the whole-row passes; at [16, 128256] 4.8 against 5.3.

    Parameters: `masked` [rows, V] f32 scores (invalid -inf); `shift` [rows] f32, M;
    `temperature` [rows] f32 or None (every row's 1); `floor` [rows, 1] f32 min-p's least weight (0: off), or
    None (no row has min-p). Returns: `RowDistribution` without z and kept. Capture-safe, but
    for min-p on a CPU (`_min_p_candidates`), where nothing is captured.
    """
    rows, vocab = masked.shape
    if floor is not None and masked.device.type == "cpu" and vocab % CANDIDATE_BLOCK == 0:
        return _min_p_candidates(masked, shift, temperature, floor)
    scale = float(2 ** mass_bits(vocab))
    step = vocab if masked.device.type != "cpu" else _span(rows)
    weights = torch.empty_like(masked)  # [rows, V] f32
    scratch = torch.empty((rows, min(step, vocab)), dtype=torch.float32, device=masked.device)
    parts = []
    for start in range(0, vocab, step):
        w = processed_logits(masked[:, start : start + step], shift, temperature, out=weights[:, start : start + step])
        w.clamp_(min=SUBNORMAL_Z).exp_()
        spare = scratch[:, : w.shape[1]]
        if floor is not None:
            w.mul_(torch.ge(w, floor, out=spare))  # the verdict as float32 1 and 0 (`_times_verdict`)
        parts += _block_totals(w, scale, out=spare)
    block_mass = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return RowDistribution(shift, None, None, weights, block_mass)


def _min_p_candidates(masked: torch.Tensor, shift: torch.Tensor, temperature: torch.Tensor | None,
                      floor: torch.Tensor) -> RowDistribution:
    """`draw_weights` with min-p on a CPU, the same token and block masses bit for bit:
    exp, the verdict and the masses only over the blocks of CANDIDATE_BLOCK tokens whose
    largest z may pass (z >= log(floor) - 1e-3, far below the threshold for exp's and log's
    rounding); every other weight is 0, as the verdict makes it (or of mass 0 there: below a
    subnormal floor the spans keep exp(SUBNORMAL_Z)). A min-p row keeps a
    few blocks of its vocabulary, so most of exp and the masses is skipped: at [1, 128256]
    (2 Zen 4 cores, 1 thread) 116 us against 243 for the spans, at [16, 49152] 0.31 ms
    against 1.39. torch's exp gives the same bits on its vector and scalar paths (16M
    values compared), so computing it over fewer tokens changes none. The candidates are
    found by `nonzero`, a shape that depends on the values: a CPU path, never captured
    (on CUDA the kernels, or the spans, run). A NaN block is no candidate: its weights are
    0 here, NaN in the spans, and its row fails either way."""
    rows, vocab = masked.shape
    width = CANDIDATE_BLOCK
    z = processed_logits(masked, shift, temperature).reshape(rows, vocab // width, width)  # a view of dense rows
    lowest = torch.log(floor.clamp(min=0.0)).sub_(1e-3)  # [rows, 1]; -inf where min-p is off: every block
    row, block = (z.amax(-1) >= lowest).nonzero().unbind(1)  # [K] each
    w = z[row, block].clamp_(min=SUBNORMAL_Z).exp_()  # [K, width]
    w.mul_(torch.ge(w, floor[row], out=torch.empty_like(w)))  # the verdict as float32 1 and 0
    weights = torch.zeros((rows, vocab), dtype=torch.float32)
    weights.view(rows, -1, width)[row, block] = w
    blocks = -(-vocab // BLOCK)
    masses = _masses(w, float(2 ** mass_bits(vocab))).sum(-1, dtype=torch.float64)  # [K]
    block_mass = torch.zeros(rows * blocks, dtype=torch.float64).index_add_(0, row * blocks + block // (BLOCK // width),
                                                                             masses)  # integer sums: exact in any order
    return RowDistribution(shift, None, None, weights, block_mass.view(rows, blocks))


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
    if not kept_set and (not filters or (top_k == "none" and not top_p)):
        # Min-p's floor as it comes: a row without min-p has min_p 0, which keeps every weight (a
        # greedy row's weights are never read), so no `m_on` is needed.
        return draw_weights(masked, row_shift(best), rows.temperature, rows.min_p[:, None] if filters else None)
    shift, z = processed_scores(masked, best, rows)
    # The draw reads weights only through their masses, and a weight below 2**-S has mass 0
    # (`SUBNORMAL_Z`): with no kept set to decide, z below it is raised to it first.
    weights = z.exp() if kept_set else torch.clamp(z, min=SUBNORMAL_Z).exp_()
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
