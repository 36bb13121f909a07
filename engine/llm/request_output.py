"""What `LLM.generate` returns, in vLLM's shape and names: one `RequestOutput` per
prompt, holding its `CompletionOutput`s (n of them for `SamplingParams(n=...)`).

Logprobs come as vLLM gives them: per generated token a dict token id ->
`Logprob` (the sampled token and the top-N alternatives); prompt logprobs per
prompt position, the first one None (nothing precedes it to score it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from engine.loop.requests import Completion
from engine.models.tokenizer import HFProtocol
from engine.step.step_output import TokenLogprob
from engine.step.prompt_logprobs import PromptLogprob

# vLLM's sample and prompt logprobs: per position, token id -> its Logprob.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list["dict[int, Logprob] | None"]


class Logprob(NamedTuple):
    """One token's log-probability at one position, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; None where unknown
    decoded_token: str | None = None  # the token's text, when the LLM has a tokenizer


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's `CompletionOutput`, plus the seed it used)."""

    index: int  # which of the prompt's n samples
    text: str  # "" when the LLM has no tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: SampleLogprobs | None
    finish_reason: str | None  # "stop" (EOS, a stop id or a stop string), "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop id that ended it; None for EOS
    seed: int | None = None  # rerun with SamplingParams(seed=...) to reproduce this sample
    error: str | None = None  # finish_reason "error": why this request failed (the others are untouched)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt and what it generated (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None  # the text as given (a chat is rendered through the template); None for token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True


def _token_text(tokenizer: HFProtocol | None, token: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def _position(entry: TokenLogprob | PromptLogprob, tokenizer: HFProtocol | None) -> dict[int, Logprob]:
    """One position: the chosen (or prompt) token first, then the top-N alternatives."""
    out = {entry.token: Logprob(entry.logprob, entry.rank, _token_text(tokenizer, entry.token))}
    for rank, (token, logprob) in enumerate(entry.top, start=1):
        if token not in out:
            out[token] = Logprob(logprob, rank, _token_text(tokenizer, token))
    return out


def completion_output(index: int, completion: Completion, tokenizer: HFProtocol | None) -> CompletionOutput:
    logprobs = None if completion.logprobs is None else [_position(lp, tokenizer) for lp in completion.logprobs]
    cumulative = None if completion.logprobs is None else float(sum(lp.logprob for lp in completion.logprobs))
    return CompletionOutput(index, completion.text or "", list(completion.tokens), cumulative, logprobs,
                            completion.finish_reason, completion.stop_reason, completion.seed, completion.error)


def request_output(
    request_id: str, prompt: str | None, completions: Sequence[Completion], tokenizer: HFProtocol | None
) -> RequestOutput:
    """The `RequestOutput` of one prompt's completions (one, or its n samples in order)."""
    first = completions[0]
    prompt_logprobs = None
    if first.prompt_logprobs is not None:
        # The first prompt token has no logprob: vLLM puts None there.
        prompt_logprobs = [None, *(_position(lp, tokenizer) for lp in first.prompt_logprobs)]
    outputs = [completion_output(j, c, tokenizer) for j, c in enumerate(completions)]
    return RequestOutput(request_id, prompt, list(first.prompt_tokens), prompt_logprobs, outputs)
