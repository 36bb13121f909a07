"""What the loop holds per request: the checks a submission passes, the request
while it runs, and what it hands back (its completion, per-step events)."""
from __future__ import annotations

import os
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from engine.host.params import UINT64_MAX, SamplingParams
from engine.loop.stop_strings import OutputText
from engine.step.prompt_logprobs import PromptLogprob
from engine.step.outputs import TokenLogprob


def check_request_id(request_id: Hashable) -> None:
    if request_id is None:
        raise ValueError("request_id=None: must not be None")
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"request_id={request_id!r}: must be hashable") from None


def fresh_seed() -> int:
    """A seed from the OS's entropy (`os.urandom`), in [0, 2**64): what a request that
    brings none gets at submission, unless `LoopConfig.seed_base` asks for derived ones."""
    return int.from_bytes(os.urandom(8), "little")


def sibling_seed(seed: int, j: int) -> int:
    """The seed of sample `j` of a request with `n > 1` and a seed: `j = 0` keeps the seed
    itself (so n = 1 and the first of n samples agree), `j > 0` takes the j-th output of a
    splitmix64 generator started at it: well mixed, so siblings never share a seed the way
    `seed + j` would share one with the request seeded `seed + 1`."""
    if j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) & UINT64_MAX
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64_MAX
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64_MAX
    return z ^ (z >> 31)


def checked_prompt(request_id: Hashable, prompt_tokens: object, vocab_size: int, *, label: str | None = None) -> np.ndarray:
    """[prompt_len] int64 from a flat sequence of int ids in [0, vocab_size). Nothing is
    coerced: a float, a bool, a string or a nested list is a caller's bug, not a token.
    `label`: how errors name the prompt (default `request <id>: prompt_tokens`)."""
    where = label or f"request {request_id!r}: prompt_tokens"
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dtype.is_floating_point or prompt_tokens.dtype.is_complex or prompt_tokens.dtype == torch.bool:
            raise ValueError(f"{where}: a tensor of {prompt_tokens.dtype}, not of integer token ids")
        prompt_tokens = prompt_tokens.detach().cpu().numpy()
    if isinstance(prompt_tokens, np.ndarray):
        if not np.issubdtype(prompt_tokens.dtype, np.integer):
            raise ValueError(f"{where}: a numpy array of {prompt_tokens.dtype}, not of integer token ids")
        if prompt_tokens.ndim != 1:
            raise ValueError(f"{where}: shape {prompt_tokens.shape}, must be 1-D")
        tokens = prompt_tokens.tolist()  # Python ints: range checks below cannot overflow
    elif isinstance(prompt_tokens, str):
        raise ValueError(f"{where}={prompt_tokens!r}: text, not token ids; encode it first "
                         "(tokenizer.encode(text)), or use engine.LLM, which takes text")
    elif isinstance(prompt_tokens, SequenceABC) and not isinstance(prompt_tokens, (bytes, bytearray)):
        tokens = list(prompt_tokens)
        for i, token in enumerate(tokens):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(f"{where}[{i}]={token!r}: must be an int token id, not a {type(token).__name__}")
    else:
        raise ValueError(
            f"{where}={prompt_tokens!r}: must be a sequence of int token ids, not a {type(prompt_tokens).__name__}"
        )
    if not tokens:
        raise ValueError(f"{label or f'request {request_id!r}: prompt'} is empty (at least one token is needed)")
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{where}[{i}]={int(token)}: outside [0, {vocab_size})")
    return np.asarray(tokens, dtype=np.int64)


@dataclass
class Completion:
    request_id: Hashable
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    seed: int | None = None
    finish_reason: str | None = None  # "stop" (EOS, stop id, stop string), "length", "abort" or "error"
    error: str | None = None  # finish_reason "error": the engine's message, naming the request and the cause
    text: str | None = None  # the decoded output, when the loop has a tokenizer (set when the request finishes)
    # finish_reason "stop": the stop string matched, or the id from params.stop_token_ids; None for EOS (as vLLM)
    stop_reason: str | int | None = None


@dataclass
class RunningRequest:
    """A request the loop admitted: its prompt, parameters, cache slot, table row and completion so far."""

    request_id: Hashable
    prompt: np.ndarray  # [prompt_len] int64
    params: SamplingParams
    max_tokens: int
    kv_slot: int
    completion: Completion
    table_row: int = -1  # row of the loop's persistent batch
    prefilled: int = 0  # prompt tokens already in the KV cache
    drafts: list[int] = field(default_factory=list)  # being verified this step
    family: Hashable | None = None  # the id the request was submitted under, when it is one of n > 1 samples
    text: OutputText | None = None  # its output text as it grows, when it has stop strings

    @property
    def generated(self) -> list[int]:
        return self.completion.tokens

    def mark(self) -> tuple:
        """What a step may change in this request; `restore` puts it back."""
        c = self.completion
        return (self.prefilled, len(c.tokens), None if c.logprobs is None else len(c.logprobs),
                c.prompt_logprobs, c.seed, c.finish_reason, c.error, c.text, c.stop_reason,
                None if self.text is None else self.text.state())

    def restore(self, mark: tuple) -> None:
        """Back to `mark`; tokens a stop string cut must have been put back first (they
        were appended after the mark was taken, so only those past it are dropped)."""
        c = self.completion
        (self.prefilled, num_tokens, num_logprobs, c.prompt_logprobs, c.seed, c.finish_reason, c.error, c.text,
         c.stop_reason, text_state) = mark
        del c.tokens[num_tokens:]
        if num_logprobs is not None:
            del c.logprobs[num_logprobs:]
        if text_state is not None:
            self.text.restore(text_state)

    def cached_tokens(self) -> np.ndarray:
        """The tokens whose keys and values this request's cache slot holds, in order."""
        if self.prefilled < len(self.prompt):
            return self.prompt[: self.prefilled]
        # The last generated token is never fed back; rejected drafts sit past the end.
        return np.concatenate([self.prompt, np.asarray(self.generated[:-1], dtype=np.int64)])


@dataclass(frozen=True)
class StepEvent:
    """Streaming output: what one request emitted in one step. `retracted`: how many tokens
    emitted in earlier steps a stop string took back (they produced only text at or past
    it); the request's `Completion` holds what it kept."""

    request_id: Hashable
    new_tokens: list[int]
    finished: bool
    retracted: int = 0
