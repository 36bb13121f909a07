"""EOS / stop-id suppression (docs/contract.md §2): which tokens a row must not produce.

While a request has generated fewer than `min_tokens` tokens, its rows flagged
in `eos_suppression_rows` give the EOS / stop ids -inf (EOS even under
`ignore_eos`, as vLLM). One definition, `suppressed_at`, decides whether a
(row, token id) pair is suppressed; the sampler applies it to whole rows in
place (`suppress_stop_ids_`, undone by `StopSlots.restore`; verification to a
copy, `suppressed_scores`).

Duplicate slots. A row's stop-id slots may name the same id twice, and a
padding slot (-1, clamped to 0) lands on token 0 even when 0 is a real,
suppressed stop id. Scatter order is unspecified on CUDA, so every scatter
of a verdict writes a value that depends only on the target token, never on
which slot wrote it: duplicates always agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.rows import SamplingRows


def suppressed_at(ids: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Whether each token id is suppressed on its row.

    Parameters: `ids` [rows, M] int64 token ids (a row's own stop-id slots); `rows` the rows' controls. Returns: [rows, M] bool.
    Capture-safe.
    """
    return ((ids[:, :, None] == rows.stop_ids[:, None, :]) & rows.stop_active[:, None, :]).any(-1)


def suppressed_scores(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """`scores` [rows, V] f32 with suppressed stop ids at -inf: a new tensor
    (a copy and a scatter of the few stop-id slots). Capture-safe."""
    vocab = scores.shape[1]
    slots = rows.stop_ids.clamp(max=vocab - 1)  # [rows, S]
    # Every slot naming the same token writes the same value (see above).
    value = torch.where(suppressed_at(slots, rows), -math.inf, scores.gather(1, slots))
    return scores.clone().scatter_(1, slots, value)


@dataclass
class StopSlots:
    """The stop-id slots `suppress_stop_ids_` wrote, and what they held before."""

    scores: torch.Tensor  # [rows, V] f32: the suppressed scores (the caller's, or a copy)
    slots: torch.Tensor  # [rows, S] int64: each row's stop ids, clamped into the vocabulary
    before: torch.Tensor  # [rows, S] f32: the scores at the slots before (NaN and inf as they were)

    def restore(self) -> None:
        """Write the slots' values back into `scores` (a duplicate slot writes the one value
        it read); capture-safe. After it, `scores` are what `suppress_stop_ids_` was given."""
        self.scores.scatter_(1, self.slots, self.before)


def suppress_stop_ids_(scores: torch.Tensor, rows: SamplingRows) -> StopSlots:
    """`suppressed_scores` without the copy: the suppressed stop ids of `scores` [rows, V]
    f32 set to -inf in place (a gather and a scatter of the few stop-id slots). A whole-row
    copy costs about as much as `exp` over the rows on a CPU (1 ms per [64, 49152]). A
    `scores` whose rows are not dense in memory gets `suppressed_scores`' copy instead.
    Returns: `StopSlots`: the suppressed scores (`scores` itself, or the copy), and what
    its `restore` needs to give `scores` its values back. Capture-safe."""
    vocab = scores.shape[1]
    slots = rows.stop_ids.clamp(max=vocab - 1)  # [rows, S]
    before = scores.gather(1, slots)
    if not scores.is_contiguous():
        return StopSlots(suppressed_scores(scores, rows), slots, before)
    # Duplicate slots name one token, so they gather, suppress and restore one value.
    scores.scatter_(1, slots, torch.where(suppressed_at(slots, rows), -math.inf, before))
    return StopSlots(scores, slots, before)
