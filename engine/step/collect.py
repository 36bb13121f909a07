"""After the replay: the copy out, and the rescoring of residual draws.

    output copy  the real rows of the static outputs, copied to the host before
                 the next replay overwrites them: one packed copy of every output
                 (engine/step/transfer.py), the step's one read of the device
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

from engine.ops import upload
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import sample
from engine.step.engine_config import EngineConfig
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
    full = dataclasses.replace(config.sampler, stages="filters", top_k="radix", top_p=True, chunk_rows=0)
    out = SampleOutput.allocate(len(rows), 0, device)
    sample(scores, params, full, out, unprocessed=unprocessed,
           token_bitmask=None if token_bitmask is None else token_bitmask[index])
    # One copy back: f64 holds the f32 logprob and the rank (< 2**53) exactly.
    both = torch.stack([out.logprob.to(torch.float64), out.rank.to(torch.float64)]).cpu().numpy()
    result.logprob[rows] = both[0]
    result.rank[rows] = both[1]

