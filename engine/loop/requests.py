"""What the loop holds per request: the checks a submission passes, the request
while it runs, which requests run in a step, and what it hands back (its completion,
per-step events).

Scheduling (`schedule`): decodes first (1 + drafts each, drafts from the n-gram
drafter), then prefill chunks with the rest of the token budget, in running order. Before its first
chunk a request may copy a prompt prefix another cache holds
(`choose_shared_prefix`) or wait a step for the request ahead of it that is
prefilling that prefix. The samples of one request with n > 1 share their
prompt whatever its length: the first computes it, the others copy it.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from engine.host.params import UINT64_MAX, SamplingParams
from engine.loop.drafter import propose_ngram_drafts
from engine.loop.loop_config import LoopConfig
from engine.loop.stats import LoopStats
from engine.loop.stop_strings import OutputText
from engine.step.engine_config import EngineCheckpoint
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


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step."""

    req: RunningRequest
    is_prompt: bool
    seqlen_q: int
    seqlen_k: int  # context length after this step
    tokens: np.ndarray  # [seqlen_q] query tokens


def schedule(
    running: Iterable[RunningRequest],
    config: LoopConfig,
    starts_prefill: Callable[[RunningRequest], bool],
) -> list[ScheduledRequest]:
    """This step's work in batch order: decodes first, then prefill chunks.
    `starts_prefill(req)` runs before a request's first chunk (prefix sharing)
    and returns False when the request waits this step. Sets each request's
    `drafts` for the step."""
    running = list(running)
    budget = config.token_budget
    batch = []
    for req in running:
        if req.prefilled < len(req.prompt):
            continue
        drafts: list[int] = []
        generated = req.completion.tokens
        if config.max_draft_tokens:
            room = req.max_tokens - len(generated) - 1  # drafts past max_tokens are wasted
            k = min(config.max_draft_tokens, max(room, 0))
            if k:
                history = np.concatenate([req.prompt, np.asarray(generated, dtype=np.int64)])
                drafts = propose_ngram_drafts(history, k, config.ngram_max)
        req.drafts = drafts
        q = 1 + len(drafts)
        # The first query token is the last generated one, not yet in the cache.
        seqlen_k = len(req.prompt) + len(generated) + len(drafts)
        batch.append(ScheduledRequest(req, False, q, seqlen_k, np.asarray([generated[-1], *drafts], dtype=np.int64)))
        budget -= q
    for req in running:
        if req.prefilled >= len(req.prompt) or budget <= 0:
            continue
        if req.prefilled == 0 and not starts_prefill(req):
            continue  # waits for the request ahead of it to prefill the prefix they share
        chunk = min(len(req.prompt) - req.prefilled, budget)
        seqlen_k = req.prefilled + chunk
        req.drafts = []
        batch.append(ScheduledRequest(req, True, chunk, seqlen_k, req.prompt[req.prefilled : seqlen_k]))
        budget -= chunk
    return batch


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass(frozen=True)
class PrefixChoice:
    """What a request's first prefill chunk starts from."""

    length: int  # prompt tokens to copy (0: none)
    source: int | None  # the KV-cache slot holding them
    wait: bool  # none to copy yet, but a request ahead is prefilling a longer shared prefix


def choose_shared_prefix(
    req: RunningRequest,
    running: Sequence[RunningRequest],
    retained: Mapping[int, np.ndarray],
    min_shared_prefix: int,
) -> PrefixChoice:
    """The longest prefix of the request's prompt (at least `min_shared_prefix`
    tokens, or one token from a running sibling: a sample of the same n > 1
    request) that another running request's cache or a retained cache holds.
    Waiting only ever points ahead in the running order, and budget goes out
    in that order, so a wait ends."""
    if req.params.num_prompt_logprobs >= 0:
        return PrefixChoice(0, None, False)  # its prompt logprobs need every prompt position's logits
    limit = len(req.prompt) - 1  # the last prompt token is computed: its logits give the first token
    best, source, coming, ahead = 0, None, False, True
    for other in running:
        if other is req:
            ahead = False
            continue
        held = other.cached_tokens()
        # Siblings share the whole prompt: no length too short to be worth one prefill for n.
        minimum = 1 if req.family is not None and other.family == req.family else min_shared_prefix
        cached = min(common_prefix_length(req.prompt, held), limit)
        if cached >= minimum and cached > best:
            best, source = cached, other.kv_slot
        if ahead and len(held) < len(other.prompt):  # still prefilling: what it will hold
            coming |= min(common_prefix_length(req.prompt, other.prompt), limit) >= max(minimum, cached + 1)
    for slot, held in retained.items():
        cached = min(common_prefix_length(req.prompt, held), limit)
        if cached >= min_shared_prefix and cached > best:
            best, source = cached, slot
    return PrefixChoice(best, source, coming and not best)
