"""Step engine: the tail of every inference step, exact, fast and reproducible.

Data flow: host ledger (which rows, which positions, which parameters) ->
static buffers and one captured graph per batch-size bucket -> gather,
logits, sampling / draft verification -> tokens, logprobs, prompt logprobs.
"""
from __future__ import annotations

import importlib
from typing import Any

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SamplingParams, SeqMeta

# name -> the module that defines it
_DEVICE_SIDE = {"StepEngine": "engine.step.step_engine", "EngineConfig": "engine.step.config",
                "StepOutput": "engine.step.outputs"}
_DECODE_LOOP = {"DecodeLoop", "LoopConfig", "Completion", "generate"}

__all__ = ["SamplingParams", "SeqMeta", "prepare_sampler_inputs", "SamplerInputs", *sorted(_DEVICE_SIDE),
           *sorted(_DECODE_LOOP)]


def __getattr__(name: str) -> Any:
    # The device side imports torch; the host ledger (and `python -m engine
    # explain`) should not pay for that, so it loads on first use.
    if name in _DEVICE_SIDE:
        return getattr(importlib.import_module(_DEVICE_SIDE[name]), name)
    if name in _DECODE_LOOP:
        from engine.loop import decode_loop

        return getattr(decode_loop, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
