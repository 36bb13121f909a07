"""What one test leaves behind never decides another's result (tests/conftest.py's guards)."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the guard is for the interpreter")
def test_an_in_process_build_after_interpreted_kernels_is_refused_every_time():
    """An interpreted kernel, then an sm_90 build in the same process: with an empty Triton
    cache the build trips on the interpreter's patched builtins, with a warm one it passes.
    The guard makes it fail on every machine."""
    pytest.importorskip("triton")
    from profiling.lm_head_build import build_sm90
    from engine.step.lm_head_kernel import lm_head_logits

    hidden, weight = torch.randn(3, 16), torch.randn(32, 16)
    lm_head_logits(hidden, torch.tensor([0, 2, -1]), weight)  # interpreted
    with pytest.raises(RuntimeError, match="build in a subprocess"):
        build_sm90("bf16", "i32")
