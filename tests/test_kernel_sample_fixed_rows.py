"""The sampling kernel (engine/sampling/kernels/sample.py) on fixed batches and hand-built rows,
against the same reference as tests/test_kernel_sample.py (whose module fixture gives the
interpreter torch's exp and log here too): the chunk changes no bit, flat and failed rows,
one capture-safe op on CPU and on fake CUDA, bad arguments named, cuts on ties and on
min-p's weight, the draw's block and token, stop-id suppression. Full vocabularies (flat
rows keeping tens of thousands of tokens) run with ENGINE_LONG_TESTS=1.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.sampling.kernels import sample as kernel_module
from engine.sampling.kernels.sample import SampleScratch, sample_rows
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError
from graphs.capture_safety import capture_safety_check
from profiling.fake_cuda import FakeCuda
from tests.test_kernel_sample import (LONG, assert_agree, fixed_batch, interpreter_math, pytestmark,  # noqa: F401
                                      reference, reference_with_kept_set, row_values, run_kernel, single_row)


def test_results_do_not_depend_on_the_chunk(monkeypatch):
    """Exact sums: the step a pass takes through the row changes no bit."""
    batch = fixed_batch()
    outs = []
    for chunk in (1024, 4096):
        monkeypatch.setattr(kernel_module, "_chunk", lambda vocab, device, chunk=chunk: chunk)
        outs.append(run_kernel(batch["scores"], batch["params"], 5, "processed"))
    assert_agree(outs[0], outs[1], "chunk 1024 vs 4096")
    assert_agree(outs[0], reference(batch["scores"], batch["params"], 5, "processed"), "kernel vs reference")


def test_a_flat_row_keeps_thousands_and_failed_rows_hold_the_placeholder():
    batch = fixed_batch()
    got = run_kernel(batch["scores"], batch["params"], 5, "processed")
    want, kept = reference_with_kept_set(batch["scores"], batch["params"], 5, "processed")
    assert_agree(got, want, "kernel vs reference")
    assert kept[0].sum() > 1900  # the flat row keeps most of its 2000 top-k tokens
    assert got.error.tolist() == [RowError.OK, RowError.OK, RowError.LOGITS_NOT_FINITE, RowError.OK]
    assert got.tokens[2] == PLACEHOLDER_TOKEN and got.rank[2] == 0 and (got.top_ids[2] == -1).all()


def _statics(scores, params, out, scratch) -> dict[str, torch.Tensor]:
    tensors = {f"out.{k}": v for k, v in vars(out).items()}
    tensors.update({f"params.{k}": v for k, v in vars(params).items()})
    return {**tensors, "scores": scores, "scratch.hist": scratch.hist, "scratch.block_mass": scratch.block_mass}


def test_one_capture_safe_op():
    batch = fixed_batch(vocab=300, rows_n=2)
    out, scratch = SampleOutput.allocate(2, 3), SampleScratch.allocate(2, 300, "cpu", num_top=3)
    with capture_safety_check(_statics(batch["scores"], batch["params"], out, scratch)) as stats:
        sample_rows(batch["scores"], batch["params"], out, scratch, logprobs="raw")
    assert stats.op_counts == {"engine.sample_rows.default": 1}


def test_one_op_on_the_fake_cuda_device():
    """The dry run's view: fake CUDA tensors, the capture check with the device rules; one op, no launch."""
    with FakeCuda() as cuda:
        scores = torch.zeros(4, 129280, device="cuda")
        params = RowParams.neutral(4, 4, device="cuda")
        params.draw_uniforms = torch.full((4,), 0.5, dtype=torch.float64, device="cuda")
        logits = scores.clone()
        out, scratch = SampleOutput.allocate(4, 20, "cuda"), SampleScratch.allocate(4, 129280, "cuda", num_top=20)
        with capture_safety_check({**_statics(scores, params, out, scratch), "logits": logits}, device=scores.device,
                                  is_pinned=cuda.is_pinned) as stats:
            sample_rows(scores, params, out, scratch, logits=logits, logprobs="processed")
    assert stats.op_counts == {"engine.sample_rows.default": 1}


@pytest.mark.parametrize("change, field", [
    (dict(logprobs="all"), "logprobs"),
    (dict(scores=torch.zeros(2, 300, dtype=torch.float64)), "scores"),
    (dict(scores=torch.zeros(300, 2).t()), "scores"),
    (dict(logits=torch.zeros(2, 299)), "logits"),
    (dict(uniforms=None), "draw_uniforms"),
    (dict(out=SampleOutput.allocate(2, 301)), "top-N"),
    (dict(scratch=SampleScratch.allocate(2, 5000, "cpu", num_top=3)), "scratch"),
])
def test_bad_arguments_name_the_field(change, field):
    batch = fixed_batch(vocab=300, rows_n=2)
    params = batch["params"]
    if "uniforms" in change:
        params.draw_uniforms = change.pop("uniforms")
    kw = dict(scores=batch["scores"], params=params, out=SampleOutput.allocate(2, 3),
              scratch=SampleScratch.allocate(2, 300, "cpu", num_top=3))
    kw.update(change)
    with pytest.raises(ValueError, match=field):
        sample_rows(kw.pop("scores"), kw.pop("params"), kw.pop("out"), kw.pop("scratch"), **kw)


@pytest.mark.skipif(not LONG, reason="full vocabularies under the interpreter take minutes: ENGINE_LONG_TESTS=1")
@pytest.mark.parametrize("vocab", [49152, 129280])
def test_full_vocabularies_with_flat_rows_keeping_tens_of_thousands(vocab):
    rng = np.random.default_rng(vocab)
    patterns = ("tiny", "flat", "normal", "nan", "peaked", "ties")
    plain = np.stack([row_values(rng, vocab, p) for p in patterns])
    scores = plain.copy()
    scores[2, rng.random(vocab) < 0.5] = -np.inf  # half the vocabulary masked
    rows_n = len(patterns)
    params = RowParams.from_numpy(
        temperatures=np.array([1.0, 2.0, 0.8, 1.0, 0.0, 1.3], np.float32),
        top_ks=np.array([30000, 0, 50, 0, 0, 20000], np.int32),
        top_ps=np.array([0.999, 0.9, 0.95, 1.0, 1.0, 0.7], np.float32),
        min_ps=np.array([0.0, 0.0, 0.02, 0.0, 0.0, 0.01], np.float32),
        seeds=np.arange(rows_n, dtype=np.uint64), sample_positions=np.arange(rows_n) + 1,
        row_to_req=np.arange(rows_n), local_step=np.zeros(rows_n, np.int64),
        stop_ids=np.array([[vocab - 1, 5]] * rows_n), eos_suppression_rows=np.array([True, False] * 3),
        draw_uniforms=rng.random(rows_n))
    scores, plain = torch.from_numpy(scores), torch.from_numpy(plain)
    for mode in ("raw", "processed"):
        got = run_kernel(scores, params, 20, mode, logits=plain)
        want, kept = reference_with_kept_set(scores, params, 20, mode, logits=plain)
        assert_agree(got, want, f"V={vocab} {mode}")
    assert kept[0].sum() >= 25000 and kept[1].sum() > 10000  # flat rows keeping tens of thousands


def _kept(values: list[float], **controls) -> list[int]:
    row, params = single_row(values, **controls)
    got = run_kernel(row, params, len(values), "processed")
    assert_agree(got, reference(row, params, len(values), "processed"), f"{controls}")
    # Top-N over the whole row lists every token; the kept ones have finite logprobs (a kept
    # token's mass is never 0 at these scales).
    return sorted(int(t) for t, lp in zip(got.top_ids[0], got.top_logprobs[0]) if lp > -math.inf)


def test_cuts_that_land_on_the_end_of_a_tie_and_on_a_weight_equal_to_min_p():
    row = [5.0, 1.0, 5.0, 3.0, 3.0, 3.0, 0.0, 3.0]
    assert _kept(row, top_k=2) == [0, 2]  # the 2nd token closes the tie at 5
    assert _kept(row, top_k=3) == [0, 2, 3, 4, 5, 7]  # the 3rd opens the tie at 3: all of it stays
    assert _kept(row, top_k=6) == [0, 2, 3, 4, 5, 7]
    assert _kept(row, min_p=1.0) == [0, 2]  # p >= 1 * max p: the tied maximum only
    weight_of_3 = float(torch.tensor(3.0 - 5.0).exp())  # exp(z) of the 3s, exactly: min-p keeps them
    assert _kept(row, min_p=weight_of_3) == [0, 2, 3, 4, 5, 7]
    assert _kept(row, min_p=float(np.nextafter(np.float32(weight_of_3), np.float32(1)))) == [0, 2]


def test_greedy_takes_the_smallest_id_of_the_tied_maximum_in_any_chunk(monkeypatch):
    values = [0.0] * 3000
    values[2500] = values[1100] = values[2000] = 7.0
    row, params = single_row(values, temperature=0.0)
    monkeypatch.setattr(kernel_module, "_chunk", lambda vocab, device: 1024)
    assert run_kernel(row, params, 0, None).tokens.tolist() == [1100]
    # Split over 3 programs (one chunk each): the parts merge in order, the first part holding M wins.
    assert run_kernel(row, params, 0, None, programs=3).tokens.tolist() == [1100]


def test_the_draw_lands_in_the_block_and_token_its_uniform_names():
    """Four blocks of equal mass, one heavy token in each: u picks the block, then the token."""
    values = [-30.0] * 4096
    for block in range(4):
        values[block * 1024 + 7 * block + 3] = 0.0
    for block, u in enumerate((0.1, 0.3, 0.6, 0.9)):
        row, params = single_row(values, u=u)
        got = run_kernel(row, params, 0, None)
        assert got.tokens.tolist() == [block * 1024 + 7 * block + 3]
        assert_agree(got, reference(row, params, 0, None), f"u={u}", logprobs=False)


@pytest.mark.parametrize("suppress", [False, True])
def test_a_stop_id_is_suppressed_only_on_a_row_flagged_for_it(suppress):
    """The largest logit is a stop id: greedy takes it unless the row's EOS suppression is on;
    a padding slot (-1) never suppresses token 0."""
    row = torch.tensor([[2.0, 1.0, 5.0, 4.0]])
    params = RowParams.from_numpy(
        temperatures=np.zeros(1, np.float32), top_ks=np.zeros(1, np.int32), top_ps=np.ones(1, np.float32),
        min_ps=np.zeros(1, np.float32), seeds=np.zeros(1, np.uint64), sample_positions=np.zeros(1, np.int64),
        row_to_req=np.zeros(1, np.int64), local_step=np.zeros(1, np.int64), stop_ids=np.array([[2, -1]]),
        eos_suppression_rows=np.array([suppress]), draw_uniforms=np.array([0.5]))
    got = run_kernel(row, params, 2, "processed")
    assert got.tokens.tolist() == ([3] if suppress else [2])
    assert_agree(got, reference(row, params, 2, "processed"), f"suppress={suppress}")


def test_two_scores_that_share_z_are_one_tie():
    """z = (s - M) / T rounds twice, as the torch ops do: at T = 1.7 these two scores, one
    ulp apart, divide to the same z, so top-k = 2 keeps both (s / T - M / T would split them)."""
    row = [3.4100701808929443, 1.42018461227417, 1.4201844930648804, 0.0]
    assert _kept(row, temperature=1.7, top_k=2) == [0, 1, 2]


@pytest.mark.parametrize("shift", [-20.0, -200.0])
@pytest.mark.parametrize("separate", [False, True], ids=["scores are the logits", "logits given"])
def test_raw_logprobs_of_a_row_whose_logits_are_all_negative(shift, separate):
    """The raw normaliser shifts by the logits' maximum: a pass's lanes past the row (V = 300
    in chunks of 512) must not count as a logit of 0. At -200 a shift of 0 would leave every
    mass 0 and the logprob +inf."""
    rng = np.random.default_rng(11)
    row, params = single_row((shift - np.abs(rng.standard_normal(300))).astype(np.float32).tolist(), top_k=5)
    got = run_kernel(row, params, 3, "raw", **(dict(logits=row.clone()) if separate else {}))
    want = reference(row, params, 3, "raw")
    assert got.logprob.isfinite().all(), got.logprob
    assert_agree(got, want, f"max {shift}")
