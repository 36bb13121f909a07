"""The fixed-block log normaliser (docs/contract.md §2): log Z of a row's weights.

Z is the sum of a row's weights exp(z) (float32 values), taken as float32 sums
over fixed blocks of `BLOCK` tokens and added in float64. Fixed blocks make Z,
and so every filter decision and every logprob, independent of how many rows
share the call and of which path (fast, exact, verification, prompt
logprobs, a vocab-parallel shard of whole blocks) computes it.
"""
from __future__ import annotations

import torch

BLOCK = 1024  # tokens per block of the normaliser and the inverse-CDF draw


def block_log_normaliser(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block masses and the log of their total.

    Parameters: `weights` [rows, V] f32, nonnegative (exp of processed or raw
    logits; its row stride may exceed V). Returns: `block_mass` [rows,
    ceil(V / BLOCK)] f32, the sum of each block of BLOCK tokens (the last
    block may be partial), and `log_z` [rows] f64, log of their float64 sum.
    Capture-safe.
    """
    block_mass = block_sums(weights)
    return block_mass, log_block_total(block_mass)


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(V / BLOCK)] the sum of each block of BLOCK tokens of
    `weights` [rows, V] (the last block may be partial), in their dtype,
    along contiguous tokens whatever the caller's layout. Capture-safe."""
    rows, vocab = weights.shape
    # A float32 sum's rounding follows the memory order it walks: a row must
    # be summed along contiguous tokens whatever the caller's layout (a
    # column-major logits tensor would otherwise change Z, and every filter).
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    full = vocab // BLOCK
    parts = []
    if full:
        # [rows, full, BLOCK] view of the leading tokens (row stride stays V).
        parts.append(weights[:, : full * BLOCK].view(rows, full, BLOCK).sum(-1))
    if vocab % BLOCK:
        parts.append(weights[:, full * BLOCK :].sum(-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def log_block_total(block_mass: torch.Tensor) -> torch.Tensor:
    """log Z from block masses [rows, blocks] f32 (a row's, or gathered from
    vocab-parallel shards in block order): [rows] f64, the log of their
    float64 sum. Capture-safe."""
    return torch.log(block_mass.to(torch.float64).sum(-1))


def raw_log_normaliser(raw: torch.Tensor, raw_max: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """log-sum-exp of raw logits over the same fixed blocks as every other normaliser.

    Parameters: `raw` [rows, V] f32 logits; `raw_max` [rows] f32, their row
    maximum; `kept` [rows, V] bool or None, the tokens to sum over (None:
    all; top-k-space prompt logprobs restrict the sum, and the row maximum
    must then be a kept token). Returns: [rows] f64, raw_max + log Z.
    Capture-safe.
    """
    weights = torch.sub(raw, raw_max[:, None]).exp_()  # [rows, V] f32
    if kept is not None:
        weights.masked_fill_(~kept, 0.0)
    _, log_z = block_log_normaliser(weights)
    return raw_max.to(torch.float64) + log_z
