"""The checks a request passes before the loop queues it (`DecodeLoop.submit` and
`DecodeLoop.check`): all of them, before anything changes, each naming the
request, the field and the value."""
from __future__ import annotations

import dataclasses
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from engine.host.params import SamplingParams
from engine.step.batch import PersistentBatch
from engine.loop.loop_config import LoopConfig
from engine.host.token_ids import check_request_id
from engine.models.protocol import CausalLM, ChatTokenizer


class Submission(NamedTuple):
    """A request that passed every check."""

    prompt: np.ndarray  # [prompt_len] int64
    params: SamplingParams
    sample_ids: list[Hashable]  # [request_id], or (request_id, j) for each of n > 1 samples
    max_tokens: int
    arrival_step: int


def check_submission(
    request_id: Hashable,
    prompt_tokens: Sequence[int],
    params: SamplingParams | None,
    arrival_step: int,
    *,
    known: set,
    tokenizer: ChatTokenizer | None,
    model: CausalLM,
    batch: PersistentBatch,
    config: LoopConfig,
) -> Submission:
    """The request as the loop queues it; **raises** ValueError naming the request, the
    field and the value. `known`: the ids already submitted to the loop."""
    check_request_id(request_id)
    if request_id in known:
        raise ValueError(f"request {request_id!r}: request_id was already submitted")
    if isinstance(params, SamplingParams):
        params = whole_vocabulary_read(request_id, params, batch)
    # What the batch checks (the prompt, the caps on logprobs, stop ids, controls), once, here.
    prompt, params = batch.check(request_id, prompt_tokens, params)
    if params.n > config.max_n:
        raise ValueError(f"request {request_id!r}: params.n={params.n}: more than LoopConfig.max_n={config.max_n}")
    sample_ids = [request_id] if params.n == 1 else [(request_id, j) for j in range(params.n)]
    taken = [sample_id for sample_id in sample_ids if sample_id in known]
    if taken:
        raise ValueError(f"request {request_id!r}: params.n={params.n}: the id {taken[0]!r} of one of its samples "
                         "was already submitted")
    if tokenizer is None:
        if params.stop:
            raise ValueError(f"request {request_id!r}: params.stop={params.stop!r}: stop strings need a tokenizer "
                             "(DecodeLoop(..., tokenizer=...))")
        if params.structured is not None:
            kind, text = params.structured
            raise ValueError(f"request {request_id!r}: params.{kind}={text!r}: structured output needs a "
                             "tokenizer (DecodeLoop(..., tokenizer=...))")
    if isinstance(arrival_step, bool) or not isinstance(arrival_step, (int, np.integer)) or arrival_step < 0:
        raise ValueError(f"request {request_id!r}: arrival_step={arrival_step!r}: must be an int >= 0")
    max_tokens = params.max_tokens if params.max_tokens is not None else config.default_max_tokens
    # The last generated token is never fed back, so the cache needs one
    # slot less than prompt + max_tokens; drafts may run max_draft past it.
    needed = len(prompt) + max_tokens - 1 + config.max_draft_tokens
    if needed > model.max_context:
        raise ValueError(
            f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs a "
            f"context of {needed} but the model's max_context is {model.max_context}"
        )
    batch.check_constraints(request_id, params)  # bad words, structured output (compiled, cached)
    return Submission(prompt, params, sample_ids, max_tokens, int(arrival_step))


def whole_vocabulary_read(request_id: Hashable, params: SamplingParams, batch: PersistentBatch) -> SamplingParams:
    """`logprobs=-1` / `prompt_logprobs=-1` (vLLM's "the whole vocabulary") as the
    vocabulary's size, where `SamplerConfig.max_logprobs` allows that many; **raises**
    ValueError naming the request, the field and the cap where it does not."""
    asked = [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1
             and not isinstance(getattr(params, name), bool)]
    if not asked:
        return params
    vocab = batch.engine.vocab_size
    cap = batch.engine.config.sampler.max_logprobs
    if vocab > cap:
        raise ValueError(f"request {request_id!r}: params.{asked[0]}=-1: the whole vocabulary ({vocab} tokens) is more "
                         f"than max_logprobs={cap} (EngineConfig(sampler=SamplerConfig(max_logprobs=...)))")
    return dataclasses.replace(params, **{name: vocab for name in asked})
