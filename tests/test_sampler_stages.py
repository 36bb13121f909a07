"""One implementation per sampler stage, shared by every path: the sampler, the reference
path, `kept_sets` and verification's `target_probs` build on the same kept-set definitions
(a bug planted in one shows in exactly the paths built on it); the logprob, suppression and
exact-path helpers give the full sampler's bits; the greedy and expanded-row variants."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import exact as exact_module
from engine.sampling import filters, thresholds
from engine.sampling import rows as suppression
from engine.sampling import sampler as sampler_module
from engine.sampling import verify as verify_module
from engine.sampling.exact import EXACT_CHUNK_ROWS, kept_sets, sample_reference
from engine.sampling.logprobs import token_logprobs
from engine.sampling.rows import expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError, SamplerConfig, TorchStages, sample
from engine.sampling.verify import target_probs
from tests import numpy_sampler_reference as ref
from tests.test_sampler import FIELDS, assert_same, row_params, sampled, sampler_batches


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
    params = row_params(rows_n, top_k=top_k, min_p=min_p)
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
    params = row_params(40, temperature=np.tile([0.0, 1.0, 0.7, 1.3], 10), top_k=np.tile([0, 0, 50, 0], 10),
                     top_p=np.tile([1.0, 1.0, 0.9, 0.8], 10))
    cfg = SamplerConfig(candidate_cap=64, max_logprobs=0)
    out = sampled(logits, params, cfg)
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
    rows = expand_rows(row_params(4, stop_ids=stop_ids, eos_suppression_rows=suppress), vocab)
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
    params = row_params(6, temperature=np.array([0.0, 1.0, 0.7, 1.0, 1.3, 0.0]), top_k=np.array([0, 20, 0, 0, 5, 0]),
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
    params = row_params(16, temperature=np.tile([0.0, 1.0, 0.6, 1.2], 4), top_k=np.tile([0, 0, 30, 0], 4),
                     top_p=np.tile([1.0, 1.0, 0.9, 0.7], 4), min_p=np.tile([0.0, 0.0, 0.0, 0.01], 4))
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(candidate_cap=64, max_logprobs=3, logprobs_mode=mode)
        rows_major = sampled(logits, params, cfg)
        cols_major = sampled(column_major, params, cfg)
        assert_same(rows_major, cols_major)
    assert torch.equal(target_probs(logits, params), target_probs(column_major, params))


def test_exact_path_slices_give_the_bits_of_each_row_alone():
    """The exact path decides rows in slices of EXACT_CHUNK_ROWS: rows on
    either side of a slice edge equal the same rows run alone."""
    rows_n = 2 * EXACT_CHUNK_ROWS + 22
    logits = torch.randn(rows_n, 200, generator=torch.Generator().manual_seed(4)) * 2
    params = row_params(rows_n, temperature=np.tile([0.0, 1.0, 0.8], rows_n)[:rows_n],
                     top_p=np.tile([1.0, 1.0, 0.9], rows_n)[:rows_n])
    cfg = SamplerConfig(candidate_cap=16, max_logprobs=3)
    whole = sample_reference(logits, params, cfg)
    for i in (0, EXACT_CHUNK_ROWS - 1, EXACT_CHUNK_ROWS, 2 * EXACT_CHUNK_ROWS, rows_n - 1):
        alone = sample_reference(logits[i : i + 1], params.rows([i]), cfg)
        for name in FIELDS:
            assert torch.equal(getattr(whole, name)[i], getattr(alone, name)[0]), (i, name)


@settings(max_examples=60, deadline=None)
@given(sampler_batches())
def test_every_variant_that_can_serve_a_batch_gives_the_full_samplers_bits(batch):
    """The lighter variants (graph sets) skip passes, never change a definition:
    top-k by a topk of candidate_cap scores instead of the counting radix,
    top-p or the filters skipped where no row has them, the greedy fast path."""
    logits, rp, cap, mode, num_top, stop = batch
    params = row_params(len(rp), temperature=[r[0] for r in rp], top_k=[r[1] for r in rp], top_p=[r[2] for r in rp],
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
    # Without the kept mask (no processed logprobs): the same masses, bit for bit (a weight
    # of mass 0 may read as exp(SUBNORMAL_Z) there).
    for variant in (dict(), dict(top_k="topk", top_k_width=width)):
        lean = thresholds.row_distribution(masked, best, rows, kept_set=False, **variant)
        assert lean.kept is None and torch.equal(lean.block_mass, d.block_mass)
        assert torch.equal(thresholds.token_masses(lean.weights), thresholds.token_masses(d.weights))
    if not bool(rows.k_on.any()):
        assert torch.equal(thresholds.row_distribution(masked, best, rows, top_k="none").kept, kept)
    if not bool(rows.p_on.any()):
        assert torch.equal(thresholds.row_distribution(masked, best, rows, top_p=False).kept, kept)


@settings(max_examples=80, deadline=None)
@given(sampler_batches(), st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["nan", "inf", "-inf", "row", "stop nan",
                                                                               "stop inf"])), max_size=3))
def test_a_variant_told_what_no_row_holds_gives_the_full_samplers_bits(batch, broken):
    """`SamplerConfig.greedy_rows`, `stop_rows`, `forced_rows`, `scaled_rows` False: the host
    knows no row is greedy, suppresses a stop id, has a forced token, or a temperature other
    than 1, and the torch stages skip what only such a row needs (the argmax, the
    suppression, the override, the division). Every field and
    error equals the full sampler's, rows with NaN, +-inf, a row of -inf and a NaN or +inf
    at a stop id included; each flag is tried wherever the rows allow it."""
    logits, rp, _, _, _, stop = batch
    rows_n, vocab = logits.shape
    for row, kind in broken:  # non-finite logits: the finite check without the argmax or the stop slots
        if row < rows_n:
            column = stop[0] if kind.startswith("stop") else (row * 7) % vocab
            if kind == "row":
                logits[row] = -math.inf
            else:
                logits[row, column] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind.split()[-1]]
    temperature = np.array([r[0] for r in rp])
    suppress = np.array([r[6] for r in rp])
    forced = np.array([r[7] for r in rp])
    params = row_params(rows_n, temperature=temperature, top_k=[r[1] for r in rp], top_p=[r[2] for r in rp],
                        min_p=[r[3] for r in rp], seed=[r[4] for r in rp], position=[r[5] for r in rp],
                        stop_ids=np.tile(stop, (rows_n, 1)), eos_suppression_rows=suppress, forced_tokens=forced)
    full = SamplerConfig(max_logprobs=0)
    want = sample(logits, params, full, compute_logprobs=False)
    rows = expand_rows(params, vocab)
    sampled_rows = ~rows.greedy
    filtered = bool(((rows.k_on | rows.p_on | rows.m_on) & sampled_rows).any())
    stages = ["filters"] + ([] if filtered else ["plain"])
    flags = [dict(greedy_rows=g, stop_rows=s, forced_rows=f, scaled_rows=t) for g in (True, False)
             for s in (True, False) for f in (True, False) for t in (True, False)]
    allowed = [f for f in flags if (f["greedy_rows"] or not (temperature == 0).any())
               and (f["stop_rows"] or not suppress.any()) and (f["forced_rows"] or not (forced >= 0).any())
               and (f["scaled_rows"] or ((temperature == 0) | (temperature == 1)).all())]
    variants = [dataclasses.replace(full, stages=st_, **f) for st_ in stages for f in allowed]
    if not sampled_rows.any() and not suppress.any():
        variants += [dataclasses.replace(full, stages="greedy", forced_rows=f["forced_rows"]) for f in allowed]
    for cfg in variants:
        got = sample(logits, params, cfg, compute_logprobs=False)
        assert_same(got, want)
        assert torch.equal(got.error, want.error), cfg


@pytest.mark.parametrize("vocab", [50, 1024])  # 50: one torch.max pass; 1024: the blocked search
def test_greedy_stage_fails_non_finite_rows_like_the_full_sampler(vocab):
    """The greedy fast path's finite check: NaN, +inf and -inf rows fail with
    LOGITS_NOT_FINITE and the placeholder; bystanders get the full sampler's
    tokens, forced tokens included."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[1, 7], logits[3, 0], logits[4, vocab - 1] = math.nan, math.inf, -math.inf
    params = row_params(6, temperature=0.0, forced_tokens=np.array([-1, -1, 9, -1, -1, -1]))
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
    params = row_params(4, temperature=0.0, top_k=np.array([0, 3, 0, 2]), top_p=np.array([1.0, 1.0, 0.5, 0.9]),
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
    params = row_params(3)
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
        "filters": row_params(6, temperature=temperature, top_k=np.array([0, 20, 0, 0, 5, 0]),
                           top_p=np.array([1.0, 0.9, 1.0, 0.8, 1.0, 1.0]), min_p=np.array([0, 0, 0.1, 0, 0, 0])),
        "plain": row_params(6, temperature=temperature),
        "greedy": row_params(6, temperature=0.0),
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


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([64, 192, 1088, 2048]), st.integers(3, 8))
def test_min_p_candidate_blocks_draw_the_full_samplers_tokens(seed, vocab, rows_n):
    """On a CPU a draw whose only cut is min-p weighs only min-p's candidate blocks (V a
    multiple of CANDIDATE_BLOCK): the full sampler's tokens and error codes, for rows of
    every temperature (greedy too) and min_p 0, 1e-30, 0.05 and 1 (ties at the maximum),
    with -inf and a NaN salted in."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy((rng.integers(0, 8, (rows_n, vocab)) * rng.choice([0.5, 4.0, 40.0])).astype(np.float32))
    logits[torch.from_numpy(rng.random((rows_n, vocab)) < 0.02)] = -math.inf
    if rng.random() < 0.3:
        logits[rng.integers(rows_n), rng.integers(vocab)] = math.nan
    temperature = rng.choice([0.5, 1.0, 1.7], rows_n)
    temperature[::3] = 0.0  # greedy rows 0, 3, 6
    min_p = rng.choice([0.0, 1e-30, 0.05, 1.0], rows_n)
    min_p[1:3] = rng.permutation([0.05, 1.0])  # every batch has both cuts on sampled rows
    params = row_params(rows_n, temperature=temperature, min_p=min_p, seed=rng.integers(0, 2**63, rows_n))
    full = SamplerConfig(max_logprobs=0)
    want = sample(logits, params, full, compute_logprobs=False)
    got = sample(logits, params, dataclasses.replace(full, top_k="none", top_p=False), compute_logprobs=False)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.error, want.error)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(64, 10000), (3, 300), (16, 2048), (5, 1088)]))
def test_draw_weights_are_the_whole_row_chain(seed, shape):
    """The draw-only path's spans of blocks (64 rows x 10000 tokens: three spans on a CPU,
    the last block partial), and with min-p on a CPU its candidate blocks (V a multiple of
    CANDIDATE_BLOCK: 2048, and 1088, whose last block is partial; column-major logits too),
    against the chain written out over whole rows: z = (s - M) / T,
    exp, min-p's verdict (weight >= min_p, ties at min_p = 1 kept), the masses, their sums
    per block. Logits spread down to z = -300 (weights below the least normal float32,
    mass 0), -inf salted in; every row's block masses and token masses bit for bit."""
    rows_n, vocab = shape
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy((rng.integers(0, 8, (rows_n, vocab)) * rng.choice([0.5, 4.0, 40.0])).astype(np.float32))
    logits[torch.from_numpy(rng.random((rows_n, vocab)) < 0.02)] = -math.inf
    params = row_params(rows_n, temperature=rng.choice([0.0, 0.5, 1.0, 1.7], rows_n),
                        min_p=rng.choice([0.0, 0.05, 0.5, 1.0], rows_n))
    rows = expand_rows(params, vocab)
    best = logits.amax(-1)
    for floor_on, layout in ((False, logits), (True, logits), (True, logits.t().contiguous().t())):
        got = thresholds.draw_weights(layout, best, rows.temperature, thresholds._min_p_floor(rows) if floor_on else None)
        z = (logits - best[:, None]) / rows.temperature[:, None]
        weights = torch.exp(z)
        if floor_on:
            on = (params.min_ps > 0) & (params.temperatures > 0)
            weights = torch.where(~on[:, None] | (weights >= params.min_ps[:, None]), weights, torch.zeros(()))
        masses = torch.floor(weights.double() * 2.0 ** thresholds.mass_bits(vocab))
        blocks = -(-vocab // thresholds.BLOCK)
        padded = torch.nn.functional.pad(masses, (0, blocks * thresholds.BLOCK - vocab))
        assert torch.equal(got.block_mass, padded.view(rows_n, blocks, thresholds.BLOCK).sum(-1))
        assert torch.equal(thresholds.token_masses(got.weights), masses)
