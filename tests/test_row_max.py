"""`first_max` against a per-row Python loop: the largest value (NaN above everything) and
the smallest index holding it, over vocabularies with and without a block divisor."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.thresholds import block_width, first_max


def loop_reference(row: list[float]) -> tuple[float, int]:
    """The first NaN if any; else the first of the largest values."""
    for i, v in enumerate(row):
        if math.isnan(v):
            return v, i
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return row[best], best


VALUES = [-math.inf, -2.0, -1.0, 0.0, 1.0, 3.0, math.inf, math.nan]


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.sampled_from([31, 32, 64, 97, 192, 1000, 1024, 4096 + 1, 6 * 1031]),
    rows=st.integers(1, 5),
    data=st.data(),
)
def test_first_max_is_the_loops_first_index_of_the_largest(vocab: int, rows: int, data: st.DataObject) -> None:
    # Few distinct values, so ties (inside a block and across blocks) are the rule.
    weights = data.draw(st.sampled_from(["ties", "some_special", "random"]))
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    if weights == "ties":
        x = rng.integers(-2, 2, size=(rows, vocab)).astype(np.float32)
    elif weights == "some_special":
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        for r in range(rows):
            for _ in range(data.draw(st.integers(0, 3))):
                x[r, rng.integers(vocab)] = data.draw(st.sampled_from(VALUES))
    else:
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
    values, indices = first_max(torch.from_numpy(x))
    for r in range(rows):
        want_value, want_index = loop_reference(x[r].tolist())
        assert int(indices[r]) == want_index
        got = float(values[r])
        assert got == want_value or (math.isnan(got) and math.isnan(want_value))


def test_block_width_divides_the_vocabulary_and_leaves_primes_to_one_pass() -> None:
    for vocab in (49152, 128256, 151936, 32000, 1024):
        width = block_width(vocab)
        assert width is not None and vocab % width == 0 and 32 <= width < vocab
    assert block_width(49157) is None  # a prime: x.max(-1) itself
    assert block_width(31) is None


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_first_max_of_a_row_whose_maximum_repeats_across_blocks(vocab: int) -> None:
    """The maximum in the last block and again in the second: the second's index wins."""
    width = block_width(vocab)
    x = torch.zeros(2, vocab)
    x[0, vocab - 1] = x[0, width + 5] = 7.0
    x[1, :] = -math.inf
    values, indices = first_max(x)
    assert indices.tolist() == [width + 5, 0] and values.tolist() == [7.0, -math.inf]
