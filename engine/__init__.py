"""Step engine: the tail of every inference step, exact, fast and reproducible.

Data flow: host ledger (which rows, which positions, which parameters) ->
static buffers and one captured graph per batch-size bucket -> gather,
logits, sampling / draft verification -> tokens, logprobs, prompt logprobs.
"""
from __future__ import annotations

import importlib
from typing import Any

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SamplingParams, SeqMeta, StructuredOutputsParams

# name -> the module that defines it; loaded on first use
_LAZY = {
    "StepEngine": "engine.step.step_engine",
    "EngineConfig": "engine.step.engine_config",
    "StepOutput": "engine.step.step_output",
    "PersistentBatch": "engine.step.batch",
    "BatchStep": "engine.step.batch",
    "DecodeLoop": "engine.loop.decode_loop",
    "LoopConfig": "engine.loop.loop_config",
    "Completion": "engine.loop.requests",
    "generate": "engine.loop.generate",
    "load_smollm2": "engine.models.gguf_loader",
    "LlamaModel": "engine.models.llama",
    "HFCausalLM": "engine.models.hf_adapter",
    "SamplerConfig": "engine.sampling.sampler",
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "CompletionOutput": "engine.llm",
    "Logprob": "engine.llm",
}

__all__ = ["SamplingParams", "SeqMeta", "StructuredOutputsParams", "prepare_sampler_inputs", "SamplerInputs", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    # The device side imports torch; the host ledger (and `python -m engine
    # explain`) should not pay for that, so it loads on first use.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
