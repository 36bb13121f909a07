"""The interpreter's fast `tl.xor_sum` (`fast_interpreter()` in tests/kernel_interpreter.py, held for the
session by tests/conftest.py) against xor folded in Python, and `tl.sort`, its caller, against torch."""
from __future__ import annotations

import functools
import operator
import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="the interpreter's reductions: TRITON_INTERPRET=1 only")


@triton.jit
def _xor_and_sort(x_ptr, rows_ptr, cols_ptr, all_ptr, sorted_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + r * C + c)
    tl.store(rows_ptr + tl.arange(0, R), tl.xor_sum(x, 1))
    tl.store(cols_ptr + tl.arange(0, C)[None, :], tl.xor_sum(x, 0, keep_dims=True))
    tl.store(all_ptr, tl.xor_sum(x))
    tl.store(sorted_ptr + r * C + c, tl.sort(x))


@pytest.mark.parametrize("seed", range(3))
def test_xor_sum_and_sort_give_the_definitions_bits(seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(-2**62, 2**62, (4, 16), dtype=np.int64))
    rows, cols, whole, ordered = torch.zeros(4, dtype=torch.int64), torch.zeros(16, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64), torch.zeros_like(x)
    _xor_and_sort[(1,)](x, rows, cols, whole, ordered, R=4, C=16)
    fold = lambda values: functools.reduce(operator.xor, values, 0)  # noqa: E731
    assert rows.tolist() == [fold(row) for row in x.tolist()]
    assert cols.tolist() == [fold(col) for col in x.T.tolist()]
    assert whole.item() == fold(x.flatten().tolist())
    assert torch.equal(ordered, torch.sort(x, dim=1).values)
