"""Fused sampler against the sort-based reference, statistics, invariance, edge rows.
The stages every path shares are checked in tests/test_sampler_stages.py."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.sampling import draw as rng
from engine.sampling.exact import kept_sets, sample_reference
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from graphs.capture_safety import capture_safety_check
from tests import numpy_sampler_reference as ref

FIELDS = ("tokens", "logprob", "rank", "top_ids", "top_logprobs")
LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"


def row_params(num_rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, position=None, **kw) -> RowParams:
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


def sampled(logits, params, cfg, num_top=None) -> SampleOutput:
    out = SampleOutput.allocate(logits.shape[0], cfg.max_logprobs if num_top is None else num_top)
    return sample(logits, params, cfg, out)


def assert_same(a: SampleOutput, b: SampleOutput, rows=slice(None)) -> None:
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
def sampler_batches(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(3, 300))  # two stop ids never cover the whole vocabulary
    # Logits from a small value set so ties are common, plus a random scale.
    levels = draw(st.integers(2, 12))
    values = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, levels, (rows, vocab))
    scale = draw(st.sampled_from([0.25, 1.0, 3.0, 12.0]))  # 12: weights below the least normal float32
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
@given(sampler_batches())
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
    params = row_params(
        rows, temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, position=pos,
        stop_ids=np.array([stop] * rows), eos_suppression_rows=suppress.astype(bool), forced_tokens=forced,
    )
    cfg = SamplerConfig(candidate_cap=cap, max_logprobs=num_top, logprobs_mode=mode)
    refs = ref.sample_rows(logits.numpy(), _specs(rp, stop), num_top=num_top, mode=mode)
    _assert_matches_numpy(sampled(logits, params, cfg, num_top), refs)
    _assert_kept_sets_match(logits, params, refs)


def test_min_p_one_keeps_exactly_the_tokens_tied_at_the_maximum():
    # p == min_p * max p for every tied maximum: the boundary is kept, so the
    # draw is always one of them and the kept set is exactly them.
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.9, 2.0, 0.0, 1.0]] * 64)
    tied = [1, 3, 5]
    for cap in (2, 4, 8):
        for temperature in (0.5, 1.0, 2.0):
            params = row_params(64, temperature=temperature, min_p=1.0, seed=np.arange(64, dtype=np.uint64) * 977)
            out = sampled(logits, params, SamplerConfig(candidate_cap=cap, max_logprobs=1, logprobs_mode="processed"))
            assert set(out.tokens.tolist()) == set(tied), (cap, temperature, out.tokens.tolist())
            assert bool(torch.isfinite(out.logprob).all())  # each token is in the kept set
            expected = torch.zeros(64, 8, dtype=torch.bool)
            expected[:, tied] = True
            assert torch.equal(kept_sets(logits, params), expected)
    # A single maximum: min_p = 1.0 keeps only it.
    single = torch.tensor([[0.0, 1.0, 3.0, 2.9]])
    out = sampled(single, row_params(1, min_p=1.0), SamplerConfig(candidate_cap=2, max_logprobs=0))
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
    params = row_params(
        24, temperature=[s.temperature for s in specs], top_k=[s.top_k for s in specs], top_p=[s.top_p for s in specs],
        min_p=[s.min_p for s in specs], seed=np.array([s.seed for s in specs], np.uint64), position=[s.position for s in specs],
        stop_ids=np.array([(0, 1999)] * 24), eos_suppression_rows=np.array([bool(s.suppressed) for s in specs]),
    )
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=64, max_logprobs=3, logprobs_mode=mode)
        refs = ref.sample_rows(logits.numpy(), specs, num_top=3, mode=mode)
        combined = sampled(logits, params, cfg)
        assert _assert_matches_numpy(combined, refs) >= 22
    _assert_kept_sets_match(logits, params, refs)


def test_flat_rows_are_decided_in_the_call():
    """Flat logits: top-p 0.9 keeps about 90% of 500 tokens. Every row is
    decided by `sample` itself and equals
    the numpy reference and the sorting reference path."""
    torch.manual_seed(1)
    logits = torch.randn(32, 500) * 0.1
    top_k = np.where(np.arange(32) % 2, 0, 300)
    min_p = np.where(np.arange(32) % 3, 0.0, 0.5)
    params = row_params(32, top_p=0.9, top_k=top_k, min_p=min_p)
    cfg = SamplerConfig(candidate_cap=16, max_logprobs=3)
    fast = sample(logits, params, cfg)
    assert int(kept_sets(logits, params).sum(-1).min()) > 250
    specs = [ref.RowSpec(temperature=1.0, top_k=int(top_k[i]), top_p=0.9, min_p=float(min_p[i]), seed=i, position=i * 3 + 11)
             for i in range(32)]
    refs = ref.sample_rows(logits.numpy(), specs, num_top=3)
    assert _assert_matches_numpy(fast, refs) >= 28  # rows within rounding of a threshold are skipped
    _assert_kept_sets_match(logits, params, refs)
    assert_same(fast, sample_reference(logits, params, cfg))


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
    params = row_params(n, seed=np.arange(n, dtype=np.uint64) * np.uint64(2654435761), position=np.arange(n) % 977, **case)
    # Plain rows ignore the candidates; filtered rows need more than their kept set.
    plain = case["top_k"] == 0 and case["top_p"] == 1 and case["min_p"] == 0
    needed = max(int((expected > 0).sum()) + 2, case["top_k"] + 1)
    cap = 8 if plain else min(vocab, 2 ** math.ceil(math.log2(needed)))
    out = sample(logits, params, SamplerConfig(candidate_cap=cap, max_logprobs=0), compute_logprobs=False)
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
        alone_params = row_params(1, seed=np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64), position=position, **combo)
        alone = sampled(target[None], alone_params, cfg)
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
        batch = sampled(logits, row_params(64, seed=seeds, position=positions, **batch_kw), cfg)
        assert int(batch.tokens[index]) == int(alone.tokens[0]), seed
        assert torch.equal(batch.top_ids[index], alone.top_ids[0])


# --- edge rows -----------------------------------------------------------------

def test_greedy_ties_go_to_smallest_id():
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 2.0
    logits[1, [49, 12]] = 1.0
    logits[2, :] = -1.0
    for cap in (2, 8, 1024):
        out = sampled(logits, row_params(3, temperature=0.0), SamplerConfig(candidate_cap=cap, max_logprobs=2))
        assert out.tokens.tolist() == [3, 12, 0]
        assert out.rank.tolist() == [1, 1, 1]
        assert out.top_ids.tolist() == [[3, 7], [12, 49], [0, 1]]


def test_forced_tokens_override_the_draw():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    forced = np.array([5, -1, 99, 0])
    params = row_params(4, temperature=[0.0, 1.0, 0.5, 1.0], top_k=[0, 0, 3, 0], forced_tokens=forced)
    out = sampled(logits, params, SamplerConfig(candidate_cap=16, max_logprobs=1))
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
    params = row_params(
        6, temperature=[0.0, 0.0, 1.0, 1.0, 0.7, 1.0], top_k=[0, 0, 0, 0, 1, 0],
        stop_ids=np.array([[0, 1]] * 6), eos_suppression_rows=suppress,
    )
    out = sampled(logits, params, SamplerConfig(candidate_cap=8, max_logprobs=0))
    tokens = out.tokens.tolist()
    assert tokens[0] == 2 and tokens[1] == 0 and tokens[4] == 2
    assert tokens[2] not in (0, 1) and tokens[5] not in (0, 1) and tokens[3] in (0, 1)
    # Many seeds: a suppressed plain row never emits a stop id, even when they
    # hold all but e^-28 of the mass.
    n = 5000
    many = row_params(n, stop_ids=np.array([[0, 1]] * n), eos_suppression_rows=np.ones(n, bool))
    drawn = sample(logits[:1].expand(n, 40), many, SamplerConfig(candidate_cap=8, max_logprobs=0)).tokens
    assert not bool(((drawn == 0) | (drawn == 1)).any())


def test_padding_rows_are_finite():
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=16, max_logprobs=4, logprobs_mode=mode)
        out = sampled(torch.zeros(5, 100), RowParams.neutral(5, 5), cfg)
        assert bool(((out.tokens >= 0) & (out.tokens < 100)).all())
        assert bool(torch.isfinite(out.logprob).all()) and bool(torch.isfinite(out.top_logprobs).all())


def test_sample_is_capture_safe():
    torch.manual_seed(0)
    logits = torch.randn(8, 3000)
    params = row_params(8, temperature=[0, 1, 0.5, 1, 1, 0.9, 1, 2], top_k=[0, 0, 40, 0, 5, 0, 0, 0], top_p=[1, 1, 0.9, 0.8, 1, 1, 1, 1])
    for mode in ("raw", "processed"):
        out = SampleOutput.allocate(8, 5)
        with capture_safety_check({name: getattr(out, name) for name in FIELDS}):
            sample(logits, params, SamplerConfig(candidate_cap=256, max_logprobs=5, logprobs_mode=mode), out)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(candidate_cap=0), "candidate_cap"),
        (dict(max_logprobs=-1), "max_logprobs"),
        (dict(candidate_cap=8, max_logprobs=9), "max_logprobs"),
        (dict(logprobs_mode="logits"), "logprobs_mode"),
        (dict(stop_rows=1), "stop_rows"),
        (dict(stages="greedy", greedy_rows=False), "greedy_rows"),
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
    params = row_params(64, temperature=np.tile([0, 1, 0.7, 1.2], 16), top_k=np.tile([0, 0, 50, 0], 16), top_p=np.tile([1, 1, 0.9, 0.6], 16))
    cfg = SamplerConfig(candidate_cap=256, max_logprobs=5)
    cpu = sample(logits, params, cfg)
    cuda_params = RowParams(**{name: None if value is None else value.cuda() for name, value in vars(params).items()})
    gpu = sample(logits.cuda(), cuda_params, cfg)
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())


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
