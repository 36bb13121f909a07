"""Fused sampler against the sort-based reference, statistics, invariance, edge rows."""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.sampling import exact as exact_module
from engine.sampling import draw as rng
from engine.sampling import filters, thresholds
from engine.sampling import rows as suppression
from engine.sampling import sampler as sampler_module
from engine.sampling import verify as verify_module
from engine.sampling.exact import EXACT_CHUNK_ROWS, kept_sets, sample_exact, sample_reference
from engine.sampling.logprobs import token_logprobs
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError, SamplerConfig, TorchStages, sample
from engine.sampling.verify import target_probs
from graphs.capture_safety import capture_safety_check
from tests import numpy_sampler_reference as ref

FIELDS = ("tokens", "logprob", "rank", "top_ids", "top_logprobs")
LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"


def _params(num_rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, position=None, **kw) -> RowParams:
    """One request per row, parameters broadcast from scalars or arrays."""
    def arr(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype=dtype), (num_rows,)).copy()

    return RowParams.from_numpy(
        temperatures=arr(temperature, np.float32),
        top_ks=arr(top_k, np.int32),
        top_ps=arr(top_p, np.float32),
        min_ps=arr(min_p, np.float32),
        seeds=arr(np.arange(num_rows) if seed is None else seed, np.uint64),
        sample_positions=arr(np.arange(num_rows) * 3 + 11 if position is None else position, np.int64),
        row_to_req=np.arange(num_rows),
        local_step=np.zeros(num_rows, np.int64),
        **kw,
    )


def _fast_then_exact(logits, params, cfg, num_top=None) -> tuple[SampleOutput, torch.Tensor]:
    out = SampleOutput.allocate(logits.shape[0], cfg.max_logprobs if num_top is None else num_top)
    sample(logits, params, cfg, out)
    flagged = out.needs_exact.clone()
    sample_exact(logits, params, cfg, flagged, out)
    return out, flagged


def _assert_same(a: SampleOutput, b: SampleOutput, rows=slice(None)) -> None:
    for name in FIELDS:
        x, y = getattr(a, name)[rows], getattr(b, name)[rows]
        assert torch.equal(x, y), f"{name}: {x} != {y}"


# --- every filter against the independent numpy reference --------------------

def _assert_matches_numpy(out: SampleOutput, refs: list[ref.RowResult], rows=None) -> int:
    """Tokens, ranks and top-N ids exact, logprobs within ref.LOGPROB_ATOL, on the
    rows the reference decided (and, when given, only `rows`). Returns how many rows were compared."""
    compared = 0
    for i, r in enumerate(refs):
        if not r.decided or (rows is not None and not bool(rows[i])):
            continue
        compared += 1
        assert int(out.tokens[i]) == r.token, (i, int(out.tokens[i]), r.token)
        assert int(out.rank[i]) == r.rank, (i, int(out.rank[i]), r.rank)
        assert out.top_ids[i].tolist() == r.top_ids, (i, out.top_ids[i].tolist(), r.top_ids)
        np.testing.assert_allclose(float(out.logprob[i]), r.logprob, atol=ref.LOGPROB_ATOL, rtol=0, err_msg=f"row {i}")
        np.testing.assert_allclose(out.top_logprobs[i].double().numpy(), np.array(r.top_logprobs, dtype=np.float64),
                                   atol=ref.LOGPROB_ATOL, rtol=0, err_msg=f"row {i}")
    return compared


def _assert_kept_sets_match(logits: torch.Tensor, params: RowParams, refs: list[ref.RowResult]) -> None:
    kept = kept_sets(logits, params)
    for i, r in enumerate(refs):
        if r.decided:
            assert np.array_equal(kept[i].numpy(), r.kept), (i, np.flatnonzero(kept[i].numpy()), np.flatnonzero(r.kept))


# min_p = 1.0 keeps exactly the tokens tied at the maximum (p == min_p * max p
# on the boundary): a `>` for `>=` there keeps nothing.
MIN_PS = [0.0, 0.05, 0.5, 1.0]


@st.composite
def _batches(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(3, 300))  # two stop ids never cover the whole vocabulary
    # Logits from a small value set so ties are common, plus a random scale.
    levels = draw(st.integers(2, 12))
    values = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, levels, (rows, vocab))
    scale = draw(st.sampled_from([0.25, 1.0, 3.0]))
    logits = torch.from_numpy(values).to(torch.float32) * scale
    per_row = st.tuples(
        st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        st.sampled_from([0, 1, 2, 5, 17, 400]),
        st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.01]),
        st.sampled_from(MIN_PS),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**40),
        st.booleans(),
        st.sampled_from([-1, -1, -1, 0, vocab - 1]),
    )
    rp = draw(st.lists(per_row, min_size=rows, max_size=rows))
    cap = draw(st.sampled_from([1, 3, 8, 64, 1024]))
    mode = draw(st.sampled_from(["raw", "processed"]))
    num_top = draw(st.integers(0, min(cap, vocab, 4)))
    stop = draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=2))
    return logits, rp, cap, mode, num_top, stop


def _specs(rp, stop) -> list[ref.RowSpec]:
    return [
        ref.RowSpec(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, position=pos,
                    suppressed=tuple(stop) if suppress else (), forced=forced)
        for t, k, p, m, seed, pos, suppress, forced in rp
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
# Found by CI: the 3rd candidate (the boundary) is suppressed stop id 0; token 1, tied with it
# and outside the candidates, passes min-p, so the kept set reaches past the candidates.
@example((torch.tensor([[0.0, 0.0, 0.25, 0.25]]), [(0.5, 0, 1.0, 0.05, 0, 0, True, -1)], 3, "raw", 0, [0, 0]))
# min_p = 1.0 with three tokens tied at the maximum, on the fast path (cap 8 > V) and past it.
@example((torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, 2.0]] * 2), [(1.0, 0, 1.0, 1.0, 7, 3, False, -1),
                                                               (0.5, 0, 1.0, 1.0, 9, 4, False, -1)], 8, "processed", 2, [0, 0]))
@example((torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, 2.0]]), [(1.0, 0, 1.0, 1.0, 7, 3, False, -1)], 2, "raw", 1, [0, 0]))
# A forced token far below the rest in processed mode: its weight exp(-40) is a float32 but its
# mass floor(exp(-40) * 2**50) is 0, so its processed logprob is -inf (the contract's masses).
@example((torch.tensor([[0.0, -40.0, 0.0, -1.0]]), [(1.0, 0, 1.0, 0.0, 5, 3, False, 1)], 8, "processed", 4, [0, 0]))
def test_matches_numpy_reference(batch):
    logits, rp, cap, mode, num_top, stop = batch
    rows = logits.shape[0]
    t, k, p, m, _, pos, suppress, forced = (np.array(c) for c in zip(*rp))
    seed = np.array([r[4] for r in rp], dtype=np.uint64)  # exact: a mixed int list would become float64
    params = _params(
        rows, temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, position=pos,
        stop_ids=np.array([stop] * rows), eos_suppression_rows=suppress.astype(bool), forced_tokens=forced,
    )
    cfg = SamplerConfig(candidate_cap=cap, max_logprobs=num_top, logprobs_mode=mode)
    refs = ref.sample_rows(logits.numpy(), _specs(rp, stop), num_top=num_top, mode=mode)
    fast = sample(logits, params, cfg)
    # Rows the fast path did not flag are final and must already be right.
    _assert_matches_numpy(fast, refs, rows=~fast.needs_exact)
    combined, _ = _fast_then_exact(logits, params, cfg, num_top)
    _assert_matches_numpy(combined, refs)
    assert not bool(combined.needs_exact.any())
    _assert_kept_sets_match(logits, params, refs)


def test_min_p_one_keeps_exactly_the_tokens_tied_at_the_maximum():
    # p == min_p * max p for every tied maximum: the boundary is kept, so the
    # draw is always one of them and the kept set is exactly them.
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.9, 2.0, 0.0, 1.0]] * 64)
    tied = [1, 3, 5]
    for cap in (2, 4, 8):
        for temperature in (0.5, 1.0, 2.0):
            params = _params(64, temperature=temperature, min_p=1.0, seed=np.arange(64, dtype=np.uint64) * 977)
            out, _ = _fast_then_exact(logits, params, SamplerConfig(candidate_cap=cap, max_logprobs=1, logprobs_mode="processed"))
            assert set(out.tokens.tolist()) == set(tied), (cap, temperature, out.tokens.tolist())
            assert bool(torch.isfinite(out.logprob).all())  # each token is in the kept set
            expected = torch.zeros(64, 8, dtype=torch.bool)
            expected[:, tied] = True
            assert torch.equal(kept_sets(logits, params), expected)
    # A single maximum: min_p = 1.0 keeps only it.
    single = torch.tensor([[0.0, 1.0, 3.0, 2.9]])
    out, _ = _fast_then_exact(single, _params(1, min_p=1.0), SamplerConfig(candidate_cap=2, max_logprobs=0))
    assert out.tokens.tolist() == [2]


def test_numpy_reference_hash_is_the_engines():
    # The reference re-implements the counter-based hash from its definition;
    # both must give the same bits on any coordinates.
    gen = np.random.default_rng(5)
    for _ in range(20):
        seed, position, stream = int(gen.integers(0, 2**64, dtype=np.uint64)), int(gen.integers(0, 2**62)), int(gen.integers(0, 4))
        counters = gen.integers(0, 2**32, 50)
        engine_u = rng.uniform(torch.tensor(np.uint64(seed).view(np.int64)), torch.tensor(position), stream, torch.from_numpy(counters))
        assert np.array_equal(engine_u.numpy(), ref.uniform(seed, position, stream, counters))


def test_multi_block_rows_match_numpy_reference():
    # V = 2500 spans three normaliser blocks: plain rows draw by inverse CDF
    # across blocks, filtered rows race over kept sets of hundreds of tokens.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(24, 2500, generator=gen) * torch.tensor([0.3, 1.0, 3.0]).repeat(8)[:, None]
    combos = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, min_p=0.02),
              dict(temperature=0.0, top_k=40), dict(temperature=0.6, top_k=700, top_p=0.95, min_p=0.001),
              dict(temperature=1.5, stop=(0, 1999))]
    specs = []
    for i in range(24):
        c = dict(combos[i % len(combos)])
        stop = c.pop("stop", ())
        specs.append(ref.RowSpec(seed=1000 + i, position=5 * i, suppressed=stop, **c))
    params = _params(
        24, temperature=[s.temperature for s in specs], top_k=[s.top_k for s in specs], top_p=[s.top_p for s in specs],
        min_p=[s.min_p for s in specs], seed=np.array([s.seed for s in specs], np.uint64), position=[s.position for s in specs],
        stop_ids=np.array([(0, 1999)] * 24), eos_suppression_rows=np.array([bool(s.suppressed) for s in specs]),
    )
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=64, max_logprobs=3, logprobs_mode=mode)
        refs = ref.sample_rows(logits.numpy(), specs, num_top=3, mode=mode)
        combined, _ = _fast_then_exact(logits, params, cfg)
        assert _assert_matches_numpy(combined, refs) >= 22
    _assert_kept_sets_match(logits, params, refs)


def test_flat_rows_are_decided_in_the_call():
    """Flat logits: top-p 0.9 keeps about 90% of 500 tokens. Every row is
    decided by `sample` itself (nothing flagged for a later pass) and equals
    the numpy reference and the sorting reference path."""
    torch.manual_seed(1)
    logits = torch.randn(32, 500) * 0.1
    top_k = np.where(np.arange(32) % 2, 0, 300)
    min_p = np.where(np.arange(32) % 3, 0.0, 0.5)
    params = _params(32, top_p=0.9, top_k=top_k, min_p=min_p)
    cfg = SamplerConfig(candidate_cap=16, max_logprobs=3)
    fast = sample(logits, params, cfg)
    assert not bool(fast.needs_exact.any())
    assert int(kept_sets(logits, params).sum(-1).min()) > 250
    specs = [ref.RowSpec(temperature=1.0, top_k=int(top_k[i]), top_p=0.9, min_p=float(min_p[i]), seed=i, position=i * 3 + 11)
             for i in range(32)]
    refs = ref.sample_rows(logits.numpy(), specs, num_top=3)
    assert _assert_matches_numpy(fast, refs) >= 28  # rows within rounding of a threshold are skipped
    _assert_kept_sets_match(logits, params, refs)
    _assert_same(fast, sample_reference(logits, params, cfg))


# --- statistics ------------------------------------------------------------

def _expected_distribution(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Filtered, renormalised distribution from the definitions, in float64 numpy."""
    z = (x - x.max()) / temperature
    p = np.exp(z) / np.exp(z).sum()
    keep = np.ones_like(p, dtype=bool)
    if min_p > 0:  # min-p first, as vLLM
        keep &= p >= min_p * p.max()
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        order = np.argsort(-q, kind="stable")
        reach = np.flatnonzero(np.cumsum(q[order]) >= top_p)
        keep &= q >= q[order[reach[0]]]
    return np.where(keep, p, 0) / np.where(keep, p, 0).sum()


STAT_CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),  # plain: inverse-CDF draw
    dict(temperature=1.0, top_k=10, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
    dict(temperature=1.5, top_k=40, top_p=0.7, min_p=0.0),
]


@pytest.mark.parametrize("case", STAT_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_draws_follow_filtered_distribution(case):
    # 200_000 rows of the same vocab-64 logits (with tied values), one seed per
    # row. Chi-square over kept tokens with expected count >= 5 (rarer ones
    # pooled): the statistic must stay below df + 6 * sqrt(2 df), a
    # tail probability under ~1e-5 for these df. No draw outside the kept set.
    n, vocab = 200_000, 64
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1.5, vocab).astype(np.float32)
    x[[3, 9, 30]] = x[5]  # deliberate ties
    expected = _expected_distribution(x.astype(np.float64), **case)
    logits = torch.from_numpy(x).expand(n, vocab)
    params = _params(n, seed=np.arange(n, dtype=np.uint64) * np.uint64(2654435761), position=np.arange(n) % 977, **case)
    # Plain rows ignore the candidates; filtered rows need more than their kept set.
    plain = case["top_k"] == 0 and case["top_p"] == 1 and case["min_p"] == 0
    needed = max(int((expected > 0).sum()) + 2, case["top_k"] + 1)
    cap = 8 if plain else min(vocab, 2 ** math.ceil(math.log2(needed)))
    out = sample(logits, params, SamplerConfig(candidate_cap=cap, max_logprobs=0), compute_logprobs=False)
    assert not bool(out.needs_exact.any())
    counts = np.bincount(out.tokens.numpy(), minlength=vocab)
    assert counts[expected == 0].sum() == 0, "draw outside the kept set"
    exp_counts = expected * n
    big = exp_counts >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(exp_counts[big], exp_counts[~big].sum())
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(wanted) - 1
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1)), (chi2, df)


# --- invariance ----------------------------------------------------------------

def test_token_independent_of_batch_layout():
    # 256 seeds (1000 with ENGINE_LONG_TESTS=1). For each: the row alone, then inside a
    # batch of 64 at index seed % 64 among random rows with other parameters. The token
    # must match. 256 seeds already put each combo at each of its 16 indices 4 times.
    torch.manual_seed(3)
    vocab = 700
    cfg = SamplerConfig(candidate_cap=64, max_logprobs=2)
    target = torch.randn(vocab) * 2
    combos = [
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.0),
        dict(temperature=1.0, top_k=0, top_p=0.5, min_p=0.1),
        dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    ]
    gen = np.random.default_rng(0)
    for seed in range(1000 if LONG else 256):
        combo = combos[seed % len(combos)]
        position = 1000 + seed * 13
        alone_params = _params(1, seed=np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64), position=position, **combo)
        alone, _ = _fast_then_exact(target[None], alone_params, cfg)
        index = seed % 64
        logits = torch.randn(64, vocab) * 3
        logits[index] = target
        batch_kw = {name: gen.choice([c[name] for c in combos], 64) for name in combos[0]}
        seeds = gen.integers(0, 2**63, 64).astype(np.uint64)
        positions = gen.integers(0, 10**6, 64)
        for name, value in combo.items():
            batch_kw[name][index] = value
        seeds[index] = np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
        positions[index] = position
        batch, _ = _fast_then_exact(logits, _params(64, seed=seeds, position=positions, **batch_kw), cfg)
        assert int(batch.tokens[index]) == int(alone.tokens[0]), seed
        assert torch.equal(batch.top_ids[index], alone.top_ids[0])


# --- edge rows -----------------------------------------------------------------

def test_greedy_ties_go_to_smallest_id():
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 2.0
    logits[1, [49, 12]] = 1.0
    logits[2, :] = -1.0
    for cap in (2, 8, 1024):
        out, _ = _fast_then_exact(logits, _params(3, temperature=0.0), SamplerConfig(candidate_cap=cap, max_logprobs=2))
        assert out.tokens.tolist() == [3, 12, 0]
        assert out.rank.tolist() == [1, 1, 1]
        assert out.top_ids.tolist() == [[3, 7], [12, 49], [0, 1]]


def test_forced_tokens_override_the_draw():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    forced = np.array([5, -1, 99, 0])
    params = _params(4, temperature=[0.0, 1.0, 0.5, 1.0], top_k=[0, 0, 3, 0], forced_tokens=forced)
    out, _ = _fast_then_exact(logits, params, SamplerConfig(candidate_cap=16, max_logprobs=1))
    assert out.tokens[[0, 2, 3]].tolist() == [5, 99, 0]
    lsm = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(out.logprob.double(), lsm.gather(1, out.tokens[:, None]).squeeze(1), atol=1e-5)


def test_eos_suppression():
    # Stop ids 0 and 1 dominate; suppressed rows never produce them, others do.
    logits = torch.zeros(6, 40)
    logits[:, 0] = 30.0
    logits[:, 1] = 29.0
    logits[:, 2] = 1.0
    suppress = np.array([True, False, True, False, True, True])
    params = _params(
        6, temperature=[0.0, 0.0, 1.0, 1.0, 0.7, 1.0], top_k=[0, 0, 0, 0, 1, 0],
        stop_ids=np.array([[0, 1]] * 6), eos_suppression_rows=suppress,
    )
    out, _ = _fast_then_exact(logits, params, SamplerConfig(candidate_cap=8, max_logprobs=0))
    tokens = out.tokens.tolist()
    assert tokens[0] == 2 and tokens[1] == 0 and tokens[4] == 2
    assert tokens[2] not in (0, 1) and tokens[5] not in (0, 1) and tokens[3] in (0, 1)
    # Many seeds: a suppressed plain row never emits a stop id, even when they
    # hold all but e^-28 of the mass.
    n = 5000
    many = _params(n, stop_ids=np.array([[0, 1]] * n), eos_suppression_rows=np.ones(n, bool))
    drawn = sample(logits[:1].expand(n, 40), many, SamplerConfig(candidate_cap=8, max_logprobs=0)).tokens
    assert not bool(((drawn == 0) | (drawn == 1)).any())


def test_padding_rows_are_finite():
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=16, max_logprobs=4, logprobs_mode=mode)
        out, _ = _fast_then_exact(torch.zeros(5, 100), RowParams.neutral(5, 5), cfg)
        assert bool(((out.tokens >= 0) & (out.tokens < 100)).all())
        assert bool(torch.isfinite(out.logprob).all()) and bool(torch.isfinite(out.top_logprobs).all())


def test_sample_is_capture_safe():
    torch.manual_seed(0)
    logits = torch.randn(8, 3000)
    params = _params(8, temperature=[0, 1, 0.5, 1, 1, 0.9, 1, 2], top_k=[0, 0, 40, 0, 5, 0, 0, 0], top_p=[1, 1, 0.9, 0.8, 1, 1, 1, 1])
    for mode in ("raw", "processed"):
        out = SampleOutput.allocate(8, 5)
        with capture_safety_check({name: getattr(out, name) for name in (*FIELDS, "needs_exact")}):
            sample(logits, params, SamplerConfig(candidate_cap=256, max_logprobs=5, logprobs_mode=mode), out)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(candidate_cap=0), "candidate_cap"),
        (dict(max_logprobs=-1), "max_logprobs"),
        (dict(candidate_cap=8, max_logprobs=9), "max_logprobs"),
        (dict(logprobs_mode="logits"), "logprobs_mode"),
    ],
)
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_results_on_cuda():
    torch.manual_seed(0)
    logits = torch.randn(64, 5000) * 2
    params = _params(64, temperature=np.tile([0, 1, 0.7, 1.2], 16), top_k=np.tile([0, 0, 50, 0], 16), top_p=np.tile([1, 1, 0.9, 0.6], 16))
    cfg = SamplerConfig(candidate_cap=256, max_logprobs=5)
    cpu = sample(logits, params, cfg)
    cuda_params = RowParams(**{name: None if value is None else value.cuda() for name, value in vars(params).items()})
    gpu = sample(logits.cuda(), cuda_params, cfg)
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())
    assert torch.equal(cpu.needs_exact, gpu.needs_exact.cpu())


def test_padding_stop_slot_never_unsuppresses_stop_id_zero():
    """Stop id 0 next to a padding slot (-1, clamped to 0 for the scatter):
    both slots land on token 0, and token 0 must stay suppressed."""
    logits = torch.zeros(2, 16)
    logits[:, 0] = 10.0  # token 0 would win by far
    params = RowParams.from_numpy(
        temperatures=np.array([0.0, 1.0], np.float32), top_ks=np.zeros(2, np.int32), top_ps=np.ones(2, np.float32),
        min_ps=np.zeros(2, np.float32), seeds=np.array([1, 2], np.uint64), sample_positions=np.zeros(2, np.int64),
        row_to_req=np.arange(2), local_step=np.zeros(2, np.int64),
        stop_ids=np.array([[0, -1], [0, -1]]), eos_suppression_rows=np.array([True, True]),
    )
    out = sample(logits, params, SamplerConfig(candidate_cap=4, max_logprobs=2))
    assert (out.tokens != 0).all()


# --- one implementation per stage, shared by every path ---------------------------

def _min_p_ignored(module):
    """A planted bug: the kept set of `module` (filters or thresholds) ignores min-p."""
    name = "kept_set" if module is filters else "row_distribution"
    real = getattr(module, name)

    def planted(*args, **kw):
        args = list(args)
        rows = args[-1] if module is filters else args[2]
        rows = rows.replace(m_on=torch.zeros_like(rows.m_on))
        args[-1 if module is filters else 2] = rows
        return real(*args, **kw)
    return name, planted


def _top_k_one_more(module):
    """A planted bug: top-k keeps the (k+1)-th token too."""
    name = "kept_set" if module is filters else "row_distribution"
    real = getattr(module, name)

    def planted(*args, **kw):
        args = list(args)
        at = -1 if module is filters else 2
        args[at] = args[at].replace(top_k=args[at].top_k + 1)
        return real(*args, **kw)
    return name, planted


PATHS_OF = {"filters": ("exact", "kept_sets"), "thresholds": ("sample", "target_probs")}


@pytest.mark.parametrize("plant", [None, _min_p_ignored, _top_k_one_more], ids=["intact", "min-p ignored", "top-k one more"])
@pytest.mark.parametrize("where", ["filters", "thresholds"])
def test_sampler_reference_and_verify_paths_agree_on_the_kept_set(monkeypatch, plant, where):
    """The sampler (radix thresholds), the reference path (sorting walk),
    `kept_sets` and verification's `target_probs` all agree with the numpy
    reference. A bug planted in one definition shows in exactly the paths
    built on it: `filters.kept_set` under the reference path and `kept_sets`,
    `thresholds.row_distribution` under the sampler and `target_probs`; none
    keeps a kept-set definition of its own."""
    rows_n, vocab = 48, 60
    logits = torch.randn(rows_n, vocab, generator=torch.Generator().manual_seed(11)) * 1.5
    top_k = np.where(np.arange(rows_n) % 2, 0, 4)
    min_p = np.where(np.arange(rows_n) % 2, 0.3, 0.0)
    params = _params(rows_n, top_k=top_k, min_p=min_p)
    specs = [ref.RowSpec(temperature=1.0, top_k=int(top_k[i]), min_p=float(min_p[i]), seed=i, position=i * 3 + 11)
             for i in range(rows_n)]
    refs = ref.sample_rows(logits.numpy(), specs)
    decided = [i for i, r in enumerate(refs) if r.decided]
    assert len(decided) >= 40
    module = filters if where == "filters" else thresholds
    if plant is not None:
        name, planted = plant(module)
        monkeypatch.setattr(module, name, planted)
        for user in (sampler_module, verify_module, exact_module):  # the names the paths imported
            if hasattr(user, name):
                monkeypatch.setattr(user, name, planted)
    cfg = SamplerConfig(max_logprobs=0)
    fast = sample(logits, params, cfg)
    exact = sample_reference(logits, params, cfg)
    kept, support = kept_sets(logits, params), target_probs(logits, params) > 0
    agrees = {
        "sample": all(int(fast.tokens[i]) == refs[i].token for i in decided),
        "exact": all(int(exact.tokens[i]) == refs[i].token for i in decided),
        "kept_sets": all(np.array_equal(kept[i].numpy(), refs[i].kept) for i in decided),
        "target_probs": all(np.array_equal(support[i].numpy(), refs[i].kept) for i in decided),
    }
    broken = set() if plant is None else set(PATHS_OF[where])
    assert {k for k, v in agrees.items() if not v} == broken, agrees


def test_token_logprobs_is_the_samplers_raw_logprob():
    """`token_logprobs` (what the step engine rescoring a residual draw calls)
    gives the sampler's own raw logprob and rank bit for bit, and any token's
    log-softmax value and rank by the definition."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 3000, generator=gen) * 2
    logits[:, 9] = logits[:, 5]  # a tie: both share a rank
    params = _params(40, temperature=np.tile([0.0, 1.0, 0.7, 1.3], 10), top_k=np.tile([0, 0, 50, 0], 10),
                     top_p=np.tile([1.0, 1.0, 0.9, 0.8], 10))
    cfg = SamplerConfig(candidate_cap=64, max_logprobs=0)
    out, _ = _fast_then_exact(logits, params, cfg)
    logprob, rank = token_logprobs(logits, out.tokens)
    assert logprob.dtype == torch.float64 and rank.dtype == torch.int64
    assert torch.equal(logprob.to(torch.float32), out.logprob) and torch.equal(rank, out.rank)
    tokens = torch.cat([torch.full((20,), 5), torch.randint(0, 3000, (20,), generator=gen)])
    logprob, rank = token_logprobs(logits, tokens)
    value = logits.gather(1, tokens[:, None])
    assert torch.equal(rank, (logits > value).sum(-1) + 1)
    assert torch.equal(rank[:20], token_logprobs(logits[:20], torch.full((20,), 9))[1])
    torch.testing.assert_close(logprob, torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1),
                               rtol=0, atol=1e-6)


def test_suppression_gives_one_verdict_per_token():
    """`suppressed_scores`: duplicate slots, a padding slot landing on
    suppressed id 0 after it, and a suppressed id holding +inf all read -inf,
    and every other score is untouched."""
    vocab = 40
    stop_ids = np.array([[0, 12, -1], [5, 5, -1], [39, 7, 16], [3, -1, -1]])
    suppress = np.array([True, True, True, False])
    rows = expand_rows(_params(4, stop_ids=stop_ids, eos_suppression_rows=suppress), vocab)
    expected = torch.zeros(4, vocab, dtype=torch.bool)
    for r in range(4):
        expected[r, [t for t in stop_ids[r] if t >= 0 and suppress[r]]] = True
    scores = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    scores[expected] = math.inf
    masked = suppression.suppressed_scores(scores, rows)
    assert torch.equal(masked, torch.where(expected, -math.inf, scores))
    scores[3, 3] = math.nan  # an unsuppressed NaN stays, and every value comes back
    before = scores.clone()
    stops = suppression.suppress_stop_ids_(scores, rows)
    assert stops.scores.data_ptr() == scores.data_ptr()
    slots = rows.stop_ids.clamp(max=vocab - 1)
    assert torch.equal(stops.before.nan_to_num(nan=7.0), before.gather(1, slots).nan_to_num(nan=7.0))
    assert torch.equal(stops.scores.nan_to_num(nan=7.0), torch.where(expected, -math.inf, before).nan_to_num(nan=7.0))
    stops.restore()
    assert torch.equal(scores.view(torch.int32), before.view(torch.int32))


def test_sample_hands_back_its_logits_unchanged_even_when_it_raises():
    """The sampler suppresses stop ids in its f32 logits in place: afterwards every bit
    is back, suppressed rows, duplicate slots and a NaN row included, and also when the
    kept-set stage raises half way. A NaN or +inf at a suppressed stop id still fails its
    row (the finite check takes the masked maximum and the stop slots' values)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=gen) * 3
    logits[2, 17] = math.nan
    logits[0, 5] = math.nan  # at suppressed stop ids: still the model's logits, still not finite
    logits[4, 299] = math.inf
    stop_ids = np.array([[1, 5], [5, 5], [1, 7], [-1, -1], [1, 299], [0, -1]])
    params = _params(6, temperature=np.array([0.0, 1.0, 0.7, 1.0, 1.3, 0.0]), top_k=np.array([0, 20, 0, 0, 5, 0]),
                     top_p=np.array([1.0, 0.9, 1.0, 1.0, 0.8, 1.0]), stop_ids=stop_ids,
                     eos_suppression_rows=np.array([True, True, True, False, True, True]))
    before = logits.clone()
    out = sample(logits, params, SamplerConfig(candidate_cap=64, max_logprobs=2))
    assert out.error.tolist() == [RowError.LOGITS_NOT_FINITE, 0, RowError.LOGITS_NOT_FINITE, 0,
                                  RowError.LOGITS_NOT_FINITE, 0]
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))

    class Broken(TorchStages):
        def kept_set(self, *args, **kwargs):
            raise RuntimeError("planted")
    with pytest.raises(RuntimeError, match="planted"):
        sample(logits, params, SamplerConfig(candidate_cap=64, max_logprobs=2), stages=Broken())
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))


def test_results_do_not_depend_on_the_logits_memory_layout():
    """A column-major logits tensor gives the bits of a row-major one on every
    path: the normaliser's float32 block sums walk each row's tokens in order."""
    logits = torch.randn(16, 2500, generator=torch.Generator().manual_seed(8)) * 2
    column_major = logits.t().contiguous().t()
    params = _params(16, temperature=np.tile([0.0, 1.0, 0.6, 1.2], 4), top_k=np.tile([0, 0, 30, 0], 4),
                     top_p=np.tile([1.0, 1.0, 0.9, 0.7], 4), min_p=np.tile([0.0, 0.0, 0.0, 0.01], 4))
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=64, max_logprobs=3, logprobs_mode=mode)
        rows_major, flagged = _fast_then_exact(logits, params, cfg)
        cols_major, flagged_too = _fast_then_exact(column_major, params, cfg)
        _assert_same(rows_major, cols_major)
        assert torch.equal(flagged, flagged_too)
    assert torch.equal(target_probs(logits, params), target_probs(column_major, params))


def test_exact_path_slices_give_the_bits_of_each_row_alone():
    """The exact path decides rows in slices of EXACT_CHUNK_ROWS: rows on
    either side of a slice edge equal the same rows run alone."""
    rows_n = 2 * EXACT_CHUNK_ROWS + 22
    logits = torch.randn(rows_n, 200, generator=torch.Generator().manual_seed(4)) * 2
    params = _params(rows_n, temperature=np.tile([0.0, 1.0, 0.8], rows_n)[:rows_n],
                     top_p=np.tile([1.0, 1.0, 0.9], rows_n)[:rows_n])
    cfg = SamplerConfig(candidate_cap=16, max_logprobs=3)
    whole = sample_reference(logits, params, cfg)
    for i in (0, EXACT_CHUNK_ROWS - 1, EXACT_CHUNK_ROWS, 2 * EXACT_CHUNK_ROWS, rows_n - 1):
        alone = sample_reference(logits[i : i + 1], params.rows([i]), cfg)
        for name in FIELDS:
            assert torch.equal(getattr(whole, name)[i], getattr(alone, name)[0]), (i, name)


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_every_variant_that_can_serve_a_batch_gives_the_full_samplers_bits(batch):
    """The lighter variants (graph sets) skip passes, never change a definition:
    top-k by a topk of candidate_cap scores instead of the counting radix,
    top-p or the filters skipped where no row has them, the greedy fast path."""
    logits, rp, cap, mode, num_top, stop = batch
    params = _params(len(rp), temperature=[r[0] for r in rp], top_k=[r[1] for r in rp], top_p=[r[2] for r in rp],
                     min_p=[r[3] for r in rp], seed=[r[4] for r in rp], position=[r[5] for r in rp])
    rows = expand_rows(params, logits.shape[1])
    full = SamplerConfig(max_logprobs=0)
    want = sample(logits, params, full, compute_logprobs=False).tokens
    sampled = ~rows.greedy
    k_on, p_on = bool((rows.k_on & sampled).any()), bool((rows.p_on & sampled).any())
    variants = [dataclasses.replace(full, top_k="topk", candidate_cap=max(1, int(rows.top_k.max())))]
    if not k_on:
        variants.append(dataclasses.replace(full, top_k="none", top_p=p_on))
    if not (k_on or p_on or bool((rows.m_on & sampled).any())):
        variants.append(dataclasses.replace(full, stages="plain"))
    if not bool(sampled.any()):
        variants.append(dataclasses.replace(full, stages="greedy"))
    for cfg in variants:
        got = sample(logits, params, cfg, compute_logprobs=False).tokens
        assert torch.equal(got, want), cfg
    chunked = sample(logits, params, dataclasses.replace(full, chunk_rows=2), compute_logprobs=False).tokens
    assert torch.equal(chunked, want)
    # The kept sets themselves, every row (greedy ones too): a cut one token off shows here.
    masked = suppression.suppressed_scores(logits, rows)
    best = masked.amax(-1)
    d = thresholds.row_distribution(masked, best, rows)
    kept = d.kept
    width = max(1, int(rows.top_k.max()))
    assert torch.equal(thresholds.row_distribution(masked, best, rows, top_k="topk", top_k_width=width).kept, kept)
    # Without the kept mask (no processed logprobs): the same weights, bit for bit.
    for variant in (dict(), dict(top_k="topk", top_k_width=width)):
        lean = thresholds.row_distribution(masked, best, rows, kept_set=False, **variant)
        assert lean.kept is None and torch.equal(lean.weights, d.weights) and torch.equal(lean.block_mass, d.block_mass)
    if not bool(rows.k_on.any()):
        assert torch.equal(thresholds.row_distribution(masked, best, rows, top_k="none").kept, kept)
    if not bool(rows.p_on.any()):
        assert torch.equal(thresholds.row_distribution(masked, best, rows, top_p=False).kept, kept)


@pytest.mark.parametrize("vocab", [50, 1024])  # 50: one torch.max pass; 1024: the blocked search
def test_greedy_stage_fails_non_finite_rows_like_the_full_sampler(vocab):
    """The greedy fast path's finite check: NaN, +inf and -inf rows fail with
    LOGITS_NOT_FINITE and the placeholder; bystanders get the full sampler's
    tokens, forced tokens included."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[1, 7], logits[3, 0], logits[4, vocab - 1] = math.nan, math.inf, -math.inf
    params = _params(6, temperature=0.0, forced_tokens=np.array([-1, -1, 9, -1, -1, -1]))
    greedy = sample(logits, params, SamplerConfig(max_logprobs=0, stages="greedy"), compute_logprobs=False)
    full = sample(logits, params, SamplerConfig(max_logprobs=0), compute_logprobs=False)
    assert greedy.error.tolist() == full.error.tolist() == [0, 1, 0, 1, 1, 0]
    assert torch.equal(greedy.tokens, full.tokens) and int(greedy.tokens[2]) == 9
    assert greedy.tokens[[1, 3, 4]].tolist() == [PLACEHOLDER_TOKEN] * 3


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_a_greedy_variant_asked_for_logprobs_computes_them(mode):
    """The greedy fast path computes no logprobs: a call that wants them takes the
    general path, whose tokens and logprobs are the full sampler's. A greedy row's
    filters are off (as vLLM): its processed logprobs are the whole row's softmax."""
    logits = torch.randn(4, 1024, generator=torch.Generator().manual_seed(4))
    params = _params(4, temperature=0.0, top_k=np.array([0, 3, 0, 2]), top_p=np.array([1.0, 1.0, 0.5, 0.9]),
                     min_p=np.array([0.0, 0.0, 0.0, 0.3]))
    for stages in ("greedy", "plain"):
        lean = sample(logits, params, SamplerConfig(max_logprobs=3, stages=stages, logprobs_mode=mode))
        full = sample(logits, params, SamplerConfig(max_logprobs=3, logprobs_mode=mode))
        for name in ("tokens", "logprob", "rank", "top_ids", "top_logprobs", "error"):
            assert torch.equal(getattr(lean, name), getattr(full, name)), (stages, name)
    softmax = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(full.top_logprobs.double(), softmax.topk(3).values, rtol=0, atol=1e-5)


def test_expanded_rows_follow_their_requests_and_replace_only_known_controls():
    """Each control of row r is its request's (a Python loop over rows), whichever
    control is read first; `replace` swaps in a control and refuses unknown names."""
    params = _params(3)
    params.row_to_req = torch.tensor([2, 0, 0, 1])
    params.local_step = torch.tensor([0, 0, 1, 0])
    params.eos_suppression_rows = torch.tensor([False, True, False, False])  # per row, as the others
    params.temperatures = torch.tensor([0.0, 0.7, 1.5])
    params.top_ks = torch.tensor([0, 5, 100], dtype=torch.int32)
    vocab = 100
    for first in ("top_k", "temperature", "position"):
        rows = expand_rows(params, vocab)
        getattr(rows, first)
        for r, req in enumerate(params.row_to_req.tolist()):
            t, k = float(params.temperatures[req]), int(params.top_ks[req])
            assert bool(rows.greedy[r]) == (t == 0) and float(rows.temperature[r]) == (1.0 if t == 0 else t)
            assert bool(rows.k_on[r]) == (0 < k < vocab) and int(rows.top_k[r]) == (k if 0 < k < vocab else vocab)
            assert int(rows.position[r]) == int(params.sample_positions[req]) + int(params.local_step[r])
    swapped = rows.replace(top_k=torch.ones(4, dtype=torch.int64))
    assert swapped.top_k.tolist() == [1, 1, 1, 1] and torch.equal(swapped.temperature, rows.temperature)
    with pytest.raises(ValueError, match="controls \\['topk'\\]"):
        rows.replace(topk=torch.ones(4))


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_without_compute_logprobs_the_logprob_fields_stay_untouched(mode):
    """`compute_logprobs=False` (`sample`'s docstring): the same tokens as with logprobs, and
    the logprob, rank and top-N of rows that did not fail left as they were, in every
    variant that computes logprobs otherwise."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(21)) * 3
    temperature = np.array([0.0, 1.0, 0.7, 1.0, 1.3, 0.0])
    rows_of = {  # each variant gets rows it serves
        "filters": _params(6, temperature=temperature, top_k=np.array([0, 20, 0, 0, 5, 0]),
                           top_p=np.array([1.0, 0.9, 1.0, 0.8, 1.0, 1.0]), min_p=np.array([0, 0, 0.1, 0, 0, 0])),
        "plain": _params(6, temperature=temperature),
        "greedy": _params(6, temperature=0.0),
    }
    for stages, params in rows_of.items():
        cfg = SamplerConfig(candidate_cap=64, max_logprobs=3, logprobs_mode=mode, stages=stages)
        out = SampleOutput.allocate(6, 3)
        for field, value in (("logprob", 7.0), ("rank", -7), ("top_ids", -7), ("top_logprobs", 7.0)):
            getattr(out, field).fill_(value)
        sample(logits, params, cfg, out, compute_logprobs=False)
        assert (out.error == RowError.OK).all()
        assert torch.equal(out.tokens, sample(logits, params, cfg).tokens)
        assert (out.logprob == 7.0).all() and (out.rank == -7).all()
        assert (out.top_ids == -7).all() and (out.top_logprobs == 7.0).all()
