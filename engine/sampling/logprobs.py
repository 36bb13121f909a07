"""Logprobs (docs/contract.md §2): the emitted token's logprob and rank, and top-N.

"raw" mode: log-softmax of the unprocessed logits, with the normaliser of
exact mass sums (`raw_log_normaliser`), so a logprob does not depend on which
path reported it: the sampler, the reference path, the step engine's rescoring of a
residual draw, or prompt logprobs. The rank is 1 + the number of tokens with
a strictly larger logit (ties share a rank); top-N lists the N largest
logits, best first, ties to the smaller id.

"processed" mode: the logprobs of the distribution the row drew from: each
kept token's mass over the kept set's total (`engine.sampling.thresholds`);
a token outside it (or of mass 0) has logprob -inf, and a token outside it
ranks after every kept token. Top-N holds real ids only: past the kept
tokens, the smallest other ids at -inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from typing import TYPE_CHECKING

from engine.sampling.thresholds import raw_log_normaliser, token_masses
from engine.sampling.sample_output import SampleOutput

if TYPE_CHECKING:
    from engine.sampling.thresholds import RowDistribution


@dataclass
class RowLogprobs:
    """Logprobs of a set of rows, before they are written into a `SampleOutput`."""

    logprob: torch.Tensor  # [rows] f64: the emitted token's
    rank: torch.Tensor  # [rows] int64
    top_ids: torch.Tensor  # [rows, N] int64 token ids
    top_logprobs: torch.Tensor  # [rows, N] f64

    def write(self, out: SampleOutput, index: torch.Tensor | None = None) -> None:
        """Into `out`: every row (capture-safe), or rows `index` [rows] int64 of it."""
        for name, value in vars(self).items():
            target = getattr(out, name)
            if index is None:
                target.copy_(value)
            else:
                target[index] = value.to(target.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *,
                   log_normaliser: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logprob and rank of each row's token.

    Parameters: `logits` [rows, V] f32 raw logits; `tokens` [rows] int64;
    `log_normaliser` [rows] f64 from `raw_log_normaliser` when the caller has
    it (None: computed over `logits`). Returns: `logprob` [rows] f64 and
    `rank` [rows] int64. Capture-safe.
    """
    value = logits.gather(1, tokens[:, None])  # [rows, 1]
    if log_normaliser is None:
        log_normaliser = raw_log_normaliser(logits, logits.amax(-1))
    rank = (logits > value).sum(-1) + 1
    return value.squeeze(1).to(torch.float64) - log_normaliser, rank


def raw_logprobs(plain: torch.Tensor, tokens: torch.Tensor, num_top: int) -> RowLogprobs:
    """Raw logprobs of whole rows: `plain` [rows, V] f32 unprocessed logits,
    `tokens` [rows] int64, top-N = `num_top` <= V. Capture-safe."""
    lse = raw_log_normaliser(plain, plain.amax(-1))
    logprob, rank = token_logprobs(plain, tokens, log_normaliser=lse)
    top_ids = top_n_ids(plain, num_top)
    return RowLogprobs(logprob, rank, top_ids, plain.gather(1, top_ids).to(torch.float64) - lse[:, None])


def processed_row_logprobs(d: "RowDistribution", tokens: torch.Tensor, num_top: int) -> RowLogprobs:
    """Logprobs of the distribution each row drew from: each kept token's
    mass over the kept set's mass (`engine.sampling.thresholds.RowDistribution`,
    by token id, with its kept set), log(mass) - log(total) in float64. A
    token outside the kept set has logprob -inf; the rank counts the kept
    tokens of strictly larger z, and a token not kept ranks after all of
    them. Top-N lists the kept tokens by z, then (when fewer than N are kept)
    the smallest other ids at -inf, as vLLM lists them: never a fake id.
    `tokens` [rows] int64; `num_top` <= V. Capture-safe."""
    vocab = d.z.shape[1]
    log_total = torch.log(d.mass_total)[:, None]  # [rows, 1] f64
    at = tokens[:, None]
    kept_z = torch.where(d.kept, d.z, -math.inf)
    token_z = kept_z.gather(1, at)  # [rows, 1]: -inf when not kept
    top_ids = top_n_ids(kept_z, num_top)
    return RowLogprobs(
        logprob=(torch.log(token_masses(d.weights.gather(1, at), vocab)) - log_total).squeeze(1),
        rank=(kept_z > token_z).sum(-1) + 1,
        top_ids=top_ids,
        top_logprobs=torch.log(token_masses(d.weights.gather(1, top_ids), vocab)) - log_total,
    )


def top_n_ids(values: torch.Tensor, n: int) -> torch.Tensor:
    """The ids of the n largest values per row, best first, ties to the smaller id.

    Parameters: `values` [rows, V] f32; `n` in [0, V]. Returns: [rows, n]
    int64. One topk over int64 keys that order by (value desc, id asc) and
    are all distinct, so topk's unspecified tie order never shows.
    Capture-safe.
    """
    vocab = values.shape[1]
    id_bits = max(1, (vocab - 1).bit_length())
    bits = torch.add(values, 0.0).contiguous().view(torch.int32)  # + 0.0: -0 and +0 share a key
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in the value
    ids = torch.arange(vocab, device=values.device)
    keys = (order << id_bits) | ((1 << id_bits) - 1 - ids)
    return torch.topk(keys, n, dim=1).indices
