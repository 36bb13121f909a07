"""`engine.sampling.draw`'s counter-based uniforms inside Triton kernels, to the same bits.

The hash absorbs 32-bit words held in int64 lanes (every product of a word and a
multiplier below 2**31 fits in int64, as in the torch version), so the kernels and
the torch path compute the same integers; u = (k + 0.5) * 2**-32 is exact in f64.
Only counter 0 is needed here (the acceptance test and the residual draw).
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.draw import INV_2_32, MASK32, MUL_A, MUL_B, ROUND

_MASK32: tl.constexpr = tl.constexpr(MASK32)
_MUL_A: tl.constexpr = tl.constexpr(MUL_A)
_MUL_B: tl.constexpr = tl.constexpr(MUL_B)
_ROUND: tl.constexpr = tl.constexpr(ROUND)
_INV_2_32: tl.constexpr = tl.constexpr(INV_2_32)


@triton.jit
def _absorb(state, word):
    """One word into the hash state (`engine.sampling.draw.hash32`): int64 lanes holding 32 bits."""
    x = state ^ word
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    x = x ^ (x >> 16)
    return (x + _ROUND) & _MASK32


@triton.jit
def uniform_at(seed, position, STREAM: tl.constexpr):
    """`engine.sampling.draw.uniform(seed, position, STREAM, 0)`: f64 in (0, 1), same bits."""
    state = _absorb(tl.zeros_like(position), seed & _MASK32)
    state = _absorb(state, (seed >> 32) & _MASK32)
    state = _absorb(state, position & _MASK32)
    state = _absorb(state, (position >> 32) & _MASK32)
    state = _absorb(state, STREAM)
    state = _absorb(state, 0)
    return (state.to(tl.float64) + 0.5) * _INV_2_32
