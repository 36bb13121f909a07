"""The requests the CUDA dry run's scenarios step (profiling/cuda_dry_run.py, and
profiling/kernel_head_check.py on a GPU): prefills and decodes with drafts, every filter
and output across a batch, the sampling controls, and a step whose token bitmask
restricts a row (as a grammar's matcher would)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from engine.host.ledger import SamplerInputs
from engine.host.params import SamplingParams, SeqMeta
from engine.sampling.token_bitmask import bitmask_words
from engine.step.staging import StepArrays
from engine.step.step_engine import StepEngine


def scenario_requests(n: int, *, prompt: int = 6, decode: bool = False, drafts: int = 0,
              params: Callable[[int], SamplingParams] | None = None) -> list[SeqMeta]:
    """n requests: prefills of `prompt` tokens, or decodes verifying `drafts` drafts."""
    seqs = []
    for i in range(n):
        p = params(i) if params is not None else SamplingParams(temperature=0.8, top_p=0.9, seed=i)
        if decode:
            generated = 3
            seqs.append(SeqMeta(i, False, 1 + drafts, prompt + generated + drafts, prompt, prompt_tokens=list(range(prompt)),
                                num_generated=generated, params=p, mtp_read_slot=i + 1 if drafts else 0,
                                mtp_write_slot=i + 1 if drafts else 0))
        else:
            seqs.append(SeqMeta(i, True, prompt, prompt, prompt, prompt_tokens=list(range(prompt)), params=p))
    return seqs


def mixed_params(i: int) -> SamplingParams:
    """Every filter and output across a batch: greedy, top-k, top-p, min-p, logprobs, min_tokens."""
    kinds = (
        SamplingParams(temperature=0.0, seed=i, logprobs=3),
        SamplingParams(temperature=0.7, top_k=40, seed=i),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=i, logprobs=0),
        SamplingParams(temperature=1.0, seed=i, min_tokens=4, stop_token_ids=(7,)),
    )
    return kinds[i % len(kinds)]


def controlled_params(i: int) -> SamplingParams:
    """`mixed_params` plus the sampling controls: penalties, a logit bias, an allowed set."""
    return dataclasses.replace(mixed_params(i), repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                               logit_bias={3: 2.0, 5: -1.0}, allowed_token_ids=tuple(range(2, 64)) if i % 2 else None)


def masked_step(engine: StepEngine, seqs: list[SeqMeta]) -> tuple[SamplerInputs, StepArrays]:
    """What `engine.step(engine.source, seqs)` runs, with a token bitmask that lets the first
    sample row draw only tokens 0-31 (as a grammar's matcher would fill it)."""
    inputs, stop_ids = engine.seq_front.ledger(seqs)
    arrays = engine.drafts.step_arrays(inputs, stop_ids)
    arrays.control_slots = engine.seq_front.control_slots(inputs)
    arrays.token_bitmask = np.full((inputs.num_sample_rows, bitmask_words(engine.vocab_size)), -1, dtype=np.int32)
    arrays.token_bitmask[0, 1:] = 0
    return inputs, arrays
