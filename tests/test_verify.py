"""Draft verification: strict equals plain decoding, rejection mode keeps the
target distribution, top-k-space mode, padding rows, capture safety."""
from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling.exact import sample_reference
from engine.sampling.filters import top_k_mask
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from engine.sampling.verify import (
    accept_strict,
    draft_in_top_k,
    emitted_mask,
    restrict_to_top_k,
    target_probs,
    verify_rejection,
)
from graphs.capture_safety import capture_safety_check

CFG = SamplerConfig(max_logprobs=0)


def _draw(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """The engine's tokens."""
    out = SampleOutput.allocate(logits.shape[0], 0)
    sample(logits, params, CFG, out, compute_logprobs=False)
    return out.tokens


def _row_params(req: dict[str, np.ndarray], row_to_req: np.ndarray, local_step: np.ndarray, **kw) -> RowParams:
    return RowParams.from_numpy(
        temperatures=req["temperature"],
        top_ks=req["top_k"],
        top_ps=req["top_p"],
        min_ps=req["min_p"],
        seeds=req["seed"],
        sample_positions=req["position"],
        row_to_req=row_to_req,
        local_step=local_step,
        **kw,
    )


def _random_requests(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "temperature": rng.choice([0.0, 0.5, 1.0, 1.5], n).astype(np.float32),
        "top_k": rng.choice([0, 0, 3, 20], n).astype(np.int32),
        "top_p": rng.choice([1.0, 1.0, 0.9, 0.6], n).astype(np.float32),
        "min_p": rng.choice([0.0, 0.0, 0.05], n).astype(np.float32),
        "seed": rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, n, dtype=np.uint64),
        "position": rng.integers(0, 1000, n).astype(np.int64),
    }


# --- target_probs against the sampler's reference -----------------------------

@st.composite
def _batches(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(3, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    levels = draw(st.integers(2, 12))  # few distinct values: ties at every cut
    logits = torch.from_numpy(rng.integers(0, levels, (rows, vocab))).to(torch.float32) * draw(st.sampled_from([0.3, 1.0, 4.0]))
    req = _random_requests(rng, rows)
    req["top_k"] = rng.choice([0, 1, 2, 5, vocab, vocab + 3], rows).astype(np.int32)
    req["top_p"] = rng.choice([1.0, 0.95, 0.5, 0.1], rows).astype(np.float32)
    req["min_p"] = rng.choice([0.0, 0.2, 0.9], rows).astype(np.float32)
    stop_ids = np.where(rng.random((rows, 2)) < 0.5, rng.integers(0, vocab, (rows, 2)), -1)
    forced = np.where(rng.random(rows) < 0.15, rng.integers(0, vocab, rows), -1)
    params = _row_params(
        req, np.arange(rows), np.zeros(rows, np.int64), stop_ids=stop_ids, eos_suppression_rows=rng.random(rows) < 0.5, forced_tokens=forced
    )
    return logits, params, req, forced


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_target_probs_is_the_reference_processed_distribution(batch):
    logits, params, req, forced = batch
    vocab = logits.shape[1]
    p = target_probs(logits, params)
    assert p.dtype == torch.float64 and torch.isfinite(p).all()
    assert torch.allclose(p.sum(-1), torch.ones(p.shape[0], dtype=torch.float64), atol=1e-12)
    # processed-mode logprobs over the whole vocabulary list the kept set and its renormalised probabilities
    ref = sample_reference(logits, params, SamplerConfig(logprobs_mode="processed", max_logprobs=vocab), num_top=vocab)
    for i in range(logits.shape[0]):
        if forced[i] >= 0 or req["temperature"][i] == 0:
            token = int(ref.tokens[i])  # the forced or greedy token
            assert p[i, token] == 1.0 and int((p[i] > 0).sum()) == 1
            continue
        ids = ref.top_ids[i][ref.top_ids[i] >= 0]
        # The draw weighs each kept token by its integer mass floor(exp(z) * 2**S): a kept token
        # below 2**-S (z = -32 at V = 200) has mass 0, processed logprob -inf, and is never drawn.
        drawable = ids[ref.top_logprobs[i, : len(ids)] > -math.inf]
        assert set(torch.nonzero(p[i] > 0).flatten().tolist()) == set(drawable.tolist())
        torch.testing.assert_close(p[i, ids], ref.top_logprobs[i, : len(ids)].to(torch.float64).exp(), rtol=1e-5, atol=1e-7)
        assert p[i, int(ref.tokens[i])] > 0


# --- strict mode: identical to decoding one token per step ----------------------

def test_strict_equals_one_token_per_step_decoding():
    """240 sequences of 10 tokens on a toy model whose logits depend on the
    position and the previous token. Plain decoding samples one row per step;
    speculative decoding proposes 0..3 drafts per step (each the true next
    token with probability 0.6, else random, so right, wrong and partly right
    runs all occur), samples every row of the step and keeps the draws up to the
    first mismatch. The emitted sequences must be identical."""
    rng = np.random.default_rng(5)
    num_seqs, length, vocab, period = 240, 10, 64, 8
    table = torch.from_numpy(rng.standard_normal((period, vocab, vocab)).astype(np.float32)) * 2.5
    req = _random_requests(rng, num_seqs)
    start_pos = req["position"].copy()
    first_prev = rng.integers(0, vocab, num_seqs)

    def logits_at(position: np.ndarray, prev: np.ndarray) -> torch.Tensor:
        return table[torch.from_numpy(position % period), torch.from_numpy(prev)]

    reference = np.zeros((num_seqs, length + 4), np.int64)  # extra tokens: right drafts past the end
    prev = first_prev.copy()
    for t in range(length + 4):
        req["position"] = start_pos + t
        params = _row_params(req, np.arange(num_seqs), np.zeros(num_seqs, np.int64))
        prev = _draw(logits_at(start_pos + t, prev), params).numpy()
        reference[:, t] = prev

    emitted: list[list[int]] = [[] for _ in range(num_seqs)]
    accepted_total = rejected_total = 0
    while min(len(e) for e in emitted) < length:
        row_to_req, local_step, positions, prevs, drafts = [], [], [], [], []
        ks = rng.integers(0, 4, num_seqs)
        for i in range(num_seqs):
            pos = start_pos[i] + len(emitted[i])
            n_done = len(emitted[i])
            proposal = [
                int(reference[i, n_done + j]) if n_done + j < reference.shape[1] and rng.random() < 0.6 else int(rng.integers(0, vocab))
                for j in range(ks[i])
            ]
            last = emitted[i][-1] if emitted[i] else int(first_prev[i])
            for j in range(ks[i] + 1):
                row_to_req.append(i)
                local_step.append(j)
                positions.append(pos + j)
                prevs.append(last if j == 0 else proposal[j - 1])
                drafts.append(proposal[j] if j < ks[i] else -1)
        req["position"] = start_pos + np.array([len(e) for e in emitted])
        row_to_req_np, local_step_np = np.array(row_to_req), np.array(local_step)
        params = _row_params(req, row_to_req_np, local_step_np)
        tokens = _draw(logits_at(np.array(positions), np.array(prevs)), params)
        num_accepted = accept_strict(tokens, torch.tensor(drafts), params.row_to_req, params.local_step, num_seqs)
        keep = emitted_mask(num_accepted, params.row_to_req, params.local_step)
        for r in torch.nonzero(keep).flatten().tolist():
            emitted[row_to_req[r]].append(int(tokens[r]))
        accepted_total += int(num_accepted.sum())
        rejected_total += int((num_accepted < torch.from_numpy(ks)).sum())
    assert accepted_total > 300 and rejected_total > 300  # both branches exercised
    for i in range(num_seqs):
        assert emitted[i][:length] == reference[i, :length].tolist(), f"sequence {i}"


def test_strict_counts_leading_matches_per_request():
    # request 0: k=3, second draft wrong; request 1: k=0; request 2: k=2 all right.
    row_to_req = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])
    local_step = torch.tensor([0, 1, 2, 3, 0, 0, 1, 2])
    tokens = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3])
    drafts = torch.tensor([5, 0, 7, -1, -1, 1, 2, -1])
    out = torch.full((3,), -7, dtype=torch.int64)
    num_accepted = accept_strict(tokens, drafts, row_to_req, local_step, 3, out=out)
    assert num_accepted is out and out.tolist() == [1, 0, 2]
    assert emitted_mask(out, row_to_req, local_step).tolist() == [True, True, False, False, True, True, True, True]
    allowed = torch.tensor([True, True, True, False, False, True, False, False])
    assert accept_strict(tokens, drafts, row_to_req, local_step, 3, draft_allowed=allowed).tolist() == [1, 0, 1]


# --- rejection mode: the emitted distribution is the target's -------------------

def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # the pooled cell, when tiny, joins the smallest big cell
        obs, exp = obs[:-1].copy(), exp[:-1].copy()
        obs[np.argmin(exp)] += counts[~big].sum()
        exp[np.argmin(exp)] += expected[~big].sum()
    if len(obs) < 2:  # one cell (a one-hot target): the zero-probability check covers it
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _random_dist(gen: torch.Generator, vocab: int, zeros: float) -> torch.Tensor:
    """A distribution with random weights, some tokens at exactly 0."""
    w = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 2
    w = torch.where(torch.rand(vocab, generator=gen) < zeros, 0.0, w)
    w[torch.randint(vocab, (1,), generator=gen)] += 0.05  # never all zero
    return w / w.sum()


def _run_trials(p_rows, q_rows, one_hot, trials, seed_base, *, top_k_space=0, row_tokens_fn=None):
    """One verify step for `trials` independent requests sharing per-row
    target distributions p_rows [1+k, V] and draft distributions q_rows [k, V].
    Drafts are drawn from q_rows by torch's generator (independent of the
    verifier's hash streams). Returns tokens [trials, 1+k] (-1 = not emitted)."""
    k, vocab = q_rows.shape
    gen = torch.Generator().manual_seed(seed_base)
    drafts = torch.multinomial(q_rows, trials, replacement=True, generator=gen).T  # [trials, k]
    row_drafts = torch.cat([drafts, torch.full((trials, 1), -1)], 1).reshape(-1)
    rows = trials * (1 + k)
    row_to_req = torch.arange(trials).repeat_interleave(1 + k)
    local_step = torch.arange(1 + k).repeat(trials)
    seed = torch.arange(trials, dtype=torch.int64) + seed_base * 1_000_003
    position = 17 + local_step
    p = p_rows.repeat(trials, 1)
    q = None if one_hot else torch.cat([q_rows, torch.zeros(1, vocab, dtype=q_rows.dtype)]).repeat(trials, 1)
    out_tokens = torch.empty(rows, dtype=torch.int64)
    k_space = None if not top_k_space else torch.full((trials,), top_k_space, dtype=torch.int64)
    num_accepted = verify_rejection(
        p, row_drafts, q, seed, position, row_to_req, local_step, trials, out_tokens, top_k_space=k_space
    )
    tokens = out_tokens.view(trials, 1 + k)
    assert torch.equal((tokens >= 0).sum(1), num_accepted + 1)
    return tokens, drafts


def _assert_rows_follow(tokens: torch.Tensor, p_rows: torch.Tensor, label: str, alpha: float = 1e-6) -> None:
    """Every row's emitted tokens (over the trials that reach it) follow that row's p."""
    vocab = p_rows.shape[1]
    for j in range(tokens.shape[1]):
        emitted = tokens[:, j][tokens[:, j] >= 0]
        counts = np.bincount(emitted.numpy(), minlength=vocab)
        probs = p_rows[j].numpy()
        assert counts[probs == 0].sum() == 0, f"{label} row {j}: emitted a token of target probability 0"
        if len(emitted) >= 200:
            pvalue = _chi_square_pvalue(counts, probs)
            assert pvalue > alpha, f"{label} row {j}: chi-square p-value {pvalue:.3g} over {len(emitted)} tokens"


def test_rejection_emits_the_target_distribution():
    """Sample size and tolerance: 16 configurations (k = 1..3, vocab 8..16,
    drafts with probabilities and one-hot) x 8000 trials = 128k verify trials,
    ~300k emitted tokens. Each row's emitted tokens, over the trials that reach
    that row, must pass a chi-square test against the row's target at p-value
    > 1e-6 (about 50 tests: family-wise false alarm < 1e-4; seeds are fixed, so
    the test is deterministic), and never emit a token of target probability 0.
    Planted bugs caught: accepting with (p/q)^2, residual drawn from p."""
    gen = torch.Generator().manual_seed(11)
    total = 0
    for config in range(16):
        k, vocab = 1 + config % 3, (8, 12, 16)[config % 3]
        one_hot = config % 2 == 1
        p_rows = torch.stack([_random_dist(gen, vocab, 0.25) for _ in range(k + 1)])
        q_rows = torch.stack([_random_dist(gen, vocab, 0.25) for _ in range(k)])
        if config == 4:  # the draft equals the target: every draft accepted, no residual
            q_rows = p_rows[:k].clone()
        if config == 6:  # draft concentrated where the target is small
            q_rows = torch.stack([_random_dist(gen, vocab, 0.8) for _ in range(k)])
        tokens, _ = _run_trials(p_rows, q_rows, one_hot, 8000, config)
        _assert_rows_follow(tokens, p_rows, f"config {config} (k={k}, V={vocab}, one_hot={one_hot})")
        total += tokens.shape[0]
        if config == 4 and not one_hot:
            assert (tokens >= 0).all(), "p == q must accept every draft"
    assert total >= 100_000


def test_rejection_with_processed_targets_and_degenerate_drafts():
    """Targets from `target_probs` (filters leave exact zeros, greedy rows are
    one-hot) and drafts with no probability (q(d) = 0) or equal to the target."""
    gen = torch.Generator().manual_seed(3)
    vocab, k, trials = 12, 2, 6000
    logits = torch.randn(k + 1, vocab, generator=gen) * 2
    for temperature, top_k, top_p in ((1.0, 4, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.7)):
        params = RowParams.from_numpy(
            temperatures=np.full(1, temperature, np.float32),
            top_ks=np.full(1, top_k, np.int32),
            top_ps=np.full(1, top_p, np.float32),
            min_ps=np.zeros(1, np.float32),
            seeds=np.zeros(1, np.uint64),
            sample_positions=np.zeros(1, np.int64),
            row_to_req=np.zeros(k + 1, np.int64),
            local_step=np.arange(k + 1),
        )
        p_rows = target_probs(logits, params)
        # drafts from a uniform q: many drafts have p(d) = 0 and are always rejected
        q_rows = torch.full((k, vocab), 1 / vocab, dtype=torch.float64)
        for one_hot in (False, True):
            tokens, drafts = _run_trials(p_rows, q_rows, one_hot, trials, 100 + int(one_hot))
            _assert_rows_follow(tokens, p_rows, f"T={temperature} top_k={top_k} top_p={top_p} one_hot={one_hot}")
            impossible = p_rows[0][drafts[:, 0]] == 0
            assert (tokens[impossible, 0] != drafts[impossible, 0]).all()


def test_residual_falls_back_to_target_when_p_equals_q():
    # p == q but the draft has q(d) = p(d) = 0: rejected, residual empty -> draw from p.
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64).repeat(500, 1)
    row_drafts = torch.tensor([0, -1]).repeat(500)
    row_to_req = torch.arange(500).repeat_interleave(2)
    local_step = torch.tensor([0, 1]).repeat(500)
    out_tokens = torch.empty(1000, dtype=torch.int64)
    num_accepted = verify_rejection(
        p, row_drafts, p.clone(), torch.arange(500), local_step + 3, row_to_req, local_step, 500, out_tokens
    )
    assert (num_accepted == 0).all()
    first = out_tokens.view(500, 2)[:, 0]
    assert set(first.tolist()) == {1, 2} and (out_tokens.view(500, 2)[:, 1] == -1).all()


def test_bonus_is_the_samplers_token():
    """Requests without drafts, or whose drafts are all accepted, emit the
    sampler's own draw on their last row when `row_tokens` is given."""
    rng = np.random.default_rng(2)
    num_reqs, vocab = 40, 300
    req = _random_requests(rng, num_reqs)
    row_to_req = np.repeat(np.arange(num_reqs), 2)
    local_step = np.tile([0, 1], num_reqs)
    params = _row_params(req, row_to_req, local_step)
    logits = torch.randn(2 * num_reqs, vocab, generator=torch.Generator().manual_seed(1)) * 3
    tokens = _draw(logits, params)
    p = target_probs(logits, params)
    # Row 0's draft is its own draw with q = one-hot: p(d) > 0 and accepted w.p. p(d).
    row_drafts = torch.where(torch.from_numpy(local_step) == 0, tokens, -1)
    out_tokens = torch.empty_like(tokens)
    seed, position = params.seeds, params.sample_positions[params.row_to_req] + params.local_step
    num_accepted = verify_rejection(
        p, row_drafts, None, seed, position, params.row_to_req, params.local_step, num_reqs, out_tokens, row_tokens=tokens
    )
    all_accepted = num_accepted == 1
    assert all_accepted.any() and (~all_accepted).any()
    assert torch.equal(out_tokens.view(num_reqs, 2)[all_accepted], tokens.view(num_reqs, 2)[all_accepted])
    # Greedy rows: the race over a one-hot p is the greedy token too.
    verify_rejection(p, torch.full_like(tokens, -1), None, seed, position, params.row_to_req, params.local_step, num_reqs, out_tokens)
    greedy_rows = torch.from_numpy(req["temperature"][row_to_req] == 0) & (params.local_step == 0)
    assert greedy_rows.any() and torch.equal(out_tokens[greedy_rows], tokens[greedy_rows])


# --- top-k-space mode ---------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40))
def test_restrict_to_top_k_matches_sort_reference(seed, vocab):
    rng = np.random.default_rng(seed)
    rows = 5
    dist = torch.from_numpy(rng.integers(0, 5, (rows, vocab)).astype(np.float64))
    dist[:, 0] += 1  # never all zero
    dist /= dist.sum(-1, keepdim=True)
    k = torch.from_numpy(rng.integers(-1, vocab + 3, rows))
    got = restrict_to_top_k(dist, k)
    for i in range(rows):
        expect = dist[i].clone()
        if k[i] > 0:
            kth = torch.sort(dist[i], descending=True).values[min(int(k[i]), vocab) - 1]
            expect[dist[i] < kth] = 0  # ties at the cut stay
        torch.testing.assert_close(got[i], expect / expect.sum(), rtol=0, atol=1e-15)
    assert torch.equal(top_k_mask(dist, k), top_k_mask(dist, k, max_k=vocab + 3))


def test_top_k_space_rejection_follows_the_restricted_target():
    """8000 trials per configuration; chi-square as above against the target cut
    to its top-k. Drafts outside the target's top-k are never accepted."""
    gen = torch.Generator().manual_seed(8)
    for config, (k, vocab, k_space, one_hot) in enumerate(((2, 12, 3, False), (3, 16, 5, True), (1, 8, 1, False))):
        p_rows = torch.stack([_random_dist(gen, vocab, 0.1) for _ in range(k + 1)])
        # In this mode the draft head proposes from its own top-k; the verifier
        # restricting q again changes nothing.
        q_rows = restrict_to_top_k(torch.stack([_random_dist(gen, vocab, 0.1) for _ in range(k)]), torch.full((k,), k_space))
        tokens, drafts = _run_trials(p_rows, q_rows, one_hot, 8000, 200 + config, top_k_space=k_space)
        restricted = restrict_to_top_k(p_rows, torch.full((k + 1,), k_space))
        _assert_rows_follow(tokens, restricted, f"top-k space {k_space}, one_hot={one_hot}")
        outside = restricted[0][drafts[:, 0]] == 0
        assert outside.any() and (tokens[outside, 0] != drafts[outside, 0]).all()


def test_top_k_space_bonus_keeps_the_samplers_token_inside_the_support():
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2]], dtype=torch.float64).repeat(4, 1)
    row_tokens = torch.tensor([1, 2, 0, 3])  # top-2 = {1, 2}
    out_tokens = torch.empty(4, dtype=torch.int64)
    ar = torch.arange(4)
    verify_rejection(
        p, torch.full((4,), -1), None, ar, ar, ar, torch.zeros(4, dtype=torch.int64), 4, out_tokens,
        row_tokens=row_tokens, top_k_space=torch.full((4,), 2),
    )
    assert out_tokens[:2].tolist() == [1, 2] and set(out_tokens[2:].tolist()) <= {1, 2}


def test_draft_in_top_k():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    k = torch.tensor([2, 0])
    assert draft_in_top_k(scores, torch.tensor([3, 0]), k).tolist() == [True, True]  # tie at the cut kept; k=0 off
    assert draft_in_top_k(scores, torch.tensor([1, -1]), k).tolist() == [False, False]


# --- padding rows and capture safety ---------------------------------------------------

def _padded_batch():
    """3 real requests (k = 2, 0, 1) + padding: rows pointing at a padding
    request slot (zero logits, neutral parameters) and rows pointing at
    request 0 with an out-of-range local step."""
    gen = torch.Generator().manual_seed(4)
    vocab, real_rows = 20, 6
    row_to_req = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 0, 0])
    local_step = torch.tensor([0, 1, 2, 0, 0, 1, 0, 0, 3, 3])
    logits = torch.cat([torch.randn(real_rows, vocab, generator=gen) * 3, torch.zeros(4, vocab)])
    neutral = RowParams.neutral(4, 10)
    params = RowParams(
        **{**vars(neutral), "row_to_req": row_to_req, "local_step": local_step, "seeds": torch.tensor([5, 6, 7, 0]),
           "temperatures": torch.tensor([1.0, 0.0, 0.8, 1.0])}
    )
    drafts = torch.tensor([4, 9, -1, -1, 2, -1, -1, -1, -1, -1])
    return logits, params, drafts, real_rows


def test_padding_rows_are_inert_and_finite():
    logits, params, drafts, real_rows = _padded_batch()
    p = target_probs(logits, params)
    assert torch.isfinite(p).all()
    q = torch.softmax(torch.randn(p.shape, dtype=torch.float64), -1)
    q[real_rows:] = 0  # padding rows carry no draft distribution
    position = params.sample_positions[params.row_to_req] + params.local_step
    tokens = _draw(logits, params)
    results = []
    for rows in (slice(None), slice(0, real_rows)):
        out_tokens = torch.empty_like(drafts[rows])
        sub = (p[rows], drafts[rows], q[rows], params.seeds, position[rows], params.row_to_req[rows], params.local_step[rows])
        num_accepted = verify_rejection(*sub, 4, out_tokens, row_tokens=tokens[rows], top_k_space=torch.tensor([3, 0, 5, 2]))
        strict = accept_strict(tokens[rows], drafts[rows], params.row_to_req[rows], params.local_step[rows], 4)
        results.append((num_accepted[:3], out_tokens[:real_rows], strict[:3]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_everything_is_capture_safe():
    logits, params, drafts, _ = _padded_batch()
    rows, reqs = logits.shape[0], 4
    static = {
        "out_tokens": torch.empty(rows, dtype=torch.int64),
        "num_accepted": torch.empty(reqs, dtype=torch.int64),
        "num_accepted_strict": torch.empty(reqs, dtype=torch.int64),
    }
    tokens = _draw(logits, params)
    position = params.sample_positions[params.row_to_req] + params.local_step
    k_space = torch.tensor([3, 0, 5, 2])
    with capture_safety_check(static):
        p = target_probs(logits, params)
        accept_strict(
            tokens, drafts, params.row_to_req, params.local_step, reqs,
            draft_allowed=draft_in_top_k(logits, drafts, k_space[params.row_to_req], max_k=8),
            out=static["num_accepted_strict"],
        )
        emitted_mask(static["num_accepted_strict"], params.row_to_req, params.local_step)
        for q in (None, torch.softmax(logits.double(), -1)):
            verify_rejection(
                p, drafts, q, params.seeds, position, params.row_to_req, params.local_step, reqs, static["out_tokens"],
                row_tokens=tokens, top_k_space=k_space, max_top_k=8, out=static["num_accepted"],
            )
            verify_rejection(p, drafts, q, params.seeds, position, params.row_to_req, params.local_step, reqs, static["out_tokens"])
