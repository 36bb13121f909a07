"""After the replay: the copy out, and the rows a head's graph left to the host.

    exact rows   only for a head whose sampler can flag rows (the vocab-parallel
                 candidate exchange, when a tie reaches past its candidates):
                 redone by the eager reference path, drafts re-verified against
                 them. The local head decides every row inside the graph.
    output copy  the real rows of the static outputs, copied to the host before
                 the next replay overwrites them
    rescoring    rejection mode: a residual draw's own logprob and rank, by the sampler
                 rerun on the row's scores with that token forced, in the row's mode
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from engine.sampling.exact import sample_exact
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import sample
from engine.step.body import verify_drafts
from engine.step.config import EngineConfig, EngineStats
from engine.step.controls import SamplingControls
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

    @classmethod
    def concatenate(cls, parts: Sequence[CollectedRows]) -> CollectedRows:
        """The parts of a step run a slice of requests at a time, in order."""
        joined = {f.name: [getattr(part, f.name) for part in parts] for f in fields(cls)}
        return cls(**{name: None if values[0] is None else np.concatenate(values) for name, values in joined.items()})


# After a replay, sample rows [k] int64 -> (their scores [k, V] f32, the unprocessed logits or None):
# `LMHead.scores_after` of the graph set that ran.
ScoresAfter = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


def collect(buffers: StepBuffers, config: EngineConfig, bucket: int, arrays: StepArrays, stats: EngineStats, *,
            want_top: bool, want_logprobs: bool = True, controls: SamplingControls | None = None,
            exact_rows: bool = False, scores_after: ScoresAfter | None = None) -> CollectedRows:
    """Redo flagged rows exactly, re-verify if needed, and copy the real rows
    out: per sample row tokens, logprob, rank, error (and top_ids /
    top_logprobs with `want_top`), per request num_accepted.
    `controls`: the sampling-control state when the step ran a controls
    graph (`buffers.logits` hold the controlled logits, raw logprobs come
    from its unprocessed ones, and the counts follow the exact rows' draws).
    `exact_rows`: whether the head's sampler may have flagged rows (False:
    nothing is read before the output copy). `scores_after`: the rows as the
    sampler saw them, for rescoring residual draws (rejection mode)."""
    b = buffers
    rows, capacity, n = len(arrays.row_to_req), b.rows_for(bucket), len(arrays.temperatures)
    params, out = b.params(bucket), b.outputs(capacity)
    token_bitmask = b.token_bitmask if arrays.token_bitmask is not None else None  # the step's, staged
    with stage("exact rows"):
        flags = out.needs_exact[:rows].cpu() if exact_rows else None
        if flags is not None and bool(flags.any()):
            index = torch.nonzero(flags).flatten()
            sample_exact(b.logits[:capacity], params, config.sampler, index, out, compute_logprobs=want_logprobs,
                         unprocessed=None if controls is None else controls.unprocessed[:capacity],
                         token_bitmask=None if token_bitmask is None else token_bitmask[:capacity])
            stats.exact_rows += len(index)
            if config.max_draft_tokens:
                # The drafts were checked against the candidate exchange's draws.
                verify_drafts(b, config, bucket, token_bitmask)
            if controls is not None:
                controls.recount(b, config, bucket)  # the graph counted the flagged rows' first draws
    with stage("output copy"):
        result = _host_results(b.outputs(rows), want_top=want_top)
        k = config.max_draft_tokens
        result.num_accepted = b.num_accepted[:n].to("cpu", copy=True).numpy() if k else np.zeros(n, np.int64)
        if k and config.verify_mode == "rejection":
            emitted = b.emitted[:rows].to("cpu", copy=True).numpy()
            # A failed row emits nothing: no residual draw to rescore.
            changed = np.flatnonzero((emitted >= 0) & (emitted != result.tokens) & (result.error == 0))
            if len(changed) and want_logprobs:
                # A residual draw is not the row's own draw: its logprob and rank differ.
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
    index = torch.as_tensor(rows, dtype=torch.int64, device=device)
    scores, unprocessed = scores_after(index)
    params = b.params(bucket).rows(index)
    params = dataclasses.replace(params, forced_tokens=torch.as_tensor(tokens, dtype=torch.int64, device=device))
    full = dataclasses.replace(config.sampler, stages="filters", top_k="radix", top_p=True, chunk_rows=0)
    out = SampleOutput.allocate(len(rows), 0, device)
    sample(scores, params, full, out, unprocessed=unprocessed,
           token_bitmask=None if token_bitmask is None else token_bitmask[index])
    result.logprob[rows] = out.logprob.cpu().numpy()
    result.rank[rows] = out.rank.cpu().numpy()


def _host_results(out: SampleOutput, *, want_top: bool) -> CollectedRows:
    """Copy the real rows of the outputs to the host. A copy also on CPU, where
    `.cpu()` would return the static buffer itself and the next step would
    overwrite the results under the caller's feet."""

    def host(tensor: torch.Tensor) -> np.ndarray:
        return tensor.to("cpu", copy=True).numpy()

    return CollectedRows(tokens=host(out.tokens), logprob=host(out.logprob), rank=host(out.rank), error=host(out.error),
                         top_ids=host(out.top_ids) if want_top else None,
                         top_logprobs=host(out.top_logprobs) if want_top else None)
