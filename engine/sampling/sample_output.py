"""The sampler's output: preallocated results it writes in place (static addresses)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class SampleOutput:
    """Preallocated results, written in place by `sample` (static addresses)."""

    tokens: torch.Tensor  # [rows] int64
    logprob: torch.Tensor  # [rows] f32: the emitted token's logprob
    rank: torch.Tensor  # [rows] int64: 1 + tokens with a strictly larger logit
    top_ids: torch.Tensor  # [rows, N] int64 (-1 where the processed distribution has fewer tokens)
    top_logprobs: torch.Tensor  # [rows, N] f32
    error: torch.Tensor  # [rows] int64 `RowError`: nonzero rows hold the placeholder, emit nothing

    @classmethod
    def allocate(cls, rows: int, num_top: int, device: torch.device | str = "cpu") -> SampleOutput:
        return cls(
            tokens=torch.zeros(rows, dtype=torch.int64, device=device),
            logprob=torch.zeros(rows, dtype=torch.float32, device=device),
            rank=torch.zeros(rows, dtype=torch.int64, device=device),
            top_ids=torch.zeros(rows, num_top, dtype=torch.int64, device=device),
            top_logprobs=torch.zeros(rows, num_top, dtype=torch.float32, device=device),
            error=torch.zeros(rows, dtype=torch.int64, device=device),
        )

    def row_slice(self, start: int, stop: int) -> SampleOutput:
        """Rows [start, stop) as views: writing them writes these outputs."""
        return SampleOutput(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

