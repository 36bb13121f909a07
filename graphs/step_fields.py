"""The typed per-step views the captured step reads and writes, shared by
`graphs/` (which allocates them as static buffers) and the sampler in
`engine/sampling/` (which computes on them). Neutral ground: nothing here
imports `engine`.

The per-step fields themselves are declared once, on the host side
(`engine/host/step_fields.py`, numpy only), and handed to
`StepBuffers.allocate`; `FieldSpec` is what graphs/ reads of a declared
field. Field names are the row ledger's (docs/contract.md §1):
`temperatures`, `top_ks`, `sample_positions`, `eos_suppression_rows`, ...
from the ledger to the kernel. On the device `eos_suppression_rows` is a
per-row mask (True on a row whose EOS and stop ids are suppressed); the
ledger hands its row numbers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, make_dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


@dataclass
class RowParams:
    """Per-request parameters and the row -> request expansion, as device tensors.

    A row's position is `sample_positions[row_to_req] + local_step`. `stop_ids`
    rows are padded by repeating an id or with -1 (no id). Padding requests use
    `RowParams.neutral` values (temperature 1, no filter, seed 0): with zero
    logits they give finite, ignorable results.
    """

    temperatures: torch.Tensor  # [reqs] f32, 0 = greedy
    top_ks: torch.Tensor  # [reqs] int32, 0 = off
    top_ps: torch.Tensor  # [reqs] f32, 1 = off
    min_ps: torch.Tensor  # [reqs] f32, 0 = off
    seeds: torch.Tensor  # [reqs] int64 holding uint64 bits
    sample_positions: torch.Tensor  # [reqs] int64
    stop_ids: torch.Tensor  # [reqs, S] int64, -1 = no id; never every token of the vocabulary
    row_to_req: torch.Tensor  # [rows] int64
    local_step: torch.Tensor  # [rows] int64
    eos_suppression_rows: torch.Tensor  # [rows] bool
    forced_tokens: torch.Tensor  # [rows] int64, -1 = none
    # [rows] f64: each row's inverse-CDF uniform, hashed on the host from its seed and position
    # (the staged field); None: the sampler hashes it on the device, to the same bits.
    draw_uniforms: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.row_to_req.shape[0]

    @classmethod
    def from_numpy(
        cls,
        *,
        temperatures: np.ndarray,
        top_ks: np.ndarray,
        top_ps: np.ndarray,
        min_ps: np.ndarray,
        seeds: np.ndarray,
        sample_positions: np.ndarray,
        row_to_req: np.ndarray,
        local_step: np.ndarray,
        stop_ids: np.ndarray | None = None,
        eos_suppression_rows: np.ndarray | None = None,
        forced_tokens: np.ndarray | None = None,
        draw_uniforms: np.ndarray | None = None,
        device: torch.device | str = "cpu",
    ) -> RowParams:
        """Host arrays (the ledger's dtypes: seeds uint64, indices int32) to device tensors.
        Without `draw_uniforms` the sampler hashes the rows' uniforms on the device."""
        num_reqs, num_rows = len(temperatures), len(row_to_req)
        if stop_ids is None:
            stop_ids = np.full((num_reqs, 1), -1, dtype=np.int64)
        if eos_suppression_rows is None:
            eos_suppression_rows = np.zeros(num_rows, dtype=bool)
        if forced_tokens is None:
            forced_tokens = np.full(num_rows, -1, dtype=np.int64)
        seeds = np.asarray(seeds)
        seed_bits = seeds.astype(np.uint64).view(np.int64) if seeds.dtype != np.int64 else seeds

        def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(
            temperatures=tensor(temperatures, torch.float32),
            top_ks=tensor(top_ks, torch.int32),
            top_ps=tensor(top_ps, torch.float32),
            min_ps=tensor(min_ps, torch.float32),
            seeds=tensor(seed_bits, torch.int64),
            sample_positions=tensor(sample_positions, torch.int64),
            stop_ids=tensor(np.asarray(stop_ids).reshape(num_reqs, -1), torch.int64),
            row_to_req=tensor(row_to_req, torch.int64),
            local_step=tensor(local_step, torch.int64),
            eos_suppression_rows=tensor(eos_suppression_rows, torch.bool),
            forced_tokens=tensor(forced_tokens, torch.int64),
            draw_uniforms=None if draw_uniforms is None else tensor(draw_uniforms, torch.float64),
        )

    @classmethod
    def neutral(cls, num_reqs: int, num_rows: int, num_stop: int = 1, device: torch.device | str = "cpu") -> RowParams:
        """Padding values: every request samples plainly at temperature 1 with seed 0."""
        return cls.from_numpy(
            temperatures=np.ones(num_reqs, np.float32),
            top_ks=np.zeros(num_reqs, np.int32),
            top_ps=np.ones(num_reqs, np.float32),
            min_ps=np.zeros(num_reqs, np.float32),
            seeds=np.zeros(num_reqs, np.uint64),
            sample_positions=np.zeros(num_reqs, np.int64),
            row_to_req=np.zeros(num_rows, np.int64),
            local_step=np.zeros(num_rows, np.int64),
            stop_ids=np.full((num_reqs, num_stop), -1, np.int64),
            device=device,
        )

    def rows(self, index: Sequence[int] | torch.Tensor) -> RowParams:
        """The same requests with only the given rows (used by the reference path)."""
        return self._with_rows(torch.as_tensor(index, dtype=torch.int64, device=self.row_to_req.device))

    def row_slice(self, start: int, stop: int) -> RowParams:
        """The same requests with rows [start, stop) only: views, capture-safe."""
        return self._with_rows(slice(start, stop))

    def _with_rows(self, pick: torch.Tensor | slice) -> RowParams:
        def picked(name: str) -> torch.Tensor | None:
            value = getattr(self, name)
            return value[pick] if name in _PER_ROW and value is not None else value

        return RowParams(**{f.name: picked(f.name) for f in fields(self)})


# The RowParams fields with one entry per sample row (the rest: one per request).
_PER_ROW = frozenset({"row_to_req", "local_step", "eos_suppression_rows", "forced_tokens", "draw_uniforms"})


@dataclass
class SampleOutput:
    """Preallocated results, written in place by `sample` (static addresses)."""

    tokens: torch.Tensor  # [rows] int64
    logprob: torch.Tensor  # [rows] f32: the emitted token's logprob
    rank: torch.Tensor  # [rows] int64: 1 + tokens with a strictly larger logit
    top_ids: torch.Tensor  # [rows, N] int64 (-1 where the processed distribution has fewer tokens)
    top_logprobs: torch.Tensor  # [rows, N] f32
    needs_exact: torch.Tensor  # [rows] bool: rerun the row with `sample_exact` (only the vocab-parallel candidate exchange sets it)
    error: torch.Tensor  # [rows] int64 `RowError`: nonzero rows hold the placeholder, emit nothing

    @classmethod
    def allocate(cls, rows: int, num_top: int, device: torch.device | str = "cpu") -> SampleOutput:
        return cls(
            tokens=torch.zeros(rows, dtype=torch.int64, device=device),
            logprob=torch.zeros(rows, dtype=torch.float32, device=device),
            rank=torch.zeros(rows, dtype=torch.int64, device=device),
            top_ids=torch.zeros(rows, num_top, dtype=torch.int64, device=device),
            top_logprobs=torch.zeros(rows, num_top, dtype=torch.float32, device=device),
            needs_exact=torch.zeros(rows, dtype=torch.bool, device=device),
            error=torch.zeros(rows, dtype=torch.int64, device=device),
        )

    def row_slice(self, start: int, stop: int) -> SampleOutput:
        """Rows [start, stop) as views: writing them writes these outputs."""
        return SampleOutput(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


class FieldSpec(Protocol):
    """What graphs/ reads of a declared per-step field (engine/host/step_fields.py)."""

    name: str
    dtype: type  # numpy dtype; uint64 is staged as its int64 bits
    per: str  # "req": one entry per request slot; "row": one per sample-row slot
    padding: int | float | bool | str  # a value, or a rule resolved per step ("padding request", "past request rows")
    stage: str  # "sample": part of the sampler's view, `RowParams`
    width: int | str  # columns: an int, or "stop" / "draft" (max stop ids / max draft tokens)
    host_form: str  # "slots", or "row numbers": the host hands the rows where the bool field is True


# The stage whose fields make up `RowParams`, the sampler's view.
SAMPLE_STAGE = "sample"
READ_FROM_POOL = -2  # row_drafts value: take the draft from the draft-info pool


@functools.lru_cache(maxsize=None)
def step_inputs_class(names: tuple[str, ...]) -> type:
    """The typed device views of a declaration: one tensor attribute per field
    (`buffers.inputs.row_drafts`, never a string key), in declaration order."""
    return make_dataclass(
        "StepInputs",
        [(name, torch.Tensor) for name in names],
        namespace={"__doc__": "Device views of the per-step fields (declaration order), full size."},
    )
