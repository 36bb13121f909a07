"""Counter-based randomness: every uniform is a pure hash of its coordinates.

A uniform is keyed by (request seed, absolute position of the produced token,
stream id, counter). There is no generator state, so a request's draws do not
depend on the batch it shares, on graph buckets, or on how many uniforms other
rows consumed; replaying a step replays its randomness.

The hash works on 32-bit words held in int64 lanes. Every multiplier is below
2**31, so a 32-bit word times a multiplier stays below 2**63: no product ever
overflows int64, and the masked results are the same bits on every backend
(CPU and CUDA integer ops are exact). Inputs are absorbed one word at a time in
the order seed-lo, seed-hi, position-lo, position-hi, stream, counter; the
state after the per-row words is computed on the small broadcast shape, so only
the final counter word is mixed over a [rows, candidates] tensor.
"""
from __future__ import annotations

import torch

# The streams are re-exported: callers name them rng.TARGET, rng.RESIDUAL, ...
from engine.host.counter_hash import (ACCEPT, DRAFT, INV_2_32, MASK32, MUL_A, MUL_B, RESIDUAL,  # noqa: F401
                                      ROUND, TARGET)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche of a 32-bit word held in an int64 tensor (in place)."""
    x ^= x >> 16
    x.mul_(MUL_A).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(MUL_B).bitwise_and_(MASK32)
    x ^= x >> 16
    return x


def _absorb(state: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    x = state ^ word  # new tensor (broadcast shape): `state` is never mutated
    _mix32(x)
    return x.add_(ROUND).bitwise_and_(MASK32)


def hash32(seed: torch.Tensor, position: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (int64 tensor in [0, 2**32)) of broadcastable coordinates.

    `seed` holds uint64 bits in int64 (negative values are seeds >= 2**63);
    `position` is int64; `counter` is taken modulo 2**32.
    """
    if not 0 <= stream <= MASK32:
        raise ValueError(f"stream={stream!r}: must be an int in [0, 2**32)")
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    # Arithmetic right shift sign-extends negative int64; the mask keeps the
    # raw high 32 bits, which is what the uint64 view means.
    state = torch.zeros((), dtype=torch.int64, device=seed.device)
    state = _absorb(state, seed & MASK32)
    state = _absorb(state, (seed >> 32) & MASK32)
    state = _absorb(state, position & MASK32)
    state = _absorb(state, (position >> 32) & MASK32)
    state = _absorb(state, torch.full((), stream, dtype=torch.int64, device=seed.device))
    return _absorb(state, counter.to(torch.int64) & MASK32)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float64, one per broadcast element.

    u = (k + 0.5) * 2**-32 for the 32-bit hash k: exact in float64, smallest
    2**-33, largest 1 - 2**-33, so log(u) and log(1 - u) are always finite.
    """
    k = hash32(seed, position, stream, counter)
    return (k.to(torch.float64) + 0.5) * INV_2_32


def gumbel(seed: torch.Tensor, position: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), float64, finite for every u."""
    u = uniform(seed, position, stream, counter)
    return -torch.log(-torch.log(u))
