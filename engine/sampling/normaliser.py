"""Masses and the log normaliser (docs/contract.md §2): every sum over a row, exact.

A token's weight exp(z) (a float32 in [0, 1]) enters every sum as its
*mass*, the integer floor(exp(z) * 2**S) with S = 52 - bit_length(V - 1)
(`mass_bits`): V masses add up to less than 2**53, so any sum of a row's
masses, partial or whole, is an exact integer in float64 whatever the order
of the additions. That one definition serves every consumer:

- top-p's level and its cut (`engine.sampling.thresholds`);
- the inverse-CDF draw: the first token whose running kept mass exceeds u
  times the kept total (`engine.sampling.draw`);
- the normaliser Z of processed and raw logprobs: the masses' total times
  2**-S (`block_log_normaliser`, `raw_log_normaliser`).

So a CPU sum, a CUDA reduction, a Triton kernel's tree of partial sums and a
vocab-parallel shard's share all give the same bits, and no result depends on
how many rows share the call. The price is resolution: a weight below 2**-S
(exp(z) < 2.9e-11 at V = 129280) has mass 0 and is never drawn, and Z falls
short of the float sum of the weights by less than V * 2**-S (< 4e-6 at
V = 129280, < 7e-7 at V = 49152).

Masses are summed over fixed blocks of `BLOCK` tokens: the draw finds the
block first and then the token inside it, and a vocab-parallel shard of whole
blocks reports its blocks' masses.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 1024  # tokens per block of the block masses and the inverse-CDF draw
TEMPORARY_BYTES = 1 << 20  # the largest masses temporary `block_sums` makes (see there)


@functools.cache  # a per-step question with few answers: hits cost no Python call
def mass_bits(vocab: int) -> int:
    """S: a token's mass is floor(exp(z) * 2**S). V * 2**S <= 2**52, so any sum
    of a row's masses is an integer below 2**53, exact in float64."""
    return 52 - max(1, (vocab - 1).bit_length())


def token_masses(weights: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """floor(exp(z) * 2**S) per token, float64 integers: `weights` [rows, M] f32
    exp(z) in [0, 1] (0 for tokens outside the set being weighed) of a whole
    row (M = V) or of some of its tokens (then `vocab` gives V, which sets
    S). Capture-safe."""
    scale = float(2 ** mass_bits(weights.shape[1] if vocab is None else vocab))
    # The cast, the scaling by a power of two and the floor are exact: the float32 floor's
    # integers. One new tensor, scaled and floored in place (each [rows, V] temporary costs
    # page faults on a CPU).
    return weights.to(torch.float64, copy=True).mul_(scale).floor_()


def block_sums(weights: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """[rows, ceil(M / BLOCK)] f64: the masses of `weights` [rows, M] f32
    (nonnegative exp(z), 0 outside the set being weighed) summed over each
    block of BLOCK tokens (the last block may be partial); exact integers.
    `vocab` V sets the masses' scale when M < V (a vocab-parallel shard of
    whole blocks). Capture-safe."""
    rows, width = weights.shape
    scale = float(2 ** mass_bits(width if vocab is None else vocab))
    # The masses are held in float32 here: a float32 times a power of two is exact (the
    # same significand), and so is its floor, so they are `token_masses`' integers; the
    # sums are taken in float64 (`dtype=`), where they are exact in any order. Whole blocks
    # at a time, at most TEMPORARY_BYTES of masses each: on a CPU a [rows, V] temporary
    # costs more in page faults than the arithmetic (4x the sampler's time at [64, 49152]
    # in float64). Float32 masses, half the bytes of float64 ones, took 15 to 25% less time
    # at [16 to 64, 49152] and [16, 128256] (2 Zen 4 cores, thread CPU time, load 10).
    step = max(1, TEMPORARY_BYTES // (4 * BLOCK * max(rows, 1))) * BLOCK
    parts = []
    for start in range(0, width, step):
        masses = torch.mul(weights[:, start : start + step], scale).floor_()  # [rows, <= step] f32 integers
        full = masses.shape[1] // BLOCK
        if full:
            parts.append(masses[:, : full * BLOCK].view(rows, full, BLOCK).sum(-1, dtype=torch.float64))
        if masses.shape[1] % BLOCK:
            parts.append(masses[:, full * BLOCK :].sum(-1, keepdim=True, dtype=torch.float64))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def log_block_total(block_mass: torch.Tensor, vocab: int) -> torch.Tensor:
    """log Z from block masses [rows, blocks] f64 (a row's, or gathered from
    vocab-parallel shards) of a `vocab`-wide row: [rows] f64, the log of
    their total times 2**-S (an exact scaling). Capture-safe."""
    return torch.log(block_mass.sum(-1) * 2.0 ** -mass_bits(vocab))


def block_log_normaliser(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block masses and the log of their total.

    Parameters: `weights` [rows, V] f32, nonnegative (exp of processed or raw
    logits). Returns: `block_mass` [rows, ceil(V / BLOCK)] f64 (`block_sums`)
    and `log_z` [rows] f64 (`log_block_total`). Capture-safe.
    """
    block_mass = block_sums(weights)
    return block_mass, log_block_total(block_mass, weights.shape[1])


def raw_log_normaliser(raw: torch.Tensor, raw_max: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """log-sum-exp of raw logits by the same masses as every other normaliser.

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
