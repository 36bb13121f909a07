"""Logit bias (docs/contract.md §2): a per-request map token id -> value added to the logit.

Applied after the masks (allowed tokens, token bitmask, EOS suppression) and
before the penalties, as vLLM's logit-bias processor: the repetition penalty
scales the biased logit, and a masked token stays -inf. A request's
pairs sit in fixed-width rows padded with (token 0, bias 0.0): adding 0.0
changes no logit, so padding needs no mask, and since the real ids of a
request are distinct each token receives at most one nonzero addend, whatever
order a scatter adds them in.
"""
from __future__ import annotations

import torch


def apply_logit_bias_(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Add each row's biases to its logits, in place.

    Parameters: `logits` [rows, V] f32; `ids` [rows, L] int64 token ids in
    [0, V); `values` [rows, L] f32, 0.0 on padding; same device. Returns:
    `logits`. Capture-safe.
    """
    return logits.scatter_add_(1, ids, values)
