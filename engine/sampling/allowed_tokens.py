"""Allowed tokens (docs/contract.md §2): a restricted request samples only from its set.

The first of the logits processors (vLLM's order, `engine.sampling.sampler`):
every token outside the set gets logit -inf, which the bias and the
penalties after it leave as it is. The set is packed like the structured-output bitmask (bit b
of int32 word w is token 32w + b); unrestricted rows keep every logit.
"""
from __future__ import annotations

import math

import torch

from engine.sampling.token_bitmask import unpack_token_bitmask


def apply_allowed_tokens_(logits: torch.Tensor, words: torch.Tensor, restricted: torch.Tensor) -> torch.Tensor:
    """-inf on the tokens a restricted row does not allow, in place.

    Parameters: `logits` [rows, V] f32; `words` [rows, ceil(V/32)] int32 the
    allowed set packed; `restricted` [rows] bool; same device. Returns:
    `logits`. Capture-safe.
    """
    banned = ~unpack_token_bitmask(words, logits.shape[1]) & restricted[:, None]  # [rows, V]
    return logits.masked_fill_(banned, -math.inf)
