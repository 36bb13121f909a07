"""The host arrays one step stages into the static buffers, in batch order.

`StepArrays` holds what `StepBuffers.load` copies: the ledger's per-row and
per-request arrays under the names of the step-field declaration
(`graphs/step_fields.py`), plus the step's drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.host.ledger import SamplerInputs


@dataclass
class StepArrays:
    """Host arrays one step stages, in batch order (sample rows / requests)."""

    selected_token_indices: np.ndarray  # [rows] model-output row of each sample row
    row_to_req: np.ndarray  # [rows]
    local_step: np.ndarray  # [rows]
    eos_suppression_rows: np.ndarray  # sample rows with EOS / stop ids masked (min_tokens)
    temperatures: np.ndarray  # [n]
    top_ks: np.ndarray
    top_ps: np.ndarray
    min_ps: np.ndarray
    seeds: np.ndarray  # [n] uint64
    sample_positions: np.ndarray  # [n] int64
    stop_ids: np.ndarray  # [n, max_stop_ids] int64, -1 padded
    row_drafts: np.ndarray | None = None  # [rows] int64: draft, -1 none, READ_FROM_POOL
    mtp_info_read_rows: np.ndarray | None = None  # [rows]
    has_draft_probs: np.ndarray | None = None  # [rows] bool
    draft_probs: dict[int, torch.Tensor] | None = None  # first sample row -> [k, V] q of its drafts
    mtp_info_write_slots: np.ndarray | None = None  # [n]
    next_draft_tokens: np.ndarray | None = None  # [n, max_draft]
    next_draft_logprobs: np.ndarray | None = None  # [n, max_draft]

    @classmethod
    def from_inputs(cls, inputs: SamplerInputs, stop_ids: np.ndarray) -> StepArrays:
        return cls(
            selected_token_indices=inputs.selected_token_indices,
            row_to_req=inputs.row_to_req,
            local_step=inputs.local_step,
            eos_suppression_rows=inputs.eos_suppression_rows,
            temperatures=inputs.temperatures,
            top_ks=inputs.top_ks,
            top_ps=inputs.top_ps,
            min_ps=inputs.min_ps,
            seeds=inputs.seeds,
            sample_positions=inputs.sample_positions,
            stop_ids=stop_ids,
        )

    def requests(self, a: int, b: int, sample_offsets: np.ndarray, sample_counts: np.ndarray) -> StepArrays:
        """The arrays of requests [a, b), renumbered from 0."""
        r0 = int(sample_offsets[a])
        r1 = int(sample_offsets[b - 1] + sample_counts[b - 1])
        per_row = ("selected_token_indices", "row_to_req", "local_step", "row_drafts", "mtp_info_read_rows", "has_draft_probs")
        per_req = ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "sample_positions", "stop_ids", "mtp_info_write_slots",
                   "next_draft_tokens", "next_draft_logprobs")
        part = {name: None if getattr(self, name) is None else getattr(self, name)[r0:r1] for name in per_row}
        part.update({name: None if getattr(self, name) is None else getattr(self, name)[a:b] for name in per_req})
        part["row_to_req"] = part["row_to_req"] - a
        part["eos_suppression_rows"] = self.eos_suppression_rows[(self.eos_suppression_rows >= r0) & (self.eos_suppression_rows < r1)] - r0
        part["draft_probs"] = (
            None if self.draft_probs is None
            else {row - r0: q for row, q in self.draft_probs.items() if r0 <= row < r1}
        )
        return StepArrays(**part)
