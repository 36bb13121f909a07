"""The sampling kernel's kept list (engine/sampling/kernels/kept_list.py) against the torch path.

A row whose cut keeps few tokens is settled from the ids its cut's last pass listed: top-p
over the list (after top-k), the draw, the kept total, processed top-N and ranks, and the
raw rank where the scores are the logits (their masses summed in the cut's first pass). These
cases aim at it: top-k from 1 to past the list's 1024 ids, top-p from a single token to
nearly all, ties, min-p, rows split over programs; tokens, ranks and top-N ids identical to
the reference (`tests.test_kernel_sample.reference`, the torch stages in vLLM's order),
logprobs to the same bits under the interpreter. tests/test_kernel_passes.py checks which
rows the list settles.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from engine.sampling.sampler import RowError
from engine.sampling.kernels.kept_set import LIST_CAP
from engine.sampling.row_params import RowParams
from tests.test_kernel_sample import (LONG, assert_agree, chunk_of, interpreter_math, pytestmark, reference,  # noqa: F401
                                      reference_with_kept_set, run_kernel)


@st.composite
def short_kept_sets(draw, vocabs=(64, 1500, 3000)):
    vocab = draw(st.sampled_from(vocabs))
    rows_n = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(rows_n):
        kind = draw(st.sampled_from(["normal", "normal", "ties", "peaked", "flat"]))
        if kind == "ties":
            rows.append(rng.integers(-4, 4, vocab).astype(np.float32))
        elif kind == "flat":  # a nucleus of thousands: the list overflows
            rows.append((rng.standard_normal(vocab) * 0.01).astype(np.float32))
        else:
            row = (rng.standard_normal(vocab) * draw(st.sampled_from([1.0, 3.0, 8.0]))).astype(np.float32)
            if kind == "peaked":
                row[rng.integers(vocab)] = 30.0
            rows.append(row)
    k_choices = [0, 1, 3, 20, 200, int(LIST_CAP) - 24, int(LIST_CAP) + 76]
    params = RowParams.from_numpy(
        temperatures=np.array([draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(rows_n)], np.float32),
        top_ks=np.array([draw(st.sampled_from(k_choices)) for _ in range(rows_n)], np.int32),
        top_ps=np.array([draw(st.sampled_from([1.0, 0.999, 0.95, 0.7, 0.3, 1e-6])) for _ in range(rows_n)],
                        np.float32),
        min_ps=np.array([draw(st.sampled_from([0.0, 0.0, 0.02])) for _ in range(rows_n)], np.float32),
        seeds=rng.integers(0, 2**63, rows_n).astype(np.uint64), sample_positions=rng.integers(0, 1000, rows_n),
        row_to_req=np.arange(rows_n), local_step=np.zeros(rows_n, np.int64),
        stop_ids=rng.choice(np.array([-1, 0, int(rng.integers(vocab))]), (rows_n, 2)),
        eos_suppression_rows=rng.random(rows_n) < 0.5,
        forced_tokens=np.where(rng.random(rows_n) < 0.15, rng.integers(0, vocab, rows_n), -1),
        draw_uniforms=rng.random(rows_n) * 0.999 + 0.0005,
    )
    return dict(scores=torch.from_numpy(np.stack(rows)), params=params,
                num_top=draw(st.sampled_from([0, 3, 8])), mode=draw(st.sampled_from([None, "raw", "processed"])),
                programs=draw(st.sampled_from([1, 3])) * rows_n)


@settings(max_examples=200 if LONG else 6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(short_kept_sets())
def test_rows_settled_from_the_kept_list_match_the_torch_stages(batch):
    """One program per row, or each row split in up to 3 (chunks of 1024: the list is
    gathered by several programs, in any order)."""
    scores, params, num_top, mode = batch["scores"], batch["params"], batch["num_top"], batch["mode"]
    with chunk_of(1024):
        got = run_kernel(scores, params, num_top, mode, programs=batch["programs"])
    assert_agree(got, reference(scores, params, num_top, mode), "kept list vs reference", logprobs=mode is not None)


@settings(max_examples=60 if LONG else 4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(short_kept_sets(vocabs=(64,)))
def test_the_kept_lists_sets_are_the_references(batch):
    """Processed top-N over the whole vocabulary: the kept set best first, then every other
    id ascending (vLLM's -inf padding, which the list's merge writes itself)."""
    scores, params = batch["scores"], batch["params"]
    got = run_kernel(scores, params, 64, "processed")
    want, kept = reference_with_kept_set(scores, params, 64, "processed")
    assert_agree(got, want, "kept list sets")
    for r in torch.nonzero(got.error == RowError.OK).flatten().tolist():
        ids, n = got.top_ids[r].tolist(), int(kept[r].sum())
        assert sorted(ids[:n]) == torch.nonzero(kept[r]).flatten().tolist()
        assert ids[n:] == torch.nonzero(~kept[r]).flatten().tolist()


@pytest.mark.parametrize("top_p, min_p", [(0.999, 0.02), (0.999, 0.0), (0.9, 0.0), (1.0, 0.02)])
def test_top_p_over_a_list_whose_keys_pass_two(top_p, min_p):
    """Top-k 20 of N(0, 9) scores keeps z down to about -4: order keys (the bits of -z) past
    2**30, where a (key, id) pair packed above 32 id bits overran its sentinel and top-p
    over the list kept only the tokens of |z| < 2 (found by the test above, fixed)."""
    rng = np.random.default_rng(0)
    scores = torch.from_numpy((rng.standard_normal((1, 64)) * 3).astype(np.float32))
    params = RowParams.from_numpy(
        temperatures=np.array([1.0], np.float32), top_ks=np.array([20], np.int32),
        top_ps=np.array([top_p], np.float32), min_ps=np.array([min_p], np.float32), seeds=np.zeros(1, np.uint64),
        sample_positions=np.zeros(1, np.int64), row_to_req=np.zeros(1, np.int64), local_step=np.zeros(1, np.int64),
        stop_ids=np.array([[0, 15]]), eos_suppression_rows=np.array([True]), forced_tokens=np.array([-1]),
        draw_uniforms=np.array([0.2241]))
    got = run_kernel(scores, params, 64, "processed")
    want, kept = reference_with_kept_set(scores, params, 64, "processed")
    assert int(kept.sum()) > 10 or top_p < 0.99  # the reference keeps tokens past |z| = 2
    assert_agree(got, want, "top-p past |z| = 2")


@pytest.mark.parametrize("stops", [[7, 7], [7, -1], [-1, -1], [7, 64]], ids=["twice", "once", "none", "past V"])
def test_the_raw_rank_from_the_list_counts_a_suppressed_stop_id_once(stops):
    """Raw logprobs of a drawn row: the rank counts the logits above the token's over the
    whole row, a suppressed stop id (at -inf in the scores, so off the kept list) included,
    once however often it is listed."""
    rng = np.random.default_rng(5)
    scores = torch.from_numpy((rng.standard_normal((1, 64)) * 3).astype(np.float32))
    scores[0, 7] = 50.0  # the largest logit: every drawn token ranks below it
    params = RowParams.from_numpy(
        temperatures=np.array([1.0], np.float32), top_ks=np.array([5], np.int32), top_ps=np.array([1.0], np.float32),
        min_ps=np.array([0.0], np.float32), seeds=np.zeros(1, np.uint64), sample_positions=np.zeros(1, np.int64),
        row_to_req=np.zeros(1, np.int64), local_step=np.zeros(1, np.int64), stop_ids=np.array([stops]),
        eos_suppression_rows=np.array([True]), forced_tokens=np.array([-1]), draw_uniforms=np.array([0.6]))
    got = run_kernel(scores, params, 3, "raw")
    want = reference(scores, params, 3, "raw")
    assert int(want.rank[0]) >= 2 or stops == [-1, -1]  # the token ranks below the stop id's logit
    assert_agree(got, want, "raw rank past a suppressed stop id")


def _weights_that_add_up_to_one() -> tuple[float, float]:
    """Two processed logits below 0 whose weights, by this machine's float32 `exp`, add up
    to exactly exp(0) = 1: a top-p of 0.5 over the three then reaches its level exactly at
    the largest."""
    z2 = torch.linspace(-0.6, -0.1, 2001)
    target = 1 - torch.exp(z2)  # exact: the weights lie in [0.5, 1)
    z3 = torch.log(target)
    for candidate in (z3, torch.nextafter(z3, torch.tensor(-1.0)), torch.nextafter(z3, torch.tensor(0.0))):
        hits = torch.nonzero(torch.exp(candidate) == target).flatten()
        if len(hits):
            return float(z2[hits[0]]), float(candidate[hits[0]])
    pytest.skip("no float32 pair whose exp adds up to exactly 1 here")


def test_top_p_whose_running_mass_meets_its_level_exactly():
    """Masses 2**S (z = 0) and two more that sum to 2**S: top-p 0.5's level is the first
    token's mass, which reaches it, so the cut keeps that token alone (the radix select's
    "reaches", not "passes"); the list, settled by top-k 3, must cut there too."""
    z2, z3 = _weights_that_add_up_to_one()
    scores = torch.full((1, 64), -30.0)
    scores[0, [9, 5, 20]] = torch.tensor([0.0, z2, z3])
    masses = torch.exp(scores[0, [9, 5, 20]]) * 2.0**46  # mass_bits(64) = 46: exact, no floor needed
    assert masses[0] == masses[1] + masses[2]
    params = RowParams.from_numpy(
        temperatures=np.array([1.0], np.float32), top_ks=np.array([3], np.int32), top_ps=np.array([0.5], np.float32),
        min_ps=np.array([0.0], np.float32), seeds=np.zeros(1, np.uint64), sample_positions=np.zeros(1, np.int64),
        row_to_req=np.zeros(1, np.int64), local_step=np.zeros(1, np.int64), stop_ids=np.array([[-1, -1]]),
        eos_suppression_rows=np.array([False]), forced_tokens=np.array([-1]), draw_uniforms=np.array([0.9]))
    got = run_kernel(scores, params, 3, "processed")
    want, kept = reference_with_kept_set(scores, params, 3, "processed")
    assert torch.nonzero(kept[0]).flatten().tolist() == [9]
    assert_agree(got, want, "top-p reaching its level exactly")
