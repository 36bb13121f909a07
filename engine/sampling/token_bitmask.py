"""The token bitmask (docs/contract.md §2, stage 4): which tokens each row may produce.

Structured output (a grammar's next allowed tokens) and bad words arrive as
one row of int32 words per sample row, in xgrammar's packed layout: bit b of
word w stands for token 32 w + b, 1 = allowed; a row of all ones (-1 words)
restricts nothing. The host builds it (`engine/host/token_constraints.py`).

It is the first of the logits processors (vLLM's model runner applies the
structured-output bitmask before its sampler): a disallowed token's score
becomes -inf, so every later stage (the allowed tokens, the bias and the
penalties, which leave -inf as it is; the candidates, the filters, the draws,
processed logprobs, verification's target distribution) sees only allowed
tokens. Raw logprobs read the logits before any control and do not see it.

A row whose mask leaves no finite score fails on its own
(`RowError.NO_TOKEN_ALLOWED`). Its scores stay as they were, finite, so the
stages after this one compute ordinary numbers on it before the placeholder
replaces its results.
"""
from __future__ import annotations

import math

import torch

# The layout is the host's (engine/host/token_constraints.py builds the rows): one definition.
from engine.host.token_constraints import BITS_PER_WORD, bitmask_words

__all__ = ["BITS_PER_WORD", "bitmask_words", "unpack_token_bitmask", "apply_token_bitmask"]


def unpack_token_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's allowed tokens.

    Parameters: `words` [rows, ceil(V / 32)] int32 packed bits on the
    sampling device; `vocab` V. Returns: [rows, V] bool, True = allowed.
    Capture-safe.
    """
    # 1 << 31 is int32's sign bit: the & reads it like any other bit.
    bits = torch.bitwise_left_shift(torch.ones((), dtype=torch.int32, device=words.device),
                                    torch.arange(BITS_PER_WORD, dtype=torch.int32, device=words.device))  # [32]
    return ((words[:, :, None] & bits) != 0).view(words.shape[0], -1)[:, :vocab]  # [rows, W * 32] -> [rows, V]


def apply_token_bitmask(scores: torch.Tensor, words: torch.Tensor, *, in_place: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Disallowed tokens to -inf.

    Parameters: `scores` [rows, V] f32, the logits; `words` [rows, ceil(V /
    32)] int32, the rows' bitmasks, same device; `in_place`: write `scores`
    itself (else a new tensor). Returns: the masked scores [rows, V] f32 (a
    row with no allowed finite score keeps its scores), and [rows] bool, the
    rows the mask leaves nothing to sample. Applying it twice changes
    nothing more. Capture-safe.
    """
    allowed = unpack_token_bitmask(words, scores.shape[1])  # [rows, V] bool
    nothing_allowed = ~(allowed & (scores > -math.inf)).any(-1)  # [rows]
    banned = ~allowed & ~nothing_allowed[:, None]
    return (scores.masked_fill_(banned, -math.inf) if in_place else scores.masked_fill(banned, -math.inf)), nothing_allowed
