"""The draw (docs/contract.md §2) and the counter hash that keys its randomness.

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

Every uniform is a pure hash of (request seed, absolute position of the produced token,
stream, counter): no generator state, so a request's draws do not depend on its batch, its
bucket or other rows, and replaying a step replays its randomness. `hash32` is written once
for Python ints, numpy arrays and torch tensors (the host hashes the plain draw's uniforms
while it stages a step, `staged_draw_uniforms`); the Triton kernels' copy
(`engine/sampling/kernels/hash_rng.py`) imports its constants from here, and
`tests/test_rng.py` holds the two to the same bits.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from engine.sampling.thresholds import BLOCK, token_masses
from engine.sampling.rows import SamplingRows

# The hash works on 32-bit words held in 64-bit lanes. Every multiplier is odd and below
# 2**31, so a word times one stays below 2**63 (no int64 overflow): the first is the
# "lowbias32" integer hash's, the second MurmurHash2's. ROUND is added after each absorbed
# word so that an all-zero input does not stay at the fixed point 0.
MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x5BD1E995
ROUND = 0x9E3779B9
INV_2_32 = 2.0**-32

# Streams: which draw of a row a uniform belongs to.
TARGET = 0  # the row's own draw (sampling, strict verification)
ACCEPT = 1  # acceptance test of rejection-mode verification
RESIDUAL = 2  # draw from the residual distribution after a rejection
DRAFT = 3  # draft heads proposing tokens

INVERSE_CDF_COUNTER = 0xFFFFFFFF  # counter of the plain draw's uniform; never a token id

# Up to this many rows the host hashes Python ints (about 3 us a row); beyond it, numpy
# arrays (about 60 us whatever the count, most of it per-call overhead).
_PYTHON_ROWS = 16


def hash32(seed, position, stream: int, counter):
    """The 32-bit hash (in [0, 2**32)) of broadcastable coordinates, absorbed one word at a
    time: seed-lo, seed-hi, position-lo, position-hi, stream, counter.

    The same code runs on Python ints, numpy uint64/int64 arrays and torch int64 tensors
    (`seed` holds uint64 bits; an int64's arithmetic shift is masked back to the raw high
    word); `counter` is taken modulo 2**32. Only the last word is mixed over the broadcast
    shape of `counter`. Capture-safe on tensors."""
    if not 0 <= stream <= MASK32:
        raise ValueError(f"stream={stream!r}: must be an int in [0, 2**32)")
    state = 0
    for word in (seed & MASK32, (seed >> 32) & MASK32, position & MASK32, (position >> 32) & MASK32, stream,
                 counter & MASK32):
        x = state ^ word  # a new value: in place from here on
        x ^= x >> 16
        x *= MUL_A
        x &= MASK32
        x ^= x >> 15
        x *= MUL_B
        x &= MASK32
        x ^= x >> 16
        x += ROUND
        x &= MASK32
        state = x
    return state


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float64, one per broadcast element.

    u = (k + 0.5) * 2**-32 for the 32-bit hash k: exact in float64, smallest
    2**-33, largest 1 - 2**-33, so log(u) and log(1 - u) are always finite.
    """
    k = hash32(seed.to(torch.int64), position.to(torch.int64), stream, counter.to(torch.int64))
    return (k.to(torch.float64) + 0.5) * INV_2_32


def gumbel(seed: torch.Tensor, position: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), float64, finite for every u."""
    u = uniform(seed, position, stream, counter)
    return -torch.log(-torch.log(u))


def draw_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[rows] float64 in (0, 1), on the host: the plain draw's uniform (stream TARGET, counter
    `INVERSE_CDF_COUNTER`) of rows with these request seeds ([rows] uint64, or int64 holding
    the bits) producing tokens at these absolute positions ([rows] int64, >= 0)."""
    seed = np.asarray(seeds).astype(np.uint64, copy=False).reshape(-1)
    position = np.asarray(positions, dtype=np.int64).reshape(-1).view(np.uint64)
    if len(seed) <= _PYTHON_ROWS:
        return np.array([(hash32(s, p, TARGET, INVERSE_CDF_COUNTER) + 0.5) * INV_2_32
                         for s, p in zip(seed.tolist(), position.tolist())], dtype=np.float64)
    counter = np.uint64(INVERSE_CDF_COUNTER)
    return (hash32(seed, position, TARGET, counter).astype(np.float64) + 0.5) * INV_2_32


def staged_draw_uniforms(seeds: np.ndarray, sample_positions: np.ndarray, row_to_req: np.ndarray,
                         local_step: np.ndarray) -> np.ndarray:
    """The per-row field `draw_uniforms` from the ledger's arrays: row r belongs to request
    `row_to_req[r]` and produces the token at `sample_positions[request] + local_step[r]`.
    The captured step reads it as one more per-row field: on the device the hash is some 90
    small integer ops, most of a one-row plain draw's time on a CPU."""
    positions = np.asarray(sample_positions, dtype=np.int64)[row_to_req] + np.asarray(local_step, dtype=np.int64)
    return draw_uniforms(np.asarray(seeds)[row_to_req], positions)


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
    host hashed it (`staged_draw_uniforms`, the same bits), else hashed here. Capture-safe."""
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
    forced token overrides both. All [rows] int64 (`greedy` None where no row
    is greedy). Capture-safe."""
    token = drawn if rows.greedy is None else torch.where(rows.greedy, greedy, drawn)
    return token if rows.forced is None else torch.where(rows.forced >= 0, rows.forced, token)
