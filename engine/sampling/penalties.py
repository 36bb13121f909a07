"""Penalties (docs/contract.md §2): repetition, frequency and presence, vLLM's semantics.

Per row, over fp32 logits, after the masks and the logit bias (vLLM applies
its penalties after its logits processors), in this order:

- repetition (`rp`, 1 = off): every token seen in the prompt or the output so
  far: a positive logit is divided by rp, any other multiplied by it;
- frequency (`fp`): logit -= fp * (times the token was generated);
- presence (`pp`): logit -= pp * (the token was generated at least once).

"Generated so far" is per row: row j of a request verifying drafts counts
drafts 0..j-1 as generated (the caller adds them to the row's counts), so a
draft row sees exactly what one-token decoding would have seen there.

The prompt's tokens come packed as a token bitmask (`token_bitmask.py`).
"""
from __future__ import annotations

import torch

from engine.sampling.token_bitmask import unpack_token_bitmask


def apply_penalties_(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_words: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, in place.

    Parameters: `logits` [rows, V] f32; `counts` [rows, V] int32, how often
    each token was generated before the row's token (drafts included);
    `prompt_words` [rows, ceil(V/32)] int32, the prompt's tokens packed;
    `repetition`, `frequency`, `presence` [rows] f32 (1, 0, 0 = off), all on
    the logits' device. Returns: `logits`. Capture-safe.
    """
    vocab = logits.shape[1]
    generated = counts > 0  # [rows, V]
    seen = generated | unpack_token_bitmask(prompt_words, vocab)
    rp = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rp, logits * rp)
    torch.where(seen, penalised, logits, out=logits)
    logits -= frequency[:, None] * counts.to(torch.float32)
    logits -= presence[:, None] * generated.to(torch.float32)
    return logits
