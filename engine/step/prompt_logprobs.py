"""Prompt logprobs (docs/contract.md §1.1, §3): for every prompt-logprob row, the logprob
and rank of the prompt token it predicts, plus optional top-N alternatives.

Runs eagerly, outside the captured graph (host syncs are fine here), over
fixed chunks of rows so the peak logits tensor is [chunk_rows, vocab] however
long the prompt. `PromptLogprobAccumulator` keeps each request's values across
the chunks of a chunked prefill and hands them over once, with the last chunk.

Definitions, per row (logits are the raw fp32 LM-head output), those of the
sampler's raw logprobs (`engine.sampling.logprobs`), so a prompt token scores
exactly as a sampled one would from the same logits:
- logprob: log-softmax of the logits at the target token, with the sampler's
  fixed-block normaliser;
- rank: 1 + the number of tokens with a strictly larger logit (ties share a
  rank), always counted over the whole vocabulary;
- top-N: the N largest logits, best first, ties to the smaller token id (so the
  list does not depend on a kernel's tie order); N larger than the vocabulary
  gives the whole vocabulary.
Top-k-space mode restricts each row's distribution to its top-k (docs/contract.md §2:
every token whose logit is >= the k-th largest, so ties at the cut stay in) and
renormalises over it; a target outside reads logprob -inf (its rank, over the
whole vocabulary, is then > k). k = 0 leaves the row unrestricted.

A row whose logits are not all finite (a NaN or inf hidden state upstream) is
flagged in `PromptRowResults.finite`; the accumulator fails its request
instead of handing over a NaN. Rows are computed independently, so a bad row
changes no other row's values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import numpy as np
import torch

from engine.host.ledger import SamplerInputs
from engine.ops import BlockGemm, gather, get_logits, upload
from engine.sampling.filters import top_k_mask
from engine.sampling.logprobs import token_logprobs, top_n_ids
from engine.sampling.thresholds import raw_log_normaliser

DEFAULT_CHUNK_ROWS = 8192


class PromptLogprob(NamedTuple):
    """One prompt position: the token at it and how the model scored it."""

    token: int  # the prompt token this row predicts
    logprob: float  # -inf in top-k space when the token is outside the row's top-k
    rank: int  # 1 + number of tokens with a strictly larger logit
    top: tuple[tuple[int, float], ...]  # top-N (token, logprob), best first


@dataclass(frozen=True)
class PromptRowResults:
    """Per prompt-logprob row, in row order. Host numpy arrays."""

    targets: np.ndarray  # [rows] int32
    logprobs: np.ndarray  # [rows] float32
    ranks: np.ndarray  # [rows] int64
    num_top: np.ndarray  # [rows] int32: leading columns of top_* that belong to the row
    top_ids: np.ndarray  # [rows, max_top] int64
    top_logprobs: np.ndarray  # [rows, max_top] float32
    finite: np.ndarray  # [rows] bool: the row's logits were all finite (else its values mean nothing)

    @classmethod
    def allocate(cls, targets: np.ndarray, num_top: np.ndarray, vocab: int) -> PromptRowResults:
        """Room for rows with these `targets` [n] and top-N counts `num_top` [n]
        (clamped to `vocab`), to be filled chunk by chunk with `score`."""
        n = len(targets)
        num_top = np.minimum(num_top, vocab).astype(np.int32)
        max_top = int(num_top.max()) if n else 0
        return cls(
            targets=np.asarray(targets, dtype=np.int32),
            logprobs=np.empty(n, dtype=np.float32),
            ranks=np.empty(n, dtype=np.int64),
            num_top=num_top,
            top_ids=np.zeros((n, max_top), dtype=np.int64),
            top_logprobs=np.zeros((n, max_top), dtype=np.float32),
            finite=np.empty(n, dtype=bool),
        )

    def score(self, start: int, logits: torch.Tensor, row_top_k: torch.Tensor | None = None) -> None:
        """Fill rows [start, start + chunk) from their logits.

        Parameters: `logits` [chunk, V] f32, the rows' raw logits (any
        device); `row_top_k` [chunk] int64 per-row k of top-k-space mode
        (0 = off), None: off for every row.
        """
        stop = start + logits.shape[0]
        self.finite[start:stop] = torch.isfinite(logits).all(1).cpu().numpy()
        target = upload(self.targets[start:stop].astype(np.int64), logits.device)
        kept = None if row_top_k is None else top_k_mask(logits, row_top_k, max(1, int(row_top_k.max())))
        log_norm = raw_log_normaliser(logits, logits.amax(-1), kept)  # [chunk] f64
        # Rank and top-N come from the raw logits; both are unchanged by the
        # top-k restriction (it only drops tokens ranked after the kept ones).
        logprob, rank = token_logprobs(logits, target, log_normaliser=log_norm)
        if kept is not None:
            logprob = torch.where(kept.gather(1, target[:, None]).squeeze(1), logprob, -math.inf)
        self.logprobs[start:stop] = logprob.cpu().numpy()
        self.ranks[start:stop] = rank.cpu().numpy()
        chunk_top = int(self.num_top[start:stop].max())
        if chunk_top:
            ids = top_n_ids(logits, chunk_top)  # [chunk, chunk_top]
            top_logprobs = logits.gather(1, ids).to(torch.float64) - log_norm[:, None]
            if kept is not None:
                top_logprobs = torch.where(kept.gather(1, ids), top_logprobs, -math.inf)
            self.top_ids[start:stop, :chunk_top] = ids.cpu().numpy()
            self.top_logprobs[start:stop, :chunk_top] = top_logprobs.cpu().numpy()

    def entries(self, start: int, stop: int) -> list[PromptLogprob]:
        """Rows [start, stop) as per-token results."""
        entries = []
        for r in range(start, stop):
            n = self.num_top[r]
            top = tuple(zip(self.top_ids[r, :n].tolist(), self.top_logprobs[r, :n].tolist()))
            entries.append(PromptLogprob(int(self.targets[r]), float(self.logprobs[r]), int(self.ranks[r]), top))
        return entries


def prompt_rows_of(inputs: SamplerInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's prompt-logprob rows: model-output rows [n], target tokens [n]
    and each row's top-N [n] (its request's), empty when no chunk asks."""
    rows, targets = inputs.selected_prompt_indices, inputs.prompt_token_targets
    if rows is None:
        rows = targets = np.zeros(0, dtype=np.int32)
    return rows, targets, np.repeat(np.maximum(inputs.num_prompt_logprobs, 0), inputs.prompt_row_counts)


def compute_prompt_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    inputs: SamplerInputs,
    *,
    top_k: np.ndarray | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    batch_invariant: bool = False,
    kernel: BlockGemm | None = None,
) -> PromptRowResults:
    """Prompt logprobs for the step's prompt rows (`inputs.selected_prompt_indices`,
    targets `inputs.prompt_token_targets`), each request's own top-N.

    `hidden_states` is the step's [num_output_rows, H] model output. `top_k`
    ([num_reqs] int, 0 = off) switches on top-k-space mode per request; use
    `prompt_row_logprobs` for a per-row k. `kernel`: the batch-invariant block
    GEMM of `lm_head_weight` to run (the engine passes the one its probe
    verified, `engine.invariance`); None: `get_logits`' unchecked default.
    """
    counts = inputs.prompt_row_counts
    rows, targets, num_top = prompt_rows_of(inputs)
    vocab = lm_head_weight.shape[0]
    if len(targets) and targets.max() >= vocab:
        bad = int(np.flatnonzero(targets >= vocab)[0])
        req = int(np.searchsorted(np.cumsum(counts), bad, side="right"))
        raise ValueError(
            f"request {inputs.request_ids[req]!r}: prompt token {int(targets[bad])} is outside the vocabulary"
            f" (lm_head_weight has {vocab} rows)"
        )
    row_top_k = None
    if top_k is not None:
        top_k = np.asarray(top_k)
        if top_k.shape != (inputs.num_reqs,):
            raise ValueError(f"top_k: shape {top_k.shape}, expected one k per request ({inputs.num_reqs},)")
        if len(top_k) and top_k.min() < 0:
            req = int(np.argmin(top_k))
            raise ValueError(f"request {inputs.request_ids[req]!r}: top_k={int(top_k[req])}: must be >= 0 (0 = off)")
        row_top_k = np.repeat(top_k, counts)
    return prompt_row_logprobs(
        hidden_states,
        lm_head_weight,
        rows,
        targets,
        num_top,
        row_top_k=row_top_k,
        chunk_rows=chunk_rows,
        batch_invariant=batch_invariant,
        kernel=kernel,
    )


def prompt_row_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    rows: np.ndarray,
    targets: np.ndarray,
    num_top: np.ndarray,
    *,
    row_top_k: np.ndarray | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    batch_invariant: bool = False,
    kernel: BlockGemm | None = None,
) -> PromptRowResults:
    """The chunked computation over explicit rows: `rows` [n] model-output rows,
    `targets` [n] token ids, `num_top` [n] top-N per row, `row_top_k` [n] per-row
    k for top-k-space mode (0 = off)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}: must be >= 1")
    device = lm_head_weight.device
    results = PromptRowResults.allocate(targets, num_top, lm_head_weight.shape[0])
    for start in range(0, len(rows), chunk_rows):
        stop = min(start + chunk_rows, len(rows))
        hidden = gather(hidden_states, upload(np.asarray(rows[start:stop], np.int64), device))
        logits = get_logits(hidden, lm_head_weight, batch_invariant=batch_invariant, kernel=kernel)  # [chunk, vocab] fp32
        k = None if row_top_k is None else upload(np.asarray(row_top_k[start:stop], np.int64), device)
        results.score(start, logits, k)
    return results


def _prompt_chunks(inputs: SamplerInputs) -> np.ndarray:
    """Requests whose step is a prompt chunk with prompt logprobs on."""
    return np.flatnonzero(inputs.is_prompt & (inputs.num_prompt_logprobs >= 0))


def _chunk_start(inputs: SamplerInputs, i: int) -> int:
    # sample_positions is seqlen_k for a prefill chunk, and with prompt
    # logprobs on there is no compaction, so out_lens is seqlen_q.
    return int(inputs.sample_positions[i]) - int(inputs.out_lens[i])


@dataclass(frozen=True)
class PromptLogprobUpdate:
    """One step's effect on the accumulator, computed without changing it (`commit` applies it)."""

    handed_over: list[list[PromptLogprob] | None]  # per request, what StepOutput.prompt_logprobs reports
    errors: list[str | None]  # per request: why its prompt logprobs failed, or None
    keep: dict[Hashable, list[PromptLogprob]]  # partial values to hold until the next chunk
    drop: tuple[Hashable, ...]  # requests whose partial values go (finished or failed)


class PromptLogprobAccumulator:
    """Each request's prompt logprobs across the chunks of a chunked prefill.

    Per request in batch order a step hands over: None when the request did
    not ask (or the step is not one of its prompt chunks) or failed; an empty
    list for a non-last chunk (asked, nothing to hand over yet); the complete
    list of prompt_len - 1 values on the last chunk (empty for a one-token
    prompt).

    A step uses it in three parts so that nothing changes unless the whole
    step succeeds: `check` before the step touches anything, `update` once
    the values are computed (pure), `commit` after the step's output is built.
    """

    def __init__(self) -> None:
        # request id -> the prompt logprobs of its chunks so far (read-only outside; a commit
        # replaces a request's list, never extends it, so a shallow copy is a snapshot)
        self.partial: dict[Hashable, list[PromptLogprob]] = {}

    def check(self, inputs: SamplerInputs) -> None:
        """Raise ValueError when a chunk does not continue what was accumulated
        (a chunk skipped or repeated); changes nothing."""
        for i in _prompt_chunks(inputs):
            request_id = inputs.request_ids[i]
            chunk_start = _chunk_start(inputs, i)
            # A chunk at position 0 starts the prompt afresh (also after a preemption).
            held = len(self.partial.get(request_id, ())) if chunk_start else 0
            if held != chunk_start:
                raise ValueError(
                    f"request {request_id!r}: prompt chunk starts at position {chunk_start} but {held}"
                    " prompt logprobs were accumulated (a chunk was skipped or repeated)"
                )

    def update(self, inputs: SamplerInputs, results: PromptRowResults, failed: np.ndarray) -> PromptLogprobUpdate:
        """The step's hand-over and new partial values, for requests that
        passed `check`. `failed` [n] bool: requests that failed elsewhere in
        the step; they, and requests with a non-finite row, hand over None and
        lose their partial values."""
        if len(results.targets) != inputs.num_prompt_rows:
            raise ValueError(
                f"results: {len(results.targets)} rows for a step with {inputs.num_prompt_rows} prompt rows"
            )
        prompt_offsets = np.cumsum(inputs.prompt_row_counts) - inputs.prompt_row_counts
        handed_over: list[list[PromptLogprob] | None] = [None] * inputs.num_reqs
        errors: list[str | None] = [None] * inputs.num_reqs
        keep: dict[Hashable, list[PromptLogprob]] = {}
        drop = []
        for i in _prompt_chunks(inputs):
            request_id = inputs.request_ids[i]
            chunk_start = _chunk_start(inputs, i)
            lo, hi = int(prompt_offsets[i]), int(prompt_offsets[i] + inputs.prompt_row_counts[i])
            bad = np.flatnonzero(~results.finite[lo:hi])
            if failed[i] or len(bad):
                if len(bad):
                    # Row j of the chunk scores the prompt token at chunk_start + j + 1.
                    errors[i] = f"prompt logprobs not finite at prompt position {chunk_start + int(bad[0]) + 1}"
                drop.append(request_id)
                continue
            partial = list(self.partial.get(request_id, [])) if chunk_start else []
            partial.extend(results.entries(lo, hi))
            handed_over[i] = partial if inputs.is_last_chunk[i] else []
            if inputs.is_last_chunk[i]:
                drop.append(request_id)
            else:
                keep[request_id] = partial
        return PromptLogprobUpdate(handed_over, errors, keep, tuple(drop))

    def add(self, inputs: SamplerInputs, results: PromptRowResults) -> list[list[PromptLogprob] | None]:
        """`check`, `update` and `commit` in one call, for a caller with no
        larger step to keep atomic; returns the hand-over."""
        self.check(inputs)
        update = self.update(inputs, results, np.zeros(inputs.num_reqs, dtype=bool))
        self.commit(update)
        return update.handed_over

    def commit(self, update: PromptLogprobUpdate) -> None:
        for request_id in update.drop:
            self.partial.pop(request_id, None)
        self.partial.update(update.keep)

    def snapshot(self) -> dict[Hashable, list[PromptLogprob]]:
        """The partial values, for `restore` (a commit replaces lists, never extends them)."""
        return dict(self.partial)

    def restore(self, snapshot: dict[Hashable, list[PromptLogprob]]) -> None:
        self.partial = dict(snapshot)

    def discard(self, request_id: Hashable) -> None:
        """Forget a request's partial values (aborted mid-prefill)."""
        self.partial.pop(request_id, None)

    @property
    def pending(self) -> tuple[Hashable, ...]:
        """Requests holding partial values (between prompt chunks)."""
        return tuple(self.partial)
