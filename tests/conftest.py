"""Fixtures shared by the test files."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors
# (engine/sampling/kernels); it must be chosen before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> int:
    """Runs the test at 1 and at 2 torch threads: invariance claims must hold at both."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
