"""Draft verification on the device (docs/contract.md §1.2, §2.1): which drafts a step accepts.

Layout. Sample rows are flat; request i owns rows [first_i, first_i + 1 + k_i)
and row j of it produces position `sample_position_i + j`. `row_to_req` and
`local_step` [rows] name each row's request and j. `row_drafts[r]` is the draft
token row r is asked to predict (the draft at query position j + 1), -1 on a
request's last row, which has none. Every function here is capture-safe: no
host syncs, no value-dependent shapes, no generator state; randomness comes
from `engine.sampling.draw` keyed by (request seed, the row's absolute position, stream).

Padding rows must point at a padding request (its results are cut off) or
carry a `local_step` larger than any real row's (e.g. 1 + max_draft_tokens):
then they never change a real request's `num_accepted`. They stay finite.

Strict mode (`accept_strict`): a draft is accepted while it equals its row's
own draw (`engine.sampling.sampler.sample`); the emitted tokens are the draws of rows
0..num_accepted, so the output equals decoding one token per step.

Rejection mode (`verify_rejection`, Leviathan et al. 2023): row j accepts its
draft d when u < p(d) / q(d), u from stream ACCEPT keyed by (seed, position,
counter 0), written `u * q(d) < p(d)` so q(d) = 0 needs no division (such a
draft was not drawn from q: accepted iff p(d) > 0). On the first rejection the
row emits an inverse-CDF draw from normalize(max(p - q, 0)) with one uniform
from stream RESIDUAL, over the residual's integer masses floor(r * 2**60)
(`draw.probability_masses`): their sums are exact, so a kernel that adds them
in any order draws the same token. The masses are all zero only when every
residual probability is below 2**-60 (p == q, up to rounding): then a rejection
can only come from a draft with p(d) = q(d) = 0, or has probability below
V * 2**-60, and the row draws from p's masses with the same uniform instead
(still exact: the target's distribution is what the row must produce). A row without a draft
(all earlier drafts accepted) emits the bonus token, a draw from p; see
`verify_rejection` for when it equals the normal sampler's token.

Top-k-space mode (per request k, 0 = off; `restrict_to_top_k`,
`draft_in_top_k`): target and draft distributions are cut to their top-k,
value-defined with ties at the cut kept (as docs/contract.md §2 defines top-k), and
renormalised. Working on the full vocabulary with the other tokens at
probability 0 is the remap into the target's top-k done in place: a draft maps
to its own id, and one outside the target's top-k has p(d) = 0, so it is always
rejected; draft mass outside the target's top-k drops out of the residual
because max(0 - q, 0) = 0. In strict mode the same mode rejects a draft outside
the target's top-k even when the draw equals it (the emitted draw is unchanged,
so the output still equals plain decoding).
"""
from __future__ import annotations

import torch

from engine.sampling.draw import MASS_SCALE, gumbel_race, inverse_cdf, probability_masses
from engine.sampling.filters import top_k_mask
from engine.sampling.draw import ACCEPT, RESIDUAL, uniform
from engine.sampling.thresholds import first_max, row_distribution
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sampler import controlled_scores
from engine.sampling.rows import suppressed_scores

_NONE = torch.iinfo(torch.int64).max  # scatter-min identity: "no rejection seen"


def _first_rejection(
    accepted: torch.Tensor, row_to_req: torch.Tensor, local_step: torch.Tensor, num_reqs: int, out: torch.Tensor | None
) -> torch.Tensor:
    """Per request, the local step of its first non-accepted row: the number of
    leading accepted drafts. A request's last row never accepts, so every real
    request has one; a request slot without rows gets 0."""
    key = torch.where(accepted, torch.full_like(local_step, _NONE), local_step)  # [rows]
    first = torch.full((num_reqs,), _NONE, dtype=torch.int64, device=local_step.device)
    first.scatter_reduce_(0, row_to_req, key, "amin", include_self=True)
    first = torch.where(first == _NONE, torch.zeros_like(first), first)
    if out is None:
        return first
    return out.copy_(first)


def accept_strict(
    row_tokens: torch.Tensor,
    row_drafts: torch.Tensor,
    row_to_req: torch.Tensor,
    local_step: torch.Tensor,
    num_reqs: int,
    *,
    draft_allowed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Strict verification: `num_accepted` [num_reqs] int64.

    row_tokens [rows] int64: each row's own draw (the sampler's tokens);
    row_drafts [rows] int64, -1 = no draft. A request accepts its leading rows
    whose draw equals the draft. `draft_allowed` [rows] bool (top-k-space mode,
    from `draft_in_top_k`) additionally rejects where False. The emitted
    tokens of request i are its rows' draws for local steps 0..num_accepted[i]
    (`emitted_mask`). Written into `out` when given.
    """
    accepted = (row_drafts >= 0) & (row_tokens == row_drafts)
    if draft_allowed is not None:
        accepted = accepted & draft_allowed
    return _first_rejection(accepted, row_to_req, local_step, num_reqs, out)


def emitted_mask(num_accepted: torch.Tensor, row_to_req: torch.Tensor, local_step: torch.Tensor) -> torch.Tensor:
    """[rows] bool: row j of request i emits a token iff j <= num_accepted[i]."""
    return local_step <= num_accepted[row_to_req]


def target_probs(logits: torch.Tensor, params: RowParams, token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The processed distribution each row's draw follows.

    Parameters: `logits` [rows, V] (read as f32), their `params` and
    `token_bitmask` ([rows, ceil(V / 32)] int32 or None), as `sample` takes them.
    Returns: [rows, V] f64 by token id: the kept masses of
    `engine.sampling.thresholds.row_distribution` (the sampler's own
    suppression, temperature and filters) over their total, the
    distribution the sampler's inverse CDF draws from; greedy rows one-hot
    at the greedy token (largest valid score, smallest id), forced rows
    one-hot at the forced token. Capture-safe.

    float64 because rejection verification compares p(d) with u * q(d) and
    takes max(p - q, 0): in float32 the residual of two close distributions
    is mostly rounding noise, and the sampler's own p is float64 already.
    """
    scores, _ = controlled_scores(logits.to(torch.float32), token_bitmask)  # [rows, V]
    vocab = scores.shape[1]
    rows = expand_rows(params, vocab)
    masked = suppressed_scores(scores, rows)
    best, greedy = first_max(masked)  # ties to the smallest id
    d = row_distribution(masked, best, rows)
    probs = d.probabilities()  # [rows, V] f64: the kept masses over their total
    ids = torch.arange(vocab, device=scores.device)
    one_hot_token = torch.where(rows.forced >= 0, rows.forced, greedy)
    one_hot = (ids == one_hot_token[:, None]).to(torch.float64)
    return torch.where((rows.greedy | (rows.forced >= 0))[:, None], one_hot, probs)


def restrict_to_top_k(dist: torch.Tensor, k_rows: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """`dist` [rows, V] cut to each row's top-k (see `top_k_mask`) and renormalised.

    A row with no mass (a padding row's missing draft distribution) stays zero.
    """
    kept = torch.where(top_k_mask(dist, k_rows, max_k), dist, torch.zeros((), dtype=dist.dtype, device=dist.device))
    mass = kept.sum(-1, keepdim=True)
    return torch.where(mass > 0, kept / torch.where(mass > 0, mass, torch.ones_like(mass)), kept)


def draft_in_top_k(scores: torch.Tensor, row_drafts: torch.Tensor, k_rows: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """[rows] bool: the row's draft lies in the top-k of `scores` [rows, V]
    (the target's logits or probabilities); rows with k <= 0 allow any draft,
    rows without a draft allow nothing. The strict-mode `draft_allowed`."""
    in_top = top_k_mask(scores, k_rows, max_k).gather(1, row_drafts.clamp(min=0)[:, None]).squeeze(1)
    return (row_drafts >= 0) & in_top


def verify_rejection(
    p: torch.Tensor,
    row_drafts: torch.Tensor,
    q: torch.Tensor | None,
    seed: torch.Tensor,
    position: torch.Tensor,
    row_to_req: torch.Tensor,
    local_step: torch.Tensor,
    num_reqs: int,
    out_tokens: torch.Tensor,
    *,
    row_tokens: torch.Tensor | None = None,
    top_k_space: torch.Tensor | None = None,
    max_top_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rejection-mode verification; returns `num_accepted` [num_reqs] int64.

    p [rows, V] f64: each row's target distribution (`target_probs`);
    row_drafts [rows] int64, -1 = no draft; q [rows, V] or None: the draft
    distribution each row's draft was drawn from, None = drafts without
    probabilities (one-hot q at the draft); seed [num_reqs] int64 (uint64 bits);
    position [rows] int64: the absolute position each row produces.

    Writes `out_tokens` [rows] int64: on emitted rows (`emitted_mask`) the
    accepted draft, the residual draw at the first rejection, or the bonus
    token on a request's last row when all its drafts were accepted; -1 on
    rows that emit nothing.

    Bonus token: with `row_tokens` (the sampler's draws for these rows) it is
    the row's own draw, so a request whose drafts are all accepted (or that has
    none) emits exactly what the normal sampler would. In top-k-space mode the
    row's draw is kept when it lies in the restricted target's support, else a
    Gumbel race over the restricted p (stream TARGET) decides; both are exact
    draws from the restricted p (the race keeps the same noise per token id,
    so its winner is the unrestricted winner whenever that one survives).
    Without `row_tokens` the bonus is that race over p.

    top_k_space [num_reqs] int64 (0 = off) switches on top-k-space mode per
    request; `max_top_k` bounds every k (None: the vocabulary, a full sort).
    In that mode the drafts must have been drawn from q cut to its top-k (what
    a draft head working in top-k space does); q is cut here the same way.
    """
    seed_rows = seed[row_to_req]  # [rows]
    if q is not None:
        q = q.to(p.dtype)
    if top_k_space is not None:
        k_rows = top_k_space[row_to_req]
        p = restrict_to_top_k(p, k_rows, max_top_k)
        if q is not None:
            q = restrict_to_top_k(q, k_rows, max_top_k)
    has_draft = row_drafts >= 0
    drafts = row_drafts.clamp(min=0)[:, None]  # [rows, 1]
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    counter0 = torch.zeros((), dtype=torch.int64, device=p.device)

    p_draft = p.gather(1, drafts).squeeze(1)
    if q is None:
        q_draft = torch.ones_like(p_draft)
        # max(p - onehot(d), 0): p with the draft's mass removed.
        residual = p.scatter(1, drafts, zero.expand_as(drafts))
    else:
        q_draft = q.gather(1, drafts).squeeze(1)
        residual = (p - q).clamp_(min=0)
    u_accept = uniform(seed_rows, position, ACCEPT, counter0)
    accepted = has_draft & (u_accept * q_draft < p_draft)

    # p == q leaves no residual mass (see the module docstring): draw from p. A residual
    # probability has a positive mass iff it is >= 2**-60; a NaN has none.
    residual.nan_to_num_(0.0)  # a fresh tensor: the scatter's or the clamp's
    degenerate = residual.amax(-1, keepdim=True) < 1 / MASS_SCALE
    masses = probability_masses(torch.where(degenerate, p, residual, out=residual))  # [rows, V] int64
    residual_token = inverse_cdf(masses, uniform(seed_rows, position, RESIDUAL, counter0))

    if row_tokens is None or top_k_space is not None:
        vocab = p.shape[1]
        # log 0 = -inf never wins; a NaN row's winner V is clamped into the vocabulary.
        raced = gumbel_race(torch.log(p), torch.arange(vocab, device=p.device), None, seed_rows, position, vocab)
        raced = raced.clamp(max=vocab - 1)
    if row_tokens is None:
        bonus = raced
    elif top_k_space is None:
        bonus = row_tokens
    else:
        own_in_support = p.gather(1, row_tokens.clamp(min=0)[:, None]).squeeze(1) > 0
        bonus = torch.where(own_in_support, row_tokens, raced)

    num_accepted = _first_rejection(accepted, row_to_req, local_step, num_reqs, out)
    token = torch.where(accepted, row_drafts, torch.where(has_draft, residual_token, bonus))
    emitted = emitted_mask(num_accepted, row_to_req, local_step)
    out_tokens.copy_(torch.where(emitted, token, torch.full_like(token, -1)))
    return num_accepted
