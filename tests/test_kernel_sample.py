"""The sampling kernel (engine/sampling/kernels/sample.py) against the torch path.

Under Triton's interpreter on the CPU (tests/conftest.py), with torch's exp and log
(tests/kernel_interpreter.py): tokens, errors, ranks and top-N ids identical, logprobs
within 2 ulp. The reference is the torch path's building blocks composed in vLLM's stage
order (min-p, then top-k, then top-p over what both leave); where min-p is off it is also
today's `sample`. Fixed batches, hand-built rows and the op's contract are in
tests/test_kernel_sample_fixed_rows.py.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from engine.sampling.draw import staged_draw_uniforms
from engine.sampling.draw import drawn_token, inverse_cdf_draw
from engine.sampling.kernels import interpreting
from engine.sampling.kernels import sample as kernel_module
from engine.sampling.kernels.sample import SampleScratch, sample_rows
from engine.sampling.logprobs import processed_row_logprobs, raw_logprobs
from engine.sampling.thresholds import (
    BLOCK, KEY_MAX, RowDistribution, block_sums, first_max, order_keys, processed_scores, radix_threshold, token_masses,
)
from engine.sampling.rows import expand_rows
from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError, SamplerConfig, row_errors, sample, write_placeholders
from engine.sampling.rows import suppressed_scores
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from tests.kernel_interpreter import torch_math

LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"
FIELDS = ("tokens", "error", "rank", "top_ids")
# The bar is 2 ulp (libdevice's log against torch's); here both sides take torch's exp and log,
# so the logprobs are the same bits (a difference in rounding, e.g. z's, shows).
LOGPROB_ULPS = 0 if interpreting() else 2
# NaN rows and empty kept sets are part of the inputs: numpy says so when the interpreter casts and logs them.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")]


@pytest.fixture(autouse=True, scope="module")
def interpreter_math():
    with torch_math():
        yield


# -- the reference: the torch path's stages in vLLM's order ---------------------------------


def reference(scores: torch.Tensor, params: RowParams, num_top: int, mode: str | None, *,
              logits: torch.Tensor | None = None, nothing_allowed: torch.Tensor | None = None) -> SampleOutput:
    """`sample`'s stages with the kept set of vLLM's order: min-p, then top-k (counting every
    token, as `thresholds` does), then top-p over the masses of what both leave."""
    return reference_with_kept_set(scores, params, num_top, mode, logits=logits, nothing_allowed=nothing_allowed)[0]


def reference_with_kept_set(scores: torch.Tensor, params: RowParams, num_top: int, mode: str | None, *,
                            logits: torch.Tensor | None = None, nothing_allowed: torch.Tensor | None = None
                            ) -> tuple[SampleOutput, torch.Tensor]:
    """`reference`, and each row's kept set [rows, V] bool."""
    rows_n, vocab = scores.shape
    plain = scores if logits is None else logits
    rows = expand_rows(params, vocab)
    masked = suppressed_scores(scores, rows)
    best, greedy = first_max(masked)
    shift, z = processed_scores(masked, best, rows)
    weights = z.exp()
    keys = order_keys(z)
    kept = (masked > -math.inf) & (weights >= torch.where(rows.m_on, rows.min_p, -1.0).to(torch.float32)[:, None])
    top_k_cut = torch.where(rows.k_on, radix_threshold(keys, None, rows.top_k.to(torch.float64)), KEY_MAX)
    kept &= keys <= top_k_cut[:, None]
    mass = token_masses(weights.masked_fill(~kept, 0.0))
    top_p_cut = torch.where(rows.p_on, radix_threshold(keys, mass, rows.top_p * mass.sum(-1)), KEY_MAX)
    kept &= keys <= top_p_cut[:, None]
    weights.masked_fill_(~kept, 0.0)
    d = RowDistribution(shift, z, kept, weights, block_sums(weights))
    token = drawn_token(rows, greedy, inverse_cdf_draw(d.weights, d.block_mass, rows.uniform))
    error = row_errors(plain, best == -math.inf, nothing_allowed)
    failed = error != RowError.OK
    token = torch.where(failed, PLACEHOLDER_TOKEN, token)
    out = SampleOutput.allocate(rows_n, num_top)
    if mode is not None:
        lp = processed_row_logprobs(d, token, num_top) if mode == "processed" else raw_logprobs(plain, token, num_top)
        lp.write(out)
    out.tokens.copy_(token)
    out.error.copy_(error)
    write_placeholders(out, failed)
    return out, kept


@contextmanager
def chunk_of(tokens: int) -> Iterator[None]:
    """The kernel's passes step `tokens` at a time (the interpreter's default: the whole row)."""
    saved = kernel_module._chunk
    kernel_module._chunk = lambda vocab, device: tokens
    try:
        yield
    finally:
        kernel_module._chunk = saved


def run_kernel(scores, params, num_top, mode, **kw) -> SampleOutput:
    out = SampleOutput.allocate(scores.shape[0], num_top)
    return sample_rows(scores, params, out, SampleScratch.allocate(scores.shape[0], scores.shape[1], "cpu", num_top),
                       logprobs=mode, **kw)


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int = 2) -> bool:
    """Equal (infinities and NaN alike), or finite float32 values at most `ulps` apart."""
    a, b = a.float().flatten(), b.float().flatten()
    same = (a == b) | (a.isnan() & b.isnan())
    ia, ib = a.view(torch.int32).to(torch.int64), b.view(torch.int32).to(torch.int64)
    close = (torch.sign(a) == torch.sign(b)) & a.isfinite() & b.isfinite() & ((ia - ib).abs() <= ulps)
    return bool((same | close).all())


def assert_agree(got: SampleOutput, want: SampleOutput, what: str, logprobs: bool = True) -> None:
    """Tokens, errors, ranks and top-N ids identical; logprobs within LOGPROB_ULPS."""
    for name in FIELDS if logprobs else FIELDS[:3]:
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name} {getattr(got, name)} != {getattr(want, name)}"
    if logprobs:
        assert within_ulps(got.logprob, want.logprob, LOGPROB_ULPS), f"{what}: logprob {got.logprob} != {want.logprob}"
        assert within_ulps(got.top_logprobs, want.top_logprobs, LOGPROB_ULPS), f"{what}: top_logprobs"


# -- inputs ---------------------------------------------------------------------------------

PATTERNS = ("normal", "ties", "flat", "tiny", "peaked", "masked", "nan", "inf", "all_masked", "all_suppressed")


def row_values(rng: np.random.Generator, vocab: int, pattern: str) -> np.ndarray:
    """One row of unprocessed logits [V] f32 of a kind the kernel must get right."""
    row = (rng.standard_normal(vocab) * rng.choice([0.5, 3.0, 12.0])).astype(np.float32)
    if pattern == "ties":  # a few distinct values: ties everywhere, at every cut
        row = rng.integers(-3, 3, vocab).astype(np.float32)
    elif pattern == "flat":
        row = np.zeros(vocab, np.float32)
    elif pattern == "tiny":  # distinct values within a few ulps: a flat row with no ties
        row = (1.0 + rng.integers(0, 64, vocab) * np.float32(2 ** -23)).astype(np.float32)
    elif pattern == "peaked":
        row[rng.integers(vocab)] = 40.0
    elif pattern == "nan":
        row[rng.integers(vocab)] = np.nan
    elif pattern == "inf":
        row[rng.integers(vocab)] = rng.choice([np.inf, -np.inf])
    return row


@st.composite
def batches(draw, max_rows: int = 3, vocabs=(7, 64, 333, 1024, 1500), min_p_off: bool = False):
    vocab = draw(st.sampled_from(vocabs))
    rows_n = draw(st.integers(1, max_rows))
    reqs = draw(st.integers(1, rows_n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_stop = draw(st.integers(1, 3))
    patterns = [draw(st.sampled_from(PATTERNS)) for _ in range(rows_n)]
    plain = np.stack([row_values(rng, vocab, p) for p in patterns])
    # Scores that differ from the logits (bias, masked tokens) come with the logits beside them.
    controls = draw(st.booleans()) or any(p in ("masked", "all_masked") for p in patterns)
    scores = plain.copy()
    row_to_req = np.sort(rng.integers(0, reqs, rows_n))
    stop_ids = rng.choice(np.array([-1, 0, vocab - 1, vocab, int(rng.integers(vocab))]), (reqs, num_stop))
    eos_rows = rng.random(rows_n) < 0.4
    for r, pattern in enumerate(patterns):
        if controls or pattern in ("masked", "all_masked"):
            scores[r] += np.where(rng.random(vocab) < 0.1, rng.standard_normal(vocab).astype(np.float32), 0)
            cut = rng.random(vocab) < (1.0 if pattern == "all_masked" else 0.3)
            scores[r, cut] = -np.inf
        if pattern == "all_suppressed":  # the one token left is a suppressed stop id
            scores[r, 1:] = -np.inf
            stop_ids[row_to_req[r], 0] = 0
            eos_rows[r] = True
    nothing_allowed = np.array([draw(st.sampled_from([False] * 5 + [True])) for _ in range(rows_n)])
    k_choices = [0, 1, 2, 5, vocab - 1, vocab, vocab + 3]
    params = RowParams.from_numpy(
        temperatures=np.array([draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])) for _ in range(reqs)], np.float32),
        top_ks=np.array([draw(st.sampled_from(k_choices)) for _ in range(reqs)], np.int32),
        # Off half the time: a cut hides the cuts after it, so each one is seen alone too.
        top_ps=np.array([draw(st.sampled_from([1.0] * 5 + [0.999, 0.9, 0.5, 0.1, 1e-6])) for _ in range(reqs)],
                        np.float32),
        min_ps=np.array([0.0 if min_p_off else draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.5, 1.0]))
                         for _ in range(reqs)], np.float32),
        seeds=rng.integers(0, 2**63, reqs).astype(np.uint64),
        sample_positions=rng.integers(0, 1000, reqs),
        row_to_req=row_to_req,
        local_step=np.zeros(rows_n, np.int64),
        stop_ids=stop_ids,
        eos_suppression_rows=eos_rows,
        forced_tokens=np.where(rng.random(rows_n) < 0.2, rng.integers(0, vocab, rows_n), -1),
        draw_uniforms=rng.random(rows_n) * 0.999 + 0.0005,
    )
    num_top = draw(st.sampled_from([0, 1, 3, min(8, vocab)]))
    mode = draw(st.sampled_from([None, "raw", "processed"]))
    return dict(scores=torch.from_numpy(scores), logits=torch.from_numpy(plain) if controls else None,
                nothing_allowed=torch.from_numpy(nothing_allowed), params=params, num_top=num_top, mode=mode)


def fixed_batch(vocab: int = 2500, rows_n: int = 4) -> dict:
    """Rows of every kind, all controls on somewhere: a flat row, ties, a NaN row, a peaked one."""
    rng = np.random.default_rng(5)
    plain = np.stack([row_values(rng, vocab, p) for p in ("tiny", "ties", "nan", "peaked")[:rows_n]])
    params = RowParams.from_numpy(
        temperatures=np.array([1.0, 0.7, 1.0, 0.0][:rows_n], np.float32),
        top_ks=np.array([2000, 3, 0, 0][:rows_n], np.int32),
        top_ps=np.array([0.97, 0.9, 0.5, 1.0][:rows_n], np.float32),
        min_ps=np.array([0.0, 0.05, 0.0, 0.0][:rows_n], np.float32),
        seeds=np.arange(rows_n, dtype=np.uint64), sample_positions=np.arange(rows_n) + 9,
        row_to_req=np.arange(rows_n), local_step=np.zeros(rows_n, np.int64),
        stop_ids=np.array([[3, -1]] * rows_n), eos_suppression_rows=np.array([True, False, True, False][:rows_n]),
        draw_uniforms=staged_draw_uniforms(np.arange(rows_n, dtype=np.uint64), np.arange(rows_n) + 9,
                                           np.arange(rows_n), np.zeros(rows_n, np.int64)),
    )
    return dict(scores=torch.from_numpy(plain), params=params)


def single_row(values: list[float], **controls) -> tuple[torch.Tensor, RowParams]:
    row = torch.tensor([values], dtype=torch.float32)
    c = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5) | controls
    params = RowParams.from_numpy(
        temperatures=np.array([c["temperature"]], np.float32), top_ks=np.array([c["top_k"]], np.int32),
        top_ps=np.array([c["top_p"]], np.float32), min_ps=np.array([c["min_p"]], np.float32),
        seeds=np.zeros(1, np.uint64), sample_positions=np.zeros(1, np.int64), row_to_req=np.zeros(1, np.int64),
        local_step=np.zeros(1, np.int64), draw_uniforms=np.array([c["u"]]))
    return row, params


# -- the kernel against the reference -------------------------------------------------------


@settings(max_examples=300 if LONG else 12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_kernel_matches_the_torch_stages_in_vllm_order(batch):
    kw = dict(logits=batch["logits"], nothing_allowed=batch["nothing_allowed"])
    got = run_kernel(batch["scores"], batch["params"], batch["num_top"], batch["mode"], **kw)
    want = reference(batch["scores"], batch["params"], batch["num_top"], batch["mode"], **kw)
    assert_agree(got, want, "kernel vs reference", logprobs=batch["mode"] is not None)


@settings(max_examples=100 if LONG else 5, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(min_p_off=True))
def test_kernel_matches_sample_where_min_p_is_off(batch):
    """Without min-p the two stage orders keep the same sets: today's `sample` agrees."""
    mode = batch["mode"]
    got = run_kernel(batch["scores"], batch["params"], batch["num_top"], mode, logits=batch["logits"])
    want = SampleOutput.allocate(batch["scores"].shape[0], batch["num_top"])
    cfg = SamplerConfig(max_logprobs=batch["num_top"], logprobs_mode=mode or "raw")
    sample(batch["scores"].clone(), batch["params"], cfg, want, compute_logprobs=mode is not None,
           unprocessed=batch["logits"])
    assert_agree(got, want, "kernel vs sample")


@settings(max_examples=60 if LONG else 12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(max_rows=2, vocabs=(7, 64)))
def test_kept_sets_are_the_references(batch):
    """Processed top-N over the whole vocabulary lists the kept set, best first: the same
    tokens as the reference's, in the same order (ties at every cut included), then the
    tokens outside it by id."""
    vocab = batch["scores"].shape[1]
    kw = dict(logits=batch["logits"], nothing_allowed=batch["nothing_allowed"])
    got = run_kernel(batch["scores"], batch["params"], vocab, "processed", **kw)
    want, kept = reference_with_kept_set(batch["scores"], batch["params"], vocab, "processed", **kw)
    assert_agree(got, want, "kept sets")
    # The kept tokens first, then every other id in ascending order (at -inf): real ids only.
    for r in torch.nonzero(got.error == RowError.OK).flatten().tolist():
        ids, n = got.top_ids[r].tolist(), int(kept[r].sum())
        assert sorted(ids[:n]) == torch.nonzero(kept[r]).flatten().tolist()
        assert ids[n:] == torch.nonzero(~kept[r]).flatten().tolist()


@settings(max_examples=60 if LONG else 8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(vocabs=(1025, 2500, 3000)), st.sampled_from([2, 5, 9]))
def test_rows_split_over_programs_match_the_torch_stages(batch, programs):
    """Each row over several programs (chunks of 1024 tokens, so a row of 3000 is up to 3
    parts, the last one short), one launch per phase, each phase merged by the last program
    of the row to finish it: the torch stages' results, bit for bit (tokens, errors, ranks,
    top-N; logprobs within LOGPROB_ULPS), whatever the split."""
    kw = dict(logits=batch["logits"], nothing_allowed=batch["nothing_allowed"])
    rows_n, vocab = batch["scores"].shape
    assert kernel_module.split(rows_n, vocab, BLOCK, programs)[0] == min(-(-vocab // BLOCK), max(1, programs // rows_n))
    with chunk_of(BLOCK):
        got = run_kernel(batch["scores"], batch["params"], batch["num_top"], batch["mode"], programs=programs, **kw)
    want = reference(batch["scores"], batch["params"], batch["num_top"], batch["mode"], **kw)
    assert_agree(got, want, f"split over {programs} programs vs reference", logprobs=batch["mode"] is not None)


def test_a_split_row_launches_once_per_phase_and_leaves_its_scratch_clean():
    """Two rows over 6 programs: 3 parts each (V = 2500, chunks of 1024), 9 launches; the
    counters and histograms are zero again after the step (the next step's merges count on
    it), and a second run gives the same outputs."""
    batch = fixed_batch(rows_n=2)
    out = SampleOutput.allocate(2, 5)
    scratch = SampleScratch.allocate(2, 2500, "cpu", num_top=5)
    launches = []
    saved = kernel_module.sample_kernel.run

    def counting(*args, grid, warmup, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launches.append((tuple(grid), kwargs["FIRST_PHASE"], kwargs["LAST_PHASE"]))
        return saved(*args, grid=grid, warmup=warmup, **kwargs)

    kernel_module.sample_kernel.run = counting
    try:
        with chunk_of(BLOCK):
            sample_rows(batch["scores"], batch["params"], out, scratch, logprobs="processed", programs=6)
    finally:
        del kernel_module.sample_kernel.run
    assert launches == [((2, 3), phase, phase) for phase in range(kernel_module.PHASES)]
    assert not scratch.arrivals.any() and not scratch.hist.any()
    first = out.tokens.clone(), out.top_ids.clone()
    with chunk_of(BLOCK):
        sample_rows(batch["scores"], batch["params"], out, scratch, logprobs="processed", programs=6)
    assert torch.equal(out.tokens, first[0]) and torch.equal(out.top_ids, first[1])
    assert_agree(out, reference(batch["scores"], batch["params"], 5, "processed"), "split vs reference")


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_top_n_lists_merge_across_the_parts_of_a_row(mode):
    """A row whose 8 best tokens lie in all 3 parts (chunks of 1024): the merged top-N is the
    reference's, in order."""
    values = np.full(3000, -5.0, np.float32)
    for place, token in enumerate((2900, 40, 1500, 2100, 700, 1023, 1024, 2999)):
        values[token] = 10.0 - place * 0.5
    row, params = single_row(values.tolist(), temperature=1.0)
    with chunk_of(BLOCK):
        got = run_kernel(row, params, 8, mode, programs=3)
    assert_agree(got, reference(row, params, 8, mode), f"{mode} top-8 over 3 parts")
    assert got.top_ids[0].tolist() == [2900, 40, 1500, 2100, 700, 1023, 1024, 2999]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [None, "raw", "processed"])
def test_rows_split_over_the_sms_match_one_program_per_row_on_the_gpu(mode):
    """On a GPU (gpu_check.sh): 4 rows of V = 129280 split over the SMs, 9 launches whose
    merges order memory by atomics and barriers, against one program per row (one launch):
    the same bits; tokens, errors, ranks and top-N ids as the torch stages'."""
    batch = fixed_batch(vocab=129280)
    cuda = {name: getattr(batch["params"], name).cuda() if isinstance(getattr(batch["params"], name), torch.Tensor)
            else getattr(batch["params"], name) for name in vars(batch["params"])}
    params, scores = RowParams(**cuda), batch["scores"].cuda()
    outs = []
    for programs in (None, 1):
        out = SampleOutput.allocate(4, 20, "cuda")
        sample_rows(scores, params, out, SampleScratch.allocate(4, 129280, "cuda", num_top=20), logprobs=mode,
                    programs=programs)
        outs.append(out)
    for name in vars(outs[0]):
        assert torch.equal(getattr(outs[0], name), getattr(outs[1], name)), name
    want = reference(batch["scores"], batch["params"], 20, mode)
    got = SampleOutput(**{name: getattr(outs[0], name).cpu() for name in vars(outs[0])})
    assert_agree(got, want, "split on the GPU vs the torch stages", logprobs=False)
    # A greedy row whose maximum ties in parts 1 and 2 (3 chunks of 1024 on the GPU): the first
    # part's index wins (argmax's tie break, which the interpreter's numpy argmax always takes).
    values = [0.0] * 3000
    values[2500] = values[1100] = values[2000] = 7.0
    row, params = single_row(values, temperature=0.0)
    params = RowParams(**{name: value.cuda() if isinstance(value, torch.Tensor) else value
                          for name, value in vars(params).items()})
    out = SampleOutput.allocate(1, 0, "cuda")
    sample_rows(row.cuda(), params, out, SampleScratch.allocate(1, 3000, "cuda"))
    assert out.tokens.tolist() == [1100]
