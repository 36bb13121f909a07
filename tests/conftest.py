"""Fixtures shared by the test files."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> int:
    """Runs the test at 1 and at 2 torch threads: invariance claims must hold at both."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
