"""The host arrays one step stages into the static buffers, in batch order.

`StepArrays` holds what `StepBuffers.load` copies: one attribute per
declared per-step field (`engine/host/step_fields.py`), under the same
names and in the same order (tests/test_step_fields.py holds them equal),
plus the drafts' distributions for the rejection-mode buffer, which travel
in copies of their own, and the token bitmask, which rides the same copy
after the fields. `from_inputs` and the split into parts derive from the
declaration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.host.draw_uniforms import staged_draw_uniforms
from engine.host.ledger import SamplerInputs
from engine.host.step_fields import FROM_LEDGER_FIELDS, STEP_FIELDS

if TYPE_CHECKING:
    import torch


@dataclass
class StepArrays:
    """Host arrays one step stages, in batch order (sample rows / requests).

    Per-row fields have one entry per sample row, per-request ones one per
    request (`stop_ids` [n, max_stop_ids], the next drafts [n, max_draft]);
    `eos_suppression_rows` lists row numbers, as the ledger hands them. A
    field left None stages padding only (no drafts, no forced token, ...)."""

    # The declared per-step fields (engine/host/step_fields.py), in its order.
    selected_token_indices: np.ndarray | None = None  # [rows] model-output row of each sample row
    row_to_req: np.ndarray | None = None  # [rows]
    local_step: np.ndarray | None = None  # [rows]
    sample_positions: np.ndarray | None = None  # [n] int64
    control_slots: np.ndarray | None = None  # [n] int64, 0 = none
    masked_rows: np.ndarray | None = None  # [rows] bool: the rows `token_bitmask` restricts
    temperatures: np.ndarray | None = None  # [n] float32
    top_ks: np.ndarray | None = None  # [n] int32
    top_ps: np.ndarray | None = None  # [n] float32
    min_ps: np.ndarray | None = None  # [n] float32
    seeds: np.ndarray | None = None  # [n] uint64
    stop_ids: np.ndarray | None = None  # [n, max_stop_ids] int64, -1 = no id
    eos_suppression_rows: np.ndarray | None = None  # row numbers
    forced_tokens: np.ndarray | None = None  # [rows] int64, -1 = none
    draw_uniforms: np.ndarray | None = None  # [rows] float64
    row_drafts: np.ndarray | None = None  # [rows] int64, -1 none, READ_FROM_POOL
    has_draft_probs: np.ndarray | None = None  # [rows] bool
    mtp_info_read_rows: np.ndarray | None = None  # [rows]
    mtp_info_write_slots: np.ndarray | None = None  # [n]
    next_draft_tokens: np.ndarray | None = None  # [n, max_draft_tokens] int64
    next_draft_logprobs: np.ndarray | None = None  # [n, max_draft_tokens] float32
    # What travels in copies of its own:
    draft_probs: dict[int, torch.Tensor] | None = None  # first sample row -> [k, V] q of its drafts
    # [rows, ceil(V / 32)] int32 in xgrammar's packed layout (bit b of word w: token 32 w + b, 1 = allowed;
    # a row of -1 restricts nothing); None: no row is restricted this step. Carried by the step's copy
    # when set.
    token_bitmask: np.ndarray | None = None

    @classmethod
    def from_inputs(cls, inputs: SamplerInputs, stop_ids: np.ndarray) -> StepArrays:
        """The ledger's fields, the stop-id matrix [n, max_stop_ids] the engine built, and
        each row's draw uniform (`engine.host.draw_uniforms`; padding only when every
        request is greedy: a greedy row never reads it)."""
        uniforms = None
        if (inputs.temperatures != 0).any():
            uniforms = staged_draw_uniforms(inputs.seeds, inputs.sample_positions, inputs.row_to_req, inputs.local_step)
        return cls(stop_ids=stop_ids, draw_uniforms=uniforms, **{f.name: getattr(inputs, f.name) for f in FROM_LEDGER_FIELDS})

    def requests(self, a: int, b: int, sample_offsets: np.ndarray, sample_counts: np.ndarray) -> StepArrays:
        """The arrays of requests [a, b), renumbered from 0."""
        r0 = int(sample_offsets[a])
        r1 = int(sample_offsets[b - 1] + sample_counts[b - 1])
        part = {}
        for f in STEP_FIELDS:
            value = getattr(self, f.name)
            if value is None:
                part[f.name] = None
            elif f.host_form == "row numbers":
                part[f.name] = value[(value >= r0) & (value < r1)] - r0
            else:
                sliced = value[r0:r1] if f.per == "row" else value[a:b]
                part[f.name] = sliced - a if f.index_of == "req" else sliced
        part["token_bitmask"] = None if self.token_bitmask is None else self.token_bitmask[r0:r1]
        part["draft_probs"] = (
            None if self.draft_probs is None
            else {row - r0: q for row, q in self.draft_probs.items() if r0 <= row < r1}
        )
        return StepArrays(**part)
