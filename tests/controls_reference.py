"""The sampling controls of one row, as a plain per-request loop (docs/contract.md §2).

Written from the contract, independent of `engine` (it imports nothing from
it): the oracle the controls stages are checked against. One row of fp32
logits, the request's prompt tokens and the tokens generated before this row
(accepted output plus the drafts of the request's earlier rows), in order:

1. allowed tokens: every token outside the set gets -inf;
2. logit bias: plus the token's bias;
3. repetition penalty rp, over every token of the prompt or the output: a
   positive logit is divided by rp, any other multiplied by it;
4. frequency penalty fp: minus fp times the token's count in the output;
5. presence penalty pp: minus pp when the token occurs in the output.

That is vLLM V1's order: the bias is a logits processor, the penalties come
after the processors.

Each step rounds to float32, as the engine's fp32 logits do.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import numpy as np


def controlled_row(
    logits: np.ndarray,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
) -> np.ndarray:
    """[V] float32: `logits` [V] after the controls, token by token."""
    f32 = np.float32
    rp, fp, pp = f32(repetition_penalty), f32(frequency_penalty), f32(presence_penalty)
    counts = Counter(int(t) for t in output)
    seen = set(int(t) for t in prompt) | set(counts)
    bias = dict(logit_bias or {})
    allowed = None if allowed_token_ids is None else set(int(t) for t in allowed_token_ids)
    out = np.empty(len(logits), dtype=np.float32)
    for token, value in enumerate(np.asarray(logits, dtype=np.float32)):
        if allowed is not None and token not in allowed:
            value = f32(-np.inf)
        if token in bias:
            value = f32(value + f32(bias[token]))
        if token in seen:
            value = f32(value / rp) if value > 0 else f32(value * rp)
        count = counts.get(token, 0)
        value = f32(value - f32(fp * f32(count)))
        value = f32(value - f32(pp * f32(count > 0)))
        out[token] = value
    return out
