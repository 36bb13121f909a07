"""The fused sampler: per-row processing, the draw, logprobs (docs/contract.md §2).

Order per sample row: fp32 logits -> forced token -> EOS/stop suppression ->
temperature -> top-k -> top-p -> min-p -> draw -> logprobs.

Definitions every path here shares (the fast path `sample`, the exact path
`sample_exact` and the sort-based `sample_reference`):

- Processed logits z = (raw - M) / T, with M the largest raw logit that is not
  suppressed and T the temperature (1 for greedy rows); suppressed stop ids
  get z = -inf. Probabilities p = exp(z - log Z) in float64, where Z is the sum
  of exp(z) (float32 values) taken as float32 sums over fixed blocks of
  `BLOCK` tokens, added in float64. Fixed blocks make Z, and so every filter
  decision, independent of how many rows share the call.
- top-k keeps every token whose z >= the k-th largest z.
- top-p works on the distribution renormalised after top-k (as engines do):
  walking tokens by decreasing z, t* is the probability of the first token at
  which the cumulative kept mass reaches top_p * (mass kept by top-k); it keeps
  every token with p >= t* (ties included), and everything when rounding
  keeps the sum from ever reaching that level.
- min-p keeps p >= min_p * max p; the ratio is the same before or after
  renormalisation, so it is taken on p directly.
- Greedy (T = 0): the largest raw logit among unsuppressed tokens, ties to the
  smallest id. Filters do not change it (the maximum is always kept); they
  still define the processed distribution reported in "processed" mode.
- Filtered rows draw by a Gumbel race, argmax over kept tokens of
  z + G(token id), ties to the smallest id, with G from `engine.sampling.rng` keyed by
  (seed, position, TARGET, token id). The noise of a token does not depend on
  which other tokens are candidates, so a race over the kept candidates gives
  the same token as a race over the whole vocabulary.
- Rows without any filter draw by inverse CDF with one uniform per row
  (stream TARGET, counter `INVERSE_CDF_COUNTER`): pick the block whose float64
  cumulative block mass first exceeds u * Z, then the token inside it.

Failed rows. A row whose logits hold NaN or +-inf, or whose controls leave
no token (every token a suppressed stop id), gets an error code in
`SampleOutput.error` (`RowError`), decided inside the captured step from the
row itself. Its outputs are the placeholder: token `PLACEHOLDER_TOKEN`
(in the vocabulary, so nothing downstream indexes out of range), logprob 0,
rank 0, top ids -1, top logprobs 0, never flagged for the exact path. The
caller must not emit it. Every computation here is per row, so a failed row
changes no other row's bits.

The fast path takes the top C (`candidate_cap`) raw logits per row and applies
the filters there with the full-row normaliser, so nothing over the whole
vocabulary is sorted or hashed. When the kept set may reach past the C-th
candidate (or a tie at the boundary makes the candidate set ambiguous), it
sets `needs_exact` for the row; `sample_exact` recomputes those rows over the
full vocabulary and its results equal what an unlimited C would give.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.sampling.rng import TARGET, gumbel, uniform
from graphs.step_fields import RowParams, SampleOutput


class RowError(IntEnum):
    """`SampleOutput.error` codes (int64 on the device)."""

    OK = 0
    LOGITS_NOT_FINITE = 1  # a NaN or +-inf logit in the row
    NOTHING_LEFT = 2  # the controls leave no token (EOS / stop suppression covers the vocabulary)
    HIDDEN_NOT_FINITE = 3  # set by the caller that owns the hidden states (`fail_rows`)


PLACEHOLDER_TOKEN = 0  # the token of a failed row: in the vocabulary, never emitted
BLOCK = 1024  # tokens per block of the normaliser and the inverse-CDF draw
INVERSE_CDF_COUNTER = 0xFFFFFFFF  # counter of the plain draw's uniform; never a token id
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplerConfig:
    candidate_cap: int = 1024  # C: candidates per row on the fast path
    max_logprobs: int = 20  # largest top-N the engine allocates for
    logprobs_mode: str = "raw"  # "raw": log-softmax of unprocessed logits; "processed": of the sampled distribution

    def __post_init__(self) -> None:
        for name in ("candidate_cap", "max_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: must be an int")
        if self.candidate_cap < 1:
            raise ValueError(f"candidate_cap={self.candidate_cap!r}: must be >= 1")
        if not 0 <= self.max_logprobs <= self.candidate_cap:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must lie in [0, candidate_cap={self.candidate_cap}]")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES}")


@dataclass
class _Rows:
    """Per-row parameters expanded from per-request ones."""

    greedy: torch.Tensor  # [rows] bool
    temperature: torch.Tensor  # [rows] f32, 1 for greedy rows
    top_k: torch.Tensor  # [rows] int64, V when off
    k_on: torch.Tensor  # [rows] bool
    top_p: torch.Tensor  # [rows] f64
    p_on: torch.Tensor
    min_p: torch.Tensor  # [rows] f64
    m_on: torch.Tensor
    plain: torch.Tensor  # [rows] bool: sampled, no filter -> inverse-CDF draw
    seed: torch.Tensor  # [rows] int64
    position: torch.Tensor  # [rows] int64
    stop_ids: torch.Tensor  # [rows, S] int64, clamped to >= 0
    stop_active: torch.Tensor  # [rows, S] bool: this id is suppressed on this row
    forced: torch.Tensor  # [rows] int64


def _expand(params: RowParams, vocab: int) -> _Rows:
    req = params.row_to_req
    temperature = params.temperatures[req]
    greedy = temperature == 0
    top_k = params.top_ks[req].to(torch.int64)
    k_on = (top_k > 0) & (top_k < vocab)
    top_p = params.top_ps[req].to(torch.float64)
    min_p = params.min_ps[req].to(torch.float64)
    p_on, m_on = top_p < 1, min_p > 0
    stop = params.stop_ids[req]
    return _Rows(
        greedy=greedy,
        temperature=torch.where(greedy, torch.ones_like(temperature), temperature),
        top_k=torch.where(k_on, top_k, torch.full_like(top_k, vocab)),
        k_on=k_on,
        top_p=top_p,
        p_on=p_on,
        min_p=min_p,
        m_on=m_on,
        plain=~greedy & ~k_on & ~p_on & ~m_on,
        seed=params.seeds[req],
        position=params.sample_positions[req] + params.local_step,
        stop_ids=stop.clamp(min=0),
        stop_active=params.eos_suppression_rows[:, None] & (stop >= 0),
        forced=params.forced_tokens,
    )


def _block_log_normaliser(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block masses [rows, blocks] (f32 sums of BLOCK tokens) and log of their f64 total."""
    rows, vocab = e.shape
    full = vocab // BLOCK
    parts = []
    if full:
        # [rows, full, BLOCK] view of the leading tokens (row stride stays V).
        parts.append(e[:, : full * BLOCK].view(rows, full, BLOCK).sum(-1))
    if vocab % BLOCK:
        parts.append(e[:, full * BLOCK :].sum(-1, keepdim=True))
    block_mass = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return block_mass, torch.log(block_mass.to(torch.float64).sum(-1))


def _exp_processed(raw: torch.Tensor, shift: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """exp(z) over the full row, [rows, V] f32, suppressed stop ids set to 0."""
    e = torch.sub(raw, shift[:, None]).div_(rows.temperature[:, None]).exp_()
    # Every slot that lands on a suppressed id writes 0, also an inactive
    # (padding) slot aimed at the same id: scatter order is unspecified on
    # CUDA, so two slots of one row must never write different values.
    ids, active = rows.stop_ids, rows.stop_active  # [rows, S]
    blocked = (active[:, None, :] & (ids[:, None, :] == ids[:, :, None])).any(-1)  # [rows, S]
    kept_value = torch.where(blocked, torch.zeros((), dtype=e.dtype, device=e.device), e.gather(1, ids))
    return e.scatter_(1, ids, kept_value)


def _inverse_cdf_draw(e: torch.Tensor, block_mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from weights `e` [rows, V] f32 by inverse CDF at u [rows] f64."""
    rows, vocab = e.shape
    block_cum = block_mass.to(torch.float64).cumsum(-1)  # [rows, blocks]
    target = (u * block_cum[:, -1])[:, None]
    block = torch.searchsorted(block_cum, target, right=True).clamp_(max=block_cum.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    width = min(BLOCK, vocab)
    ids = block * BLOCK + torch.arange(width, device=e.device)  # [rows, width]
    in_vocab = ids < vocab
    ids = ids.clamp(max=vocab - 1)
    weights = torch.where(in_vocab, e.gather(1, ids), torch.zeros((), dtype=e.dtype, device=e.device))
    inner_cum = weights.to(torch.float64).cumsum(-1)
    pick = torch.searchsorted(inner_cum, target - before, right=True)
    # f32 block sums and f64 inner sums round differently: never step past
    # the block's last token of nonzero weight.
    last_nonzero = torch.where(weights > 0, torch.arange(width, device=e.device), -1).amax(-1, keepdim=True)
    pick = torch.minimum(pick, last_nonzero.clamp(min=0))
    return ids.gather(1, pick).squeeze(1)


def _min_id_of_max(score: torch.Tensor, ids: torch.Tensor, fill: int) -> torch.Tensor:
    """Per row, the smallest id among entries whose score equals the row maximum."""
    best = score.amax(-1, keepdim=True)
    return torch.where(score == best, ids, torch.full_like(ids, fill)).amin(-1)


def order_candidates(values: torch.Tensor, ids: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first `cap` of (values, ids) [rows, M >= cap] in (value desc, id
    asc) order, and the boundary value: every token not among them has a raw
    logit <= it. The id sort first, then a stable value sort, fixes the order
    of ties that topk (or a merge of shards) leaves unspecified."""
    by_id = torch.argsort(ids, dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :cap]
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    return values, ids, values[:, cap - 1]


def suppression_and_shift(
    cand_raw: torch.Tensor, cand_ids: torch.Tensor, boundary_raw: torch.Tensor, rows: _Rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [rows, C]: candidate not a suppressed stop id, any_valid [rows],
    shift M [rows]: the largest unsuppressed raw logit).

    M is a candidate unless every candidate is a suppressed stop id (C <= the
    number of stop ids); such a row goes to the exact path and the boundary
    value keeps its numbers finite."""
    blocked = ((cand_ids[:, :, None] == rows.stop_ids[:, None, :]) & rows.stop_active[:, None, :]).any(-1)
    valid = ~blocked
    any_valid = valid.any(-1)
    neg_inf = torch.full((), -math.inf, dtype=cand_raw.dtype, device=cand_raw.device)
    shift = torch.where(any_valid, torch.where(valid, cand_raw, neg_inf).amax(-1), boundary_raw)
    return valid, any_valid, shift


@dataclass
class CandidateDecision:
    """What the filters and draws decided over a row's candidates."""

    zs: torch.Tensor  # [rows, C] processed logits, (z desc, id asc), suppressed last
    zs_ids: torch.Tensor  # [rows, C]
    p: torch.Tensor  # [rows, C] f64 probabilities under the full-row normaliser
    kept: torch.Tensor  # [rows, C] bool
    filter_ambiguous: torch.Tensor  # [rows] bool
    reaches_tail: torch.Tensor  # [rows] bool: the kept set may extend past the candidates
    raced: torch.Tensor  # [rows] int64: Gumbel race winner over the kept candidates
    greedy_token: torch.Tensor  # [rows] int64
    greedy_tie_in_tail: torch.Tensor  # [rows] bool

    def needs_exact(self, rows: _Rows, any_valid: torch.Tensor) -> torch.Tensor:
        """[rows] bool: the candidates cannot settle the row's draw."""
        filtered = ~rows.greedy & ~rows.plain
        return (
            (filtered & (self.reaches_tail | self.filter_ambiguous))
            | (rows.greedy & self.greedy_tie_in_tail)
            | ~any_valid
        )


def decide_on_candidates(
    cand_raw: torch.Tensor,
    cand_ids: torch.Tensor,
    boundary_raw: torch.Tensor,
    valid: torch.Tensor,
    shift: torch.Tensor,
    log_z: torch.Tensor,
    rows: _Rows,
    cap: int,
    has_tail: bool,
    vocab: int,
) -> CandidateDecision:
    """Filters, race and greedy pick over ordered candidates, given the
    full-row normaliser log Z. Shared by `sample` and the vocab-parallel
    candidate exchange, which only differ in where these inputs come from."""
    neg_inf = torch.full((), -math.inf, dtype=torch.float32, device=cand_raw.device)
    # Processed candidates in (z desc, id asc) order: suppressed ones last.
    cand_z = torch.where(valid, (cand_raw - shift[:, None]) / rows.temperature[:, None], neg_inf)
    by_z = torch.sort(cand_z, dim=1, descending=True, stable=True).indices
    zs, zs_ids = cand_z.gather(1, by_z), cand_ids.gather(1, by_z)
    p = torch.exp(zs.to(torch.float64) - log_z[:, None])  # [rows, C] f64, full-row normaliser
    boundary_z = (boundary_raw - shift) / rows.temperature
    boundary_p = torch.exp(boundary_z.to(torch.float64) - log_z)  # largest p of any non-candidate
    alive = zs > -math.inf

    kept, filter_ambiguous, boundary_kept = _filter_candidates(zs, p, alive, boundary_z, boundary_p, rows, cap, has_tail)
    reaches_tail = boundary_kept if has_tail else torch.zeros_like(rows.greedy)

    # Gumbel race over kept candidates; greedy over unsuppressed raw.
    noise = gumbel(rows.seed[:, None], rows.position[:, None], TARGET, zs_ids)  # [rows, C] f64
    race = torch.where(kept, zs.to(torch.float64) + noise, -math.inf)
    valid_raw = torch.where(valid, cand_raw, neg_inf)
    return CandidateDecision(
        zs=zs,
        zs_ids=zs_ids,
        p=p,
        kept=kept,
        filter_ambiguous=filter_ambiguous,
        reaches_tail=reaches_tail,
        raced=_min_id_of_max(race, zs_ids, vocab),
        greedy_token=_min_id_of_max(valid_raw, cand_ids, vocab),
        greedy_tie_in_tail=has_tail & (valid_raw.amax(-1) <= boundary_raw),
    )


def sample(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    out: SampleOutput | None = None,
    *,
    compute_logprobs: bool = True,
) -> SampleOutput:
    """Sample one token per row of `logits` [rows, V]; capture-safe.

    No host syncs, no data-dependent shapes, no generator state; results are
    written into `out` (allocated when None, top-N = cfg.max_logprobs). Rows
    flagged in `out.needs_exact` must be redone with `sample_exact`; rows
    with a nonzero `out.error` hold the placeholder (module docstring).
    `compute_logprobs=False` leaves logprob, rank and top-N of the other
    rows untouched.
    """
    rows_n, vocab = logits.shape
    if out is None:
        out = SampleOutput.allocate(rows_n, cfg.max_logprobs, logits.device)
    num_top = out.top_ids.shape[1]
    cap = min(cfg.candidate_cap, vocab)
    if num_top > cap:
        raise ValueError(f"top-N={num_top}: exceeds the candidate count min(candidate_cap, V)={cap}")
    has_tail = cap < vocab
    raw = logits.to(torch.float32)  # [rows, V]
    rows = _expand(params, vocab)

    # Candidates: top C raw logits in (raw desc, id asc) order.
    cand_raw, cand_ids, boundary_raw = order_candidates(*torch.topk(raw, cap), cap)  # [rows, C]
    valid, any_valid, shift = suppression_and_shift(cand_raw, cand_ids, boundary_raw, rows)
    e = _exp_processed(raw, shift, rows)  # [rows, V] f32
    block_mass, log_z = _block_log_normaliser(e)
    d = decide_on_candidates(cand_raw, cand_ids, boundary_raw, valid, shift, log_z, rows, cap, has_tail, vocab)

    # Rows without any filter draw by inverse CDF over the whole row.
    u = uniform(rows.seed, rows.position, TARGET, torch.full((), INVERSE_CDF_COUNTER, device=raw.device))
    plain_token = _inverse_cdf_draw(e, block_mass, u)
    token = torch.where(rows.greedy, d.greedy_token, torch.where(rows.plain, plain_token, d.raced))
    token = torch.where(rows.forced >= 0, rows.forced, token)
    # A NaN row's picks may be V (no candidate equals the NaN maximum): the
    # placeholder goes in before anything indexes by token. Without a tail,
    # no unsuppressed candidate means no unsuppressed token at all; with one,
    # the exact path decides.
    error = _row_error(raw, ~any_valid if not has_tail else torch.zeros_like(any_valid))
    failed = error != RowError.OK
    token = torch.where(failed, PLACEHOLDER_TOKEN, token)

    needs_exact = d.needs_exact(rows, any_valid)
    if compute_logprobs:
        if cfg.logprobs_mode == "raw":
            needs_exact = needs_exact | _raw_logprobs(raw, cand_raw, cand_ids, token, num_top, has_tail, out)
        else:
            # A plain row's processed distribution covers the whole row: its
            # logprobs (like those of any kept set reaching the tail) come
            # from the exact path.
            _processed_logprobs(log_z, d.zs, d.zs_ids, d.p, d.kept, token, num_top, out)
            needs_exact = needs_exact | (has_tail & (rows.plain | d.reaches_tail | d.filter_ambiguous))
    out.tokens.copy_(token)
    out.needs_exact.copy_(needs_exact)
    out.error.copy_(error)
    _write_placeholders(out, failed)
    return out


def _row_error(raw: torch.Tensor, nothing_left: torch.Tensor) -> torch.Tensor:
    """[rows] int64 RowError of logits `raw` [rows, V]: not finite first, then nothing left."""
    finite = torch.isfinite(raw).all(-1)
    ok = torch.full_like(nothing_left, int(RowError.OK), dtype=torch.int64)
    left = torch.where(nothing_left, int(RowError.NOTHING_LEFT), ok)
    return torch.where(finite, left, int(RowError.LOGITS_NOT_FINITE))


def _write_placeholders(out: SampleOutput, failed: torch.Tensor) -> None:
    """The placeholder outputs on `failed` rows [rows] bool; capture-safe."""
    out.tokens.masked_fill_(failed, PLACEHOLDER_TOKEN)
    out.logprob.masked_fill_(failed, 0.0)
    out.rank.masked_fill_(failed, 0)
    out.top_ids.masked_fill_(failed[:, None], -1)
    out.top_logprobs.masked_fill_(failed[:, None], 0.0)
    out.needs_exact.masked_fill_(failed, False)


def fail_rows(out: SampleOutput, failed: torch.Tensor, code: RowError) -> None:
    """Mark `failed` rows [rows] bool with `code` (overriding the sampler's
    own code) and write the placeholder outputs; capture-safe. For failures
    the sampler cannot see, such as a non-finite hidden state."""
    out.error.masked_fill_(failed, int(code))
    _write_placeholders(out, failed)


def _filter_candidates(
    zs: torch.Tensor, p: torch.Tensor, alive: torch.Tensor, boundary_z: torch.Tensor, boundary_p: torch.Tensor,
    rows: _Rows, cap: int, has_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept mask over sorted candidates [rows, C], rows whose top-p needs the tail, and
    rows whose filters would keep a token at the boundary (z = boundary_z): the best a
    token outside the candidates can be, so the kept set may reach past them.

    The boundary test runs the thresholds themselves, not "is a kept candidate at the
    boundary": the candidate that sits there may be a suppressed stop id, never kept,
    while an unsuppressed token of the same logit outside the candidates is kept.
    """
    # top-k: the k-th largest z, when it is a candidate.
    k_index = (rows.top_k.clamp(max=cap) - 1)[:, None]
    kth_z = zs.gather(1, k_index).squeeze(1)
    k_known = (rows.top_k <= cap) & ((kth_z > boundary_z) if has_tail else torch.ones_like(rows.k_on))
    k_mask = ~rows.k_on[:, None] | (zs >= kth_z[:, None])
    # The top-k mass (renormaliser of top-p) is only known when the top-k set
    # lies inside the candidates; an unknown one sends the row to the exact path.
    filter_ambiguous = rows.k_on & ~k_known & rows.p_on

    k_p = torch.where(rows.k_on[:, None] & k_mask & alive, p, torch.zeros((), dtype=p.dtype, device=p.device))
    k_mass = torch.where(rows.k_on, k_p.cumsum(-1)[:, -1], torch.ones_like(rows.top_p))
    cum = torch.where(rows.k_on[:, None], k_p, torch.where(alive, p, torch.zeros_like(p))).cumsum(-1)
    reached = cum >= (rows.top_p * k_mass)[:, None]
    first = reached.to(torch.int8).argmax(-1, keepdim=True)  # first index that reaches top_p
    t_star = torch.where(reached.any(-1, keepdim=True), p.gather(1, first), torch.zeros_like(first, dtype=p.dtype))
    p_mask = ~rows.p_on[:, None] | (p >= t_star)

    min_p_level = rows.min_p * p[:, 0]
    m_mask = ~rows.m_on[:, None] | (p >= min_p_level[:, None])
    boundary_kept = (
        (~rows.k_on | (boundary_z >= kth_z))
        & (~rows.p_on | (boundary_p >= t_star.squeeze(1)))
        & (~rows.m_on | (boundary_p >= min_p_level))
    )
    return alive & k_mask & p_mask & m_mask, filter_ambiguous, boundary_kept


def raw_log_normaliser(raw: torch.Tensor, raw_max: torch.Tensor) -> torch.Tensor:
    """[rows] f64 log-sum-exp of raw logits [rows, V] (`raw_max` their row
    maximum), summed over the same fixed blocks as every other normaliser
    here, so a logprob does not depend on which path reported it."""
    _, log_z = _block_log_normaliser(torch.sub(raw, raw_max[:, None]).exp_())
    return raw_max.to(torch.float64) + log_z


def _raw_logprobs(
    raw: torch.Tensor,
    cand_raw: torch.Tensor,
    cand_ids: torch.Tensor,
    token: torch.Tensor,
    num_top: int,
    has_tail: bool,
    out: SampleOutput,
) -> torch.Tensor:
    """Log-softmax of the unprocessed logits; returns rows whose top-N ties reach the tail."""
    lse = raw_log_normaliser(raw, cand_raw[:, 0])  # [rows]
    token_raw = raw.gather(1, token[:, None])
    out.logprob.copy_(token_raw.squeeze(1).to(torch.float64) - lse)
    out.rank.copy_((raw > token_raw).sum(-1) + 1)
    if num_top == 0:
        return torch.zeros_like(token, dtype=torch.bool)
    out.top_ids.copy_(cand_ids[:, :num_top])
    out.top_logprobs.copy_(cand_raw[:, :num_top].to(torch.float64) - lse[:, None])
    # A tie at the N-th value that continues to the C-th candidate may hide
    # smaller ids outside the candidates.
    if not has_tail:
        return torch.zeros_like(token, dtype=torch.bool)
    return cand_raw[:, num_top - 1] <= cand_raw[:, -1]


def _processed_logprobs(
    log_z: torch.Tensor,
    zs: torch.Tensor,
    zs_ids: torch.Tensor,
    p: torch.Tensor,
    kept: torch.Tensor,
    token: torch.Tensor,
    num_top: int,
    out: SampleOutput,
) -> None:
    """Logprobs of the processed, renormalised distribution over the kept candidates."""
    log_mass = torch.log(torch.where(kept, p, torch.zeros_like(p)).cumsum(-1)[:, -1])  # [rows] f64
    lq = torch.where(kept, zs.to(torch.float64) - log_z[:, None] - log_mass[:, None], -math.inf)  # [rows, C]
    at_token = (zs_ids == token[:, None]) & kept
    # A filtered or suppressed token has logprob -inf: every kept token outranks it.
    token_z = torch.where(at_token, zs, -math.inf).amax(-1)
    out.logprob.copy_(torch.where(at_token, lq, -math.inf).amax(-1))
    out.rank.copy_((kept & (zs > token_z[:, None])).sum(-1) + 1)
    if num_top:
        out.top_ids.copy_(torch.where(kept[:, :num_top], zs_ids[:, :num_top], -1))
        out.top_logprobs.copy_(lq[:, :num_top])


def _exact_kept(raw: torch.Tensor, rows: _Rows, i: int):
    """Row i's processed, sorted distribution and kept set over the whole vocabulary.

    Returns (z sorted desc, their ids, p, kept mask, exp(z) by id, block masses,
    log Z, unsuppressed mask by id).
    """
    vocab = raw.shape[0]
    temperature = rows.temperature[i : i + 1]
    suppressed = rows.stop_ids[i][rows.stop_active[i]]
    unsuppressed = torch.ones(vocab, dtype=torch.bool, device=raw.device)
    unsuppressed[suppressed] = False
    shift = raw[unsuppressed].max()
    z = torch.where(unsuppressed, (raw - shift) / temperature, -math.inf)  # [V] f32
    e = torch.where(unsuppressed, torch.sub(raw, shift).div_(temperature).exp_(), 0.0)
    block_mass, log_z = _block_log_normaliser(e[None, :])
    block_mass, log_z = block_mass[0], log_z[0]

    zs, ids = torch.sort(z, descending=True, stable=True)  # ties keep id order
    p = torch.exp(zs.to(torch.float64) - log_z)
    kept = zs > -math.inf
    k_on, p_on, m_on = bool(rows.k_on[i]), bool(rows.p_on[i]), bool(rows.m_on[i])
    if k_on:
        kept &= zs >= zs[int(rows.top_k[i]) - 1]
    if p_on:
        k_p = torch.where(kept, p, 0.0)
        k_mass = k_p.cumsum(0)[-1] if k_on else torch.ones((), dtype=torch.float64)
        reached = torch.nonzero(k_p.cumsum(0) >= rows.top_p[i] * k_mass)
        if len(reached):
            kept &= p >= p[reached[0, 0]]
    if m_on:
        kept &= p >= rows.min_p[i] * p[0]
    return zs, ids, p, kept, e, block_mass, log_z, unsuppressed


def kept_sets(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[rows, V] bool: the tokens each row's filters keep, by the sort-based definition."""
    raw = logits.to(torch.float32)
    rows = _expand(params, raw.shape[1])
    mask = torch.zeros(raw.shape, dtype=torch.bool, device=raw.device)
    for i in range(raw.shape[0]):
        _, ids, _, kept, *_ = _exact_kept(raw[i], rows, i)
        mask[i, ids[kept]] = True
    return mask


def _exact_row(
    raw: torch.Tensor, rows: _Rows, i: int, cfg: SamplerConfig, num_top: int, compute_logprobs: bool = True
) -> tuple[int, float, int, list[int], list[float]]:
    """One row over the whole vocabulary, sort-based, straight from the definitions above.

    Returns (token, logprob, rank, top ids, top logprobs).
    """
    zs, ids, p, kept, e, block_mass, log_z, unsuppressed = _exact_kept(raw, rows, i)
    seed, position = rows.seed[i], rows.position[i]
    if bool(rows.greedy[i]):
        token = int(torch.argmax(torch.where(unsuppressed, raw, -math.inf)))  # first maximum = smallest id
    elif bool(rows.plain[i]):
        u = float(uniform(seed, position, TARGET, torch.tensor(INVERSE_CDF_COUNTER)))
        block_cum = block_mass.to(torch.float64).cumsum(0)
        target = u * float(block_cum[-1])
        block = min(int((block_cum <= target).sum()), len(block_mass) - 1)
        before = float(block_cum[block - 1]) if block else 0.0
        weights = e[block * BLOCK : (block + 1) * BLOCK]
        pick = int((weights.to(torch.float64).cumsum(0) <= target - before).sum())
        pick = min(pick, int(torch.nonzero(weights > 0)[-1, 0]))
        token = block * BLOCK + pick
    else:
        # Noise only for the kept tokens: keyed by token id, so the same
        # values a race over the whole vocabulary would see.
        kept_ids = ids[kept]
        race = zs[kept].to(torch.float64) + gumbel(seed, position, TARGET, kept_ids)
        token = int(kept_ids[race == race.max()].min())
    if int(rows.forced[i]) >= 0:
        token = int(rows.forced[i])

    if not compute_logprobs:
        return token, 0.0, 0, [], []
    if cfg.logprobs_mode == "raw":
        raw_max = raw.max()
        _, log_raw_mass = _block_log_normaliser(torch.sub(raw, raw_max).exp_()[None, :])
        lse = raw_max.to(torch.float64) + log_raw_mass[0]
        logprob = float(raw[token].to(torch.float64) - lse)
        rank = int((raw > raw[token]).sum()) + 1
        values, order = torch.sort(raw, descending=True, stable=True)
        top_ids = order[:num_top].tolist()
        top_lps = (values[:num_top].to(torch.float64) - lse).tolist()
    else:
        log_mass = torch.log(torch.where(kept, p, 0.0).cumsum(0)[-1])
        lq = torch.where(kept, zs.to(torch.float64) - log_z - log_mass, -math.inf)
        at_token = kept & (ids == token)
        token_z = zs[at_token].max() if at_token.any() else torch.tensor(-math.inf)
        logprob = float(lq[at_token].max()) if at_token.any() else -math.inf
        rank = int((kept & (zs > token_z)).sum()) + 1
        top_ids = torch.where(kept[:num_top], ids[:num_top], -1).tolist()
        top_lps = lq[:num_top].tolist()
    return token, logprob, rank, top_ids, top_lps


def _exact_row_error(raw: torch.Tensor, rows: _Rows, i: int) -> RowError:
    """Row i's RowError over its whole logits row `raw` [V] (host-synchronising)."""
    if not bool(torch.isfinite(raw).all()):
        return RowError.LOGITS_NOT_FINITE
    unsuppressed = torch.ones(raw.shape[0], dtype=torch.bool, device=raw.device)
    unsuppressed[rows.stop_ids[i][rows.stop_active[i]]] = False
    return RowError.OK if bool(unsuppressed.any()) else RowError.NOTHING_LEFT


def _write_exact_rows(
    logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, row_index: list[int], out: SampleOutput,
    compute_logprobs: bool = True,
) -> None:
    raw = logits.to(torch.float32)
    rows = _expand(params, raw.shape[1])
    num_top = out.top_ids.shape[1]
    failed = torch.zeros(out.tokens.shape[0], dtype=torch.bool, device=out.tokens.device)
    for i in row_index:
        error = _exact_row_error(raw[i], rows, i)
        out.error[i] = error
        if error != RowError.OK:
            failed[i] = True
            continue
        token, logprob, rank, top_ids, top_lps = _exact_row(raw[i], rows, i, cfg, num_top, compute_logprobs)
        out.tokens[i] = token
        out.needs_exact[i] = False
        if not compute_logprobs:
            continue
        out.logprob[i] = logprob
        out.rank[i] = rank
        out.top_ids[i] = torch.tensor(top_ids, dtype=torch.int64)
        out.top_logprobs[i] = torch.tensor(top_lps, dtype=torch.float64)
    _write_placeholders(out, failed)


def sample_exact(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    rows: torch.Tensor,
    out: SampleOutput,
    *,
    compute_logprobs: bool = True,
) -> SampleOutput:
    """Redo the given rows (bool mask [rows] or index tensor) over the full vocabulary.

    Eager and host-synchronising: it runs after the captured step, only for
    rows the fast path flagged. Results equal an unlimited `candidate_cap`.
    `compute_logprobs=False` leaves logprob, rank and top-N untouched.
    """
    rows = rows.to(logits.device)
    index = torch.nonzero(rows).flatten() if rows.dtype == torch.bool else rows.flatten()
    _write_exact_rows(logits, params, cfg, index.tolist(), out, compute_logprobs)
    return out


def sample_reference(logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, num_top: int | None = None) -> SampleOutput:
    """Every row by the sort-based definition (tests and benchmarks)."""
    rows_n = logits.shape[0]
    out = SampleOutput.allocate(rows_n, cfg.max_logprobs if num_top is None else num_top, logits.device)
    _write_exact_rows(logits, params, cfg, list(range(rows_n)), out)
    return out
