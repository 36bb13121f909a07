"""Which requests run in a step, with how many query tokens.

Decodes first (1 + drafts each, drafts from the n-gram drafter), then prefill
chunks with the rest of the token budget, in running order. Before its first
chunk a request may copy a prompt prefix another cache holds
(`choose_shared_prefix`) or wait a step for the request ahead of it that is
prefilling that prefix. The samples of one request with n > 1 share their
prompt whatever its length: the first computes it, the others copy it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from engine.loop.loop_config import LoopConfig
from engine.loop.drafter import propose_ngram_drafts
from engine.loop.requests import RunningRequest


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
