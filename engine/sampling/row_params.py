"""The sampler's input: per-request parameters and the row -> request expansion, as device tensors.

The captured step's static buffers hand the sampler a `RowParams` of views
(`StepBuffers.params`: leading slices of the per-step fields of stage "sample",
engine/host/step_fields.py); tests and benchmarks build one from host arrays
with `RowParams.from_numpy`. Field names are the row ledger's
(docs/contract.md §1): `temperatures`, `top_ks`, `sample_positions`,
`eos_suppression_rows`, ... On the device `eos_suppression_rows` is a per-row
mask (True on a row whose EOS and stop ids are suppressed); the ledger hands
its row numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

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
