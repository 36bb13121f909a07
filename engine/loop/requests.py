"""What the loop holds per request: the checks a submission passes, the request
while it runs, and what it hands back (its completion, per-step events)."""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from engine.host.params import UINT64_MAX, SamplingParams
from engine.loop.stats import LoopStats
from engine.loop.stop_strings import OutputText
from engine.step.checkpoint import EngineCheckpoint
from engine.step.prompt_logprobs import PromptLogprob
from engine.step.step_output import TokenLogprob


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


def drop_oldest_finished(finished: dict[Hashable, Completion], known: set, families: dict[Hashable, tuple],
                         cap: int) -> None:
    """Keep at most `cap` finished completions: drop the oldest (in finishing order) with
    their ids from `known`, and a request with n > 1 only once all its samples finished
    (then all of them, and its entry in `families`)."""
    if len(finished) <= cap:
        return
    family_of = {sample_id: family for family, samples in families.items() for sample_id in samples}
    for request_id in list(finished):
        if len(finished) <= cap:
            return
        if request_id not in finished:
            continue  # went with its family
        family = family_of.get(request_id)
        if family is None:
            del finished[request_id]
            known.discard(request_id)
            continue
        samples = families[family]
        if all(sample_id in finished for sample_id in samples):
            for sample_id in samples:
                del finished[sample_id]
            known.difference_update((family, *samples))
            del families[family]


@dataclass
class StepUndo:
    """What one step may change, taken before it starts (`DecodeLoop._rollback`)."""

    stats: LoopStats
    engine: EngineCheckpoint
    running: list[RunningRequest]
    retained: OrderedDict[int, np.ndarray]
    marks: list[tuple[RunningRequest, tuple]]  # the step's requests, admitted ones included
    # Admitted this step: (arrival step, request, the tokens of the retained cache whose
    # slot it took, None for a slot fresh from the model).
    admitted: list[tuple[int, RunningRequest, np.ndarray | None]] = field(default_factory=list)
    # Cut by a stop string this step: (request, the tokens cut, the logprobs cut or None).
    cuts: list[tuple[RunningRequest, list[int], list | None]] = field(default_factory=list)
