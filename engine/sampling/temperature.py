"""Temperature (docs/contract.md §2): processed logits z = (raw - M) / T.

M is the largest raw logit that is not suppressed (`engine.sampling.suppression`)
and T the row's temperature (1 for greedy rows). Shifting by M before dividing
is part of the definition: dividing first rounds differently in float32.
"""
from __future__ import annotations

import math

import torch


def processed_logits(
    raw: torch.Tensor,
    shift: torch.Tensor,
    temperature: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """z = (raw - shift) / temperature, -inf where a token is not valid.

    Parameters: `raw` [rows, M] f32 logits (a full row or candidates);
    `shift` [rows] f32, the row's M; `temperature` [rows] f32; `valid`
    [rows, M] bool or None: False for suppressed stop ids; `out` [rows, M]
    f32 or None, where to write. Returns: [rows, M] f32 z. Capture-safe.
    """
    z = torch.sub(raw, shift[:, None], out=out).div_(temperature[:, None])
    if valid is not None:
        z.masked_fill_(~valid, -math.inf)
    return z
