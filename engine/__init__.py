"""Step engine: the tail of every inference step, exact, fast and reproducible.

Data flow: host ledger (which rows, which positions, which parameters) ->
static buffers and one captured graph per batch-size bucket -> gather,
logits, sampling / draft verification -> tokens, logprobs, prompt logprobs.
"""
from engine.ledger import SamplerInputs, prepare_sampler_inputs
from engine.params import SamplingParams, SeqMeta

__all__ = ["SamplingParams", "SeqMeta", "prepare_sampler_inputs", "SamplerInputs"]
