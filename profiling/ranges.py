"""Named ranges around every stage of a step, for Nsight Systems and torch.profiler.

`stage("replay")` opens an NVTX range (domain "step-engine") when an NVTX
tool is attached (Nsight Systems sets NVTX_INJECTION64_PATH in the profiled
process) and a torch.profiler `record_function` range while a torch.profiler
trace is recording, so `--trace` files carry the same names. With neither,
it is one shared no-op context: nothing is paid on the hot path.
"""
from __future__ import annotations

import contextlib
import os
from typing import ContextManager

import torch

DOMAIN = "step-engine"
STAGES = ("schedule", "ledger", "staging copy", "replay", "eager step", "exact rows",
          "output copy", "prompt logprobs", "model forward")

_NULL = contextlib.nullcontext()
_nvtx = None
if os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"):
    try:
        import nvtx as _nvtx
    except ImportError:  # the range names still reach torch.profiler traces
        _nvtx = None


def stage(name: str) -> ContextManager[None]:
    """A context naming one stage of the step (see STAGES)."""
    tracing = torch.autograd.profiler._is_profiler_enabled
    if _nvtx is None and not tracing:
        return _NULL
    stack = contextlib.ExitStack()
    if _nvtx is not None:
        stack.enter_context(_nvtx.annotate(name, domain=DOMAIN))
    if tracing:
        stack.enter_context(torch.profiler.record_function(name))
    return stack
