"""What a step returns: `StepOutput` per request, built from the collected rows.

A request emits the tokens of its rows up to and including the first rejected
draft (or the bonus row), none for a non-last prompt chunk, and none at all
when one of its rows failed (docs/contract.md §2): `StepOutput.errors` then
says why, naming the request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, NamedTuple

import numpy as np

from engine.host.ledger import SamplerInputs
from engine.sampling.errors import RowError
from engine.step.collect import CollectedRows
from engine.step.prompt_logprobs import PromptLogprob

# StepOutput.errors causes of a failed sample row (`RowError` codes).
ROW_ERROR_CAUSES = {
    RowError.LOGITS_NOT_FINITE: "logits row not finite (NaN or inf)",
    RowError.NOTHING_LEFT: "no token left after the sampling controls (EOS/stop suppression)",
    RowError.HIDDEN_NOT_FINITE: "hidden state not finite",
    RowError.NO_TOKEN_ALLOWED: "no token allowed by the token bitmask (structured output or bad words)",
    RowError.SCORES_NOT_FINITE: ("the sampling controls made a logit +inf or NaN (a repetition_penalty near 0 "
                                 "or a huge logit_bias on a large logit)"),
}


class TokenLogprob(NamedTuple):
    """Logprob of one emitted token: its value, its rank, and the top-N alternatives."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass
class StepOutput:
    """Per request, in batch order."""

    request_ids: tuple[Hashable, ...]
    tokens: list[list[int]]  # emitted this step; empty for a non-last prefill chunk
    logprobs: list[list[TokenLogprob] | None]  # one per emitted token, None when not requested
    prompt_logprobs: list[list[PromptLogprob] | None]  # docs/contract.md §1.1: None / [] / the full list
    seeds: list[int]  # the seed each request sampled with
    num_accepted: list[int]  # drafts accepted per request (0 without drafts)
    bucket: int | None  # graph bucket used, None for an eager fallback
    replayed: bool  # True when a captured graph ran
    # None, or "request {id!r}: <cause>" for a request that failed this step
    # (non-finite hidden state or logits, no token left after the sampling
    # controls, non-finite prompt logprobs). A failed request emits nothing:
    # tokens [], logprobs [] (None when not requested), prompt_logprobs None,
    # num_accepted 0, and its accumulated prompt logprobs are dropped.
    errors: list[str | None] = field(default_factory=list)

    @classmethod
    def empty(cls) -> StepOutput:
        """The output of a step with no request."""
        return cls((), [], [], [], [], [], None, False, [])


def row_errors(inputs: SamplerInputs, row_error: np.ndarray) -> list[str | None]:
    """Per request, "request {id!r}: <cause>" of its first failed sample row
    (`row_error` [rows] `RowError` codes), or None. A non-last prompt chunk's
    token is discarded, so that no token was left for it fails nothing."""
    errors: list[str | None] = [None] * inputs.num_reqs
    for r in np.flatnonzero(row_error):
        i = int(inputs.row_to_req[r])
        code = RowError(int(row_error[r]))
        if errors[i] is not None or (code == RowError.NOTHING_LEFT and inputs.is_prompt[i] and not inputs.is_last_chunk[i]):
            continue
        errors[i] = f"request {inputs.request_ids[i]!r}: {ROW_ERROR_CAUSES[code]}"
    return errors


def assemble(
    inputs: SamplerInputs,
    result: CollectedRows,
    prompt_lp: list[list[PromptLogprob] | None],
    errors: list[str | None],
    bucket: int | None,
    replayed: bool,
) -> StepOutput:
    """The StepOutput of a step from its collected rows (`engine.step.collect`: per
    sample row tokens, logprob, rank, top ids / logprobs; per request num_accepted)."""
    tokens, logprobs, num_accepted = [], [], []
    drawn = result.tokens
    for i in range(inputs.num_reqs):
        if errors[i] is not None:
            # A failed request emits nothing; its placeholder rows stay inside.
            num_accepted.append(0)
            tokens.append([])
            logprobs.append([] if inputs.num_logprobs[i] >= 0 else None)
            continue
        lo = int(inputs.sample_offsets[i])
        # Row j's token is keyed by the position it produces, exactly as in
        # plain decoding; rows past the first rejected draft emit nothing.
        accepted = int(result.num_accepted[i]) if not inputs.is_prompt[i] else 0
        num_accepted.append(accepted)
        if inputs.is_prompt[i] and not inputs.is_last_chunk[i]:
            emitted = range(0)  # the token sampled for a non-last chunk is discarded
        else:
            emitted = range(lo, lo + accepted + 1)
        tokens.append(drawn[emitted.start : emitted.stop].tolist())
        n_top = int(inputs.num_logprobs[i])
        if n_top < 0:
            logprobs.append(None)
            continue
        logprobs.append(
            [
                TokenLogprob(
                    int(result.tokens[r]),
                    float(result.logprob[r]),
                    int(result.rank[r]),
                    tuple(zip(result.top_ids[r, :n_top].tolist(), result.top_logprobs[r, :n_top].tolist()))
                    if n_top
                    else (),
                )
                for r in emitted
            ]
        )
    return StepOutput(
        request_ids=inputs.request_ids,
        tokens=tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_lp,
        seeds=[int(s) for s in inputs.seeds],
        num_accepted=num_accepted,
        bucket=bucket,
        replayed=replayed,
        errors=errors,
    )
