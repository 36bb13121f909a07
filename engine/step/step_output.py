"""What a step returns and how it gets out of the buffers: the copy out into
`CollectedRows` (`collect`), then `StepOutput` per request (`assemble`).

    output copy  the real rows of the static outputs, copied to the host before
                 the next replay overwrites them: one packed copy of every output
                 (`StepBuffers.output_copy`), the step's one read of the device
    rescoring    rejection mode: a residual draw's own logprob and rank, by the sampler
                 rerun on the row's scores with that token forced, in the row's mode
    StepOutput   a request emits the tokens of its rows up to and including the first
                 rejected draft (or the bonus row), none for a non-last prompt chunk,
                 and none at all when one of its rows failed (docs/contract.md §2):
                 `StepOutput.errors` then says why, naming the request.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from engine.host.ledger import SamplerInputs
from engine.ops import upload
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import RowError, sample
from engine.step.engine_config import EngineConfig
from engine.step.lm_head import full_sampler
from engine.step.prompt_logprobs import PromptLogprob
from engine.step.staging import StepArrays
from engine.step.static_buffers import StepBuffers
from engine.trace import stage

@dataclass
class CollectedRows:
    """A step's results on the host, copied out of the static outputs before the next replay."""

    tokens: np.ndarray  # [rows] int64: each sample row's token (rejection mode: the emitted one)
    logprob: np.ndarray  # [rows] f32: its logprob
    rank: np.ndarray  # [rows] int64
    error: np.ndarray  # [rows] int64 `RowError`
    top_ids: np.ndarray | None = None  # [rows, N] int64; None: no request asked for top logprobs
    top_logprobs: np.ndarray | None = None  # [rows, N] f32
    num_accepted: np.ndarray | None = None  # [n] int64: drafts accepted per request (`collect` sets it)
    counted_index: np.ndarray | None = None  # [rows] int64: flat penalty-count index each row added to, -1 none

    @classmethod
    def concatenate(cls, parts: Sequence[CollectedRows]) -> CollectedRows:
        """The parts of a step run a slice of requests at a time, in order."""
        if len(parts) == 1:
            return parts[0]
        joined = {f.name: [getattr(part, f.name) for part in parts] for f in fields(cls)}
        return cls(**{name: None if values[0] is None else np.concatenate(values) for name, values in joined.items()})


# After a replay, sample rows [k] int64 -> (their scores [k, V] f32, the unprocessed logits or None):
# `LMHead.scores_after` of the step that ran.
ScoresAfter = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


def collect(buffers: StepBuffers, config: EngineConfig, bucket: int, arrays: StepArrays, *,
            want_top: bool, want_logprobs: bool = True, counted: bool = False,
            scores_after: ScoresAfter | None = None) -> CollectedRows:
    """Copy the real rows out: per sample row tokens, logprob, rank, error (and
    top_ids / top_logprobs with `want_top`), per request num_accepted, per row the
    penalty counts' index. `counted`: the step added its tokens to the penalty
    counts (`CollectedRows.counted_index`). `scores_after`: the rows as the sampler
    saw them, for rescoring residual draws (rejection mode)."""
    b = buffers
    rows, n = len(arrays.row_to_req), len(arrays.temperatures)
    token_bitmask = b.token_bitmask if arrays.token_bitmask is not None else None  # the step's, staged
    with stage("output copy"):
        fetched = b.output_copy.fetch(wide=want_top)
        # The real rows, copied out of the pinned twin (the step after next overwrites it).
        got = fetched.take(rows, ("tokens", "logprob", "rank", "error") + (("top_ids", "top_logprobs") if want_top else ()))
        result = CollectedRows(*got[:4], *(got[4:] if want_top else (None, None)))
        k = config.max_draft_tokens
        result.num_accepted = fetched.rows("num_accepted", n) if k else np.zeros(n, np.int64)
        result.counted_index = fetched.rows("counted_index", rows) if counted else None
        if k and config.verify_mode == "rejection":
            emitted = fetched.rows("emitted", rows)
            # A failed row emits nothing: no residual draw to rescore.
            changed = np.flatnonzero((emitted >= 0) & (emitted != result.tokens) & (result.error == 0))
            if len(changed) and want_logprobs:
                # A residual draw is not the row's own draw: its logprob and rank differ. A second
                # read of the device this step, only when a row emits a residual draw.
                _rescore(b, config, bucket, scores_after, changed, emitted[changed], result,
                         token_bitmask=token_bitmask)
            result.tokens = np.where(emitted >= 0, emitted, result.tokens)
    return result


def _rescore(b: StepBuffers, config: EngineConfig, bucket: int, scores_after: ScoresAfter, rows: np.ndarray,
             tokens: np.ndarray, result: CollectedRows, *, token_bitmask: torch.Tensor | None) -> None:
    """Logprob and rank of `tokens` at sample `rows` (rejection mode's residual draws), in
    the row's logprobs mode: the sampler rerun on the rows' scores with each token forced,
    so a residual draw reports what its own draw would (raw: of the unprocessed logits;
    processed: of the distribution the row drew from)."""
    device = b.logits.device
    index = upload(rows, device)
    scores, unprocessed = scores_after(index)
    params = dataclasses.replace(b.params(bucket).rows(index), forced_tokens=upload(tokens, device))
    full = full_sampler(config.sampler, on_cpu=False)  # every stage, whole rows at once
    out = SampleOutput.allocate(len(rows), 0, device)
    sample(scores, params, full, out, unprocessed=unprocessed,
           token_bitmask=None if token_bitmask is None else token_bitmask[index])
    # One copy back: f64 holds the f32 logprob and the rank (< 2**53) exactly.
    both = torch.stack([out.logprob.to(torch.float64), out.rank.to(torch.float64)]).cpu().numpy()
    result.logprob[rows] = both[0]
    result.rank[rows] = both[1]


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
    """The StepOutput of a step from its collected rows (`collect`: per
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
