"""The ids a request must not produce while it is short of `min_tokens`: EOS
and its `stop_token_ids` (docs/contract.md §2, EOS suppression). EOS is held
back even with `ignore_eos`, as vLLM does: `ignore_eos` only keeps EOS from
ending the request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from engine.host.params import SamplingParams, SeqMeta


@dataclass(frozen=True)
class StopIds:
    """Stop-id rows of `width` ids (`EngineConfig.max_stop_ids`), -1 padded."""

    width: int
    vocab_size: int
    eos_token_id: int | None

    def for_request(self, request_id: Hashable, params: SamplingParams) -> np.ndarray:
        """[width] int64: EOS (with or without ignore_eos) and the request's stop ids, -1 padded."""
        row = np.full(self.width, -1, dtype=np.int64)
        ids = list(params.stop_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.insert(0, self.eos_token_id)
        if not ids:
            return row
        if len(ids) > self.width:
            raise ValueError(
                f"request {request_id!r}: params.stop_token_ids: {len(ids)} stop ids (with EOS) "
                f"but EngineConfig.max_stop_ids={self.width}"
            )
        if max(ids) >= self.vocab_size:
            raise ValueError(
                f"request {request_id!r}: params.stop_token_ids={params.stop_token_ids}: "
                f"outside the vocabulary ({self.vocab_size})"
            )
        row[: len(ids)] = ids
        return row

    def matrix(self, seqs: Sequence[SeqMeta]) -> np.ndarray:
        """[n, width] int64: one row per request of the batch."""
        matrix = np.full((len(seqs), self.width), -1, dtype=np.int64)
        for i, seq in enumerate(seqs):
            matrix[i] = self.for_request(seq.request_id, seq.params)
        return matrix
