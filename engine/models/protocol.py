"""What a host model implements so the decode loop can drive it.

A step schedules a flat batch of query tokens: request i owns `seqlens_q[i]`
consecutive tokens, in batch order, and after the step its context holds
`seqlens_k[i]` tokens (so its new tokens sit at cache positions
`seqlens_k[i] - seqlens_q[i] .. seqlens_k[i] - 1`). The model appends their keys
and values to the request's KV-cache slot, attends causally against everything
the slot holds (earlier prefill chunks and earlier decode steps included), and
returns one last-layer hidden row per query token: exactly the flat
`[total_rows, hidden]` layout of docs/contract.md §1 that the step engine consumes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class ForwardBatch:
    """Per-request layout of one forward call, in batch order.

    `slots[i]` is the KV-cache slot request i got from `allocate_slot()`;
    `seqlens_q[i]` the number of tokens it schedules this step (>= 1);
    `seqlens_k[i]` its context length after this step (>= seqlens_q[i]).
    """

    slots: np.ndarray  # [num_reqs] int64
    seqlens_q: np.ndarray  # [num_reqs] int64
    seqlens_k: np.ndarray  # [num_reqs] int64

    def __post_init__(self) -> None:
        for name in ("slots", "seqlens_q", "seqlens_k"):
            column = np.asarray(getattr(self, name), dtype=np.int64)
            if column.ndim != 1:
                raise ValueError(f"ForwardBatch.{name} must be 1-D, got shape {column.shape}")
            object.__setattr__(self, name, column)
        if not (len(self.slots) == len(self.seqlens_q) == len(self.seqlens_k)):
            raise ValueError(
                f"ForwardBatch columns differ in length: slots={len(self.slots)}, "
                f"seqlens_q={len(self.seqlens_q)}, seqlens_k={len(self.seqlens_k)}"
            )
        for i in np.flatnonzero(self.seqlens_q < 1):
            raise ValueError(f"request {i}: seqlen_q must be >= 1, got {self.seqlens_q[i]}")
        for i in np.flatnonzero(self.seqlens_k < self.seqlens_q):
            raise ValueError(f"request {i}: seqlen_k={self.seqlens_k[i]} is shorter than seqlen_q={self.seqlens_q[i]}")

    @classmethod
    def of(cls, slots: Sequence[int], seqlens_q: Sequence[int], seqlens_k: Sequence[int]) -> ForwardBatch:
        return cls(np.asarray(slots), np.asarray(seqlens_q), np.asarray(seqlens_k))

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.seqlens_q.sum())

    @property
    def context_starts(self) -> np.ndarray:
        """Cache position of each request's first new token: `seqlens_k - seqlens_q`."""
        return self.seqlens_k - self.seqlens_q

    @property
    def token_offsets(self) -> np.ndarray:
        """`[num_reqs + 1]` offsets of each request's tokens in the flat batch."""
        return np.concatenate(([0], np.cumsum(self.seqlens_q)))

    def positions(self) -> torch.Tensor:
        """`[T]` int64 absolute positions of the scheduled tokens (the usual `positions` argument)."""
        starts = np.repeat(self.context_starts - self.token_offsets[:-1], self.seqlens_q)
        return torch.from_numpy(starts + np.arange(self.num_tokens, dtype=np.int64))


@runtime_checkable
class CausalLM(Protocol):
    """A decoder the loop can drive.

    `forward` writes the final-norm hidden states (before the LM head) of every
    scheduled token; the LM head itself is the step engine's job, through
    `lm_head_weight`. KV-cache slots are handed out by `allocate_slot` and
    returned by `free_slot`; a freed slot's contents are garbage to its next owner,
    which starts again at `seqlens_k - seqlens_q == 0`.
    """

    hidden_size: int
    vocab_size: int
    max_context: int
    eos_token_id: int
    stop_token_ids: tuple[int, ...]  # every id that ends a generation, EOS included

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        ...

    def allocate_slot(self) -> int:
        ...

    def free_slot(self, slot: int) -> None:
        ...

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        out: torch.Tensor | None = None,  # [>= T, hidden]: rows [0, T) are written
    ) -> torch.Tensor:  # [T, hidden]
        ...


@runtime_checkable
class PrefixCopy(Protocol):
    """Optional for a `CausalLM`: copy cache positions `[0, length)` between two allocated
    slots. With it, the decode loop shares the KV of common prompt prefixes."""

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        ...


@runtime_checkable
class ChatTokenizer(Protocol):
    """Text <-> ids, plus the model's chat format."""

    def encode(self, text: str) -> list[int]:
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ...

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        ...


def check_forward_args(model: CausalLM, token_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, out: torch.Tensor | None) -> None:
    """Shared argument checks for `forward` implementations: shapes, context limit, output buffer."""
    total = batch.num_tokens
    if token_ids.shape != (total,) or positions.shape != (total,):
        raise ValueError(
            f"token_ids {tuple(token_ids.shape)} and positions {tuple(positions.shape)} must both be "
            f"[{total}] (the sum of seqlens_q)"
        )
    for i in np.flatnonzero(batch.seqlens_k > model.max_context):
        raise ValueError(f"request {i}: seqlen_k={batch.seqlens_k[i]} exceeds the model's max_context={model.max_context}")
    if out is not None and (out.dim() != 2 or out.shape[0] < total or out.shape[1] != model.hidden_size):
        raise ValueError(f"out must be [>= {total}, {model.hidden_size}], got {tuple(out.shape)}")
