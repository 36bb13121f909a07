"""The uniform of each sample row's inverse-CDF draw, computed on the host.

A sampled row draws with one uniform, the counter-based hash of (request
seed, absolute position of the produced token, stream TARGET, counter
0xFFFFFFFF) defined in `engine/sampling/rng.py`. Its inputs are host
values the step stages anyway, so the staging computes it here, in numpy,
and the captured step reads it as one more per-row field: on the device
that hash is some 90 small integer ops per call, most of a one-row plain
draw's time on a CPU. This is a second implementation of the same hash;
`tests/test_rng.py` checks the two agree bit for bit.

Numpy only (the host side does not import torch).
"""
from __future__ import annotations

import numpy as np

from engine.host.counter_hash import INV_2_32, INVERSE_CDF_COUNTER, MASK32, MUL_A, MUL_B, ROUND, TARGET

# Up to this many rows the hash runs on Python ints (about 3 us a row); beyond it, on
# numpy arrays (about 60 us whatever the count, most of it per-call overhead).
_PYTHON_ROWS = 16


def _hash(seed: int | np.ndarray, position: int | np.ndarray) -> int | np.ndarray:
    """The 32-bit hash of (seed, position, stream TARGET, the draw's counter): the words
    absorbed in `rng.hash32`'s order. The same code runs on Python ints and on numpy
    uint64 arrays, whose products wrap modulo 2**64 and keep the low 32 bits exact."""
    state = 0
    for word in (seed & MASK32, seed >> 32, position & MASK32, position >> 32, TARGET, INVERSE_CDF_COUNTER):
        x = state ^ word  # a new array (or int): in place from here on
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


def draw_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[rows] float64 in (0, 1): the draw's uniform of rows with these request seeds
    ([rows] uint64, or int64 holding the bits) producing tokens at these absolute
    positions ([rows] int64, >= 0)."""
    seed = np.asarray(seeds).astype(np.uint64, copy=False).reshape(-1)
    position = np.asarray(positions, dtype=np.int64).reshape(-1).view(np.uint64)
    if len(seed) <= _PYTHON_ROWS:
        return np.array([(_hash(s, p) + 0.5) * INV_2_32 for s, p in zip(seed.tolist(), position.tolist())],
                        dtype=np.float64)
    return (_hash(seed, position).astype(np.float64) + 0.5) * INV_2_32


def staged_draw_uniforms(seeds: np.ndarray, sample_positions: np.ndarray, row_to_req: np.ndarray,
                         local_step: np.ndarray) -> np.ndarray:
    """The per-row field `draw_uniforms` from the ledger's arrays: row r belongs to request
    `row_to_req[r]` and produces the token at `sample_positions[request] + local_step[r]`."""
    positions = np.asarray(sample_positions, dtype=np.int64)[row_to_req] + np.asarray(local_step, dtype=np.int64)
    return draw_uniforms(np.asarray(seeds)[row_to_req], positions)
