"""An independent per-row sampler in numpy, written from the contract
(docs/contract.md §2) and the documented definitions in engine/sampling/draw.py and
engine/sampling/sampler.py. It imports nothing from `engine`: it is the oracle the
fused sampler and the engine are checked against.

Per row, in vLLM V1's order: suppressed stop ids leave the row; M = the
largest remaining raw logit; greedy (T = 0) takes the smallest id holding M
and has no filters (vLLM resets them for a greedy request); else z = (raw -
M) / T in float32, p = softmax(z) in float64; min-p keeps exp(z) >= min_p
(p >= min_p * max p); top-k keeps z >= the k-th largest z; top-p keeps p >=
t*, where t* is the p of the first token (by decreasing z) at which the mass
of the set min-p and top-k kept reaches top_p times that set's mass. Masses
are the integers floor(exp(z) * 2**S), S = 52 - bit_length(V - 1): top-p's
walk and the draw add those. Every sampled row draws by inverse CDF with one
uniform over its kept tokens' masses in token-id order; a forced token
overrides the draw. Logprobs come from the raw logits ("raw") or from the
kept masses ("processed": each kept token's mass, the floor of its float32
weight exp(z) times 2**S, over the kept masses' total, as the contract
defines it; a kept token of mass 0 has logprob -inf).

Floating point. The engine takes exp in float32 and this reference in
float64, so a mass may differ by one unit and the two can disagree only
where a decision sits within rounding of its threshold. Every such decision
is detected (see the `*_TOL` constants) and the row is reported
`decided=False`: a test compares only decided rows. Ties between equal
logits are exact in both and stay decided; they are the boundary cases the
filters' `>=` must keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# --- the counter-based hash (engine/sampling/draw.py's documented definition) ----------
# 32-bit words; each absorbed word is xor-ed into the state, avalanched with
# the "lowbias32" mix (multipliers 0x7FEB352D and MurmurHash2's 0x5BD1E995,
# shifts 16, 15, 16) and offset by the golden-ratio constant. Words in order:
# seed low, seed high, position low, position high, stream, counter.
_MASK32 = np.uint64(0xFFFFFFFF)
_MUL_A = np.uint64(0x7FEB352D)
_MUL_B = np.uint64(0x5BD1E995)
_ROUND = np.uint64(0x9E3779B9)
TARGET_STREAM = 0  # the row's own draw
INVERSE_CDF_COUNTER = 0xFFFFFFFF  # counter of the plain draw's single uniform


def _absorb(state: np.ndarray, word: np.ndarray) -> np.ndarray:
    x = (state ^ word) & _MASK32
    x ^= x >> np.uint64(16)
    x = (x * _MUL_A) & _MASK32  # a 32-bit word times a 31-bit constant: < 2**63, no wrap
    x ^= x >> np.uint64(15)
    x = (x * _MUL_B) & _MASK32
    x ^= x >> np.uint64(16)
    return (x + _ROUND) & _MASK32


def hash32(seed: int, position: int, stream: int, counter: np.ndarray | int) -> np.ndarray:
    """uint64 array of 32-bit hashes, one per counter."""
    seed_bits = np.uint64(seed % 2**64)
    pos_bits = np.uint64(position % 2**64)
    state = np.zeros(np.shape(counter), dtype=np.uint64)
    for word in (seed_bits & _MASK32, seed_bits >> np.uint64(32), pos_bits & _MASK32, pos_bits >> np.uint64(32), np.uint64(stream)):
        state = _absorb(state, word)
    return _absorb(state, np.asarray(counter, dtype=np.uint64) & _MASK32)


def uniform(seed: int, position: int, stream: int, counter: np.ndarray | int) -> np.ndarray:
    """(k + 0.5) / 2**32 for the hash k: float64 in the open interval (0, 1)."""
    return (hash32(seed, position, stream, counter).astype(np.float64) + 0.5) / 2.0**32


# --- tolerances of the float-sensitive decisions -----------------------------
# The engine's normaliser is a float32 sum: relative error well under 1e-5.
TOP_P_TOL = 1e-5  # |cumulative mass - level| / level below this: undecided
INVERSE_CDF_TOL = 1e-5  # a CDF step within this fraction of the total mass from u * total
MIN_P_TOL = 1e-9  # p / max p against min_p: both sides are exact up to float64 rounding
LOGPROB_ATOL = 1e-5  # stated tolerance for logprob values (float32 block sums vs float64)


@dataclass(frozen=True)
class RowSpec:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    position: int = 0
    suppressed: tuple[int, ...] = ()  # stop ids masked on this row
    forced: int = -1


@dataclass
class RowResult:
    token: int
    kept: np.ndarray  # [V] bool
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
    decided: bool  # False: some decision sits within rounding of its threshold


def sample_row(raw: np.ndarray, spec: RowSpec, *, num_top: int = 0, mode: str = "raw") -> RowResult:
    """One row of logits [V] (float32 values) under `spec`."""
    raw = np.asarray(raw, dtype=np.float32)
    vocab = len(raw)
    decided = True
    alive = np.ones(vocab, dtype=bool)
    alive[list(spec.suppressed)] = False
    top = raw[alive].max()
    greedy = float(spec.temperature) == 0.0
    temperature = np.float32(1.0) if greedy else np.float32(spec.temperature)
    z = np.full(vocab, -np.inf, dtype=np.float32)
    z[alive] = (raw[alive] - top) / temperature  # float32, as the contract defines z
    z64 = z.astype(np.float64)
    weight = np.exp(z64)  # exp(-inf) = 0 for suppressed ids
    mass = np.floor(weight * 2.0 ** (52 - max(1, (vocab - 1).bit_length())))

    order = sorted(range(vocab), key=lambda t: (-z64[t], t))  # z desc, id asc
    kept = alive.copy()
    # Parameters travel as float32 (the ledger's dtypes): compare against those values.
    min_p = float(np.float32(spec.min_p))
    if min_p > 0.0 and not greedy:
        ratio = np.exp(z64)  # p / max p, since the largest z is 0
        near = np.abs(ratio - min_p) <= MIN_P_TOL * min_p
        if np.any(near & alive & (z64 != 0.0)):
            decided = False
        kept &= ratio >= min_p
    k_on = 0 < spec.top_k < vocab and not greedy
    if k_on:
        kth = z64[order[spec.top_k - 1]]
        kept &= z64 >= kth
    top_p = float(np.float32(spec.top_p))
    if top_p < 1.0 and not greedy:
        level = top_p * mass[kept].sum()
        walk = [t for t in order if kept[t]]
        cum = 0.0
        threshold = None
        for i, t in enumerate(walk):
            cum += mass[t]
            # Near the level, the crossing may fall on this token or the next:
            # undecided only if the two would give different thresholds.
            if abs(cum - level) <= TOP_P_TOL * level and i + 1 < len(walk) and z64[walk[i + 1]] != z64[t]:
                decided = False
            if cum >= level:
                threshold = z64[t]
                break
        kept &= z64 >= threshold

    if greedy:
        token = int(np.flatnonzero(alive & (raw == top))[0])
    else:
        u = float(uniform(spec.seed, spec.position, TARGET_STREAM, INVERSE_CDF_COUNTER))
        kept_mass = np.where(kept, mass, 0.0)
        cdf = np.cumsum(kept_mass)
        target = u * cdf[-1]
        if np.any(np.abs(cdf[kept_mass > 0] - target) <= INVERSE_CDF_TOL * cdf[-1]):
            decided = False
        token = int(np.flatnonzero(cdf > target)[0])
    if spec.forced >= 0:
        token = spec.forced

    if mode == "raw":
        raw64 = raw.astype(np.float64)
        lse = raw64.max() + np.log(np.exp(raw64 - raw64.max()).sum())
        by_raw = sorted(range(vocab), key=lambda t: (-raw64[t], t))[:num_top]
        return RowResult(
            token=token,
            kept=kept,
            logprob=float(raw64[token] - lse),
            rank=1 + int((raw64 > raw64[token]).sum()),
            top_ids=by_raw,
            top_logprobs=[float(raw64[t] - lse) for t in by_raw],
            decided=decided,
        )
    # The contract's processed logprob: a kept token's mass over the kept total, the
    # masses taken from the float32 weights (the engine's exp is float32).
    scaled = weight.astype(np.float32).astype(np.float64) * 2.0 ** (52 - max(1, (vocab - 1).bit_length()))
    mass32 = np.floor(scaled)
    with np.errstate(divide="ignore"):  # a kept token of mass 0 is never drawn: logprob -inf
        log_q = np.where(kept, np.log(mass32) - np.log(mass32[kept].sum()), -np.inf)
    token_z = z64[token] if kept[token] else -np.inf
    kept_order = [t for t in order if kept[t]][:num_top]
    # Fewer kept tokens than N: the smallest other ids follow, at -inf (as vLLM lists them).
    top_ids = kept_order + [t for t in range(vocab) if not kept[t]][: num_top - len(kept_order)]
    # One float32 ulp of exp (the engine's and numpy's may differ by one) moves a small
    # mass across an integer: its floor, and a logprob reported for it, is then within
    # rounding (1 / mass, or -inf against finite at mass 0).
    for t in {token, *kept_order}:
        if kept[t] and np.floor(scaled[t] * (1 - 2.0**-23)) != np.floor(scaled[t] * (1 + 2.0**-23)) \
                and scaled[t] < 1.0 / LOGPROB_ATOL:
            decided = False
    return RowResult(
        token=token,
        kept=kept,
        logprob=float(log_q[token]),
        rank=1 + int((kept & (z64 > token_z)).sum()),
        top_ids=top_ids,
        top_logprobs=[float(log_q[t]) if t >= 0 else -np.inf for t in top_ids],
        decided=decided,
    )


def sample_rows(logits: np.ndarray, specs: list[RowSpec], *, num_top: int = 0, mode: str = "raw") -> list[RowResult]:
    """`sample_row` for each row of logits [rows, V]."""
    return [sample_row(row, spec, num_top=num_top, mode=mode) for row, spec in zip(np.asarray(logits), specs)]
