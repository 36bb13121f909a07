"""Prompt logprobs against a float64 full log-softmax reference that walks the
SeqMeta list itself (docs/contract.md §1.1), across interleaved 3-chunk prefills.

Hidden states and weights are small integers, so every GEMM (fp32 or bf16) is
exact and logits tie often: ranks and tie-broken top-N lists compare exactly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.step.prompt_logprobs as prompt_logprobs_module
from engine import SamplingParams, SeqMeta, prepare_sampler_inputs
from engine.sampling.row_params import RowParams
from engine.sampling.sampler import SamplerConfig, sample
from engine.step.prompt_logprobs import (
    DEFAULT_CHUNK_ROWS,
    PromptLogprob,
    PromptLogprobAccumulator,
    compute_prompt_logprobs,
    prompt_row_logprobs,
)

HIDDEN, VOCAB = 6, 50


def reference_row(logits: np.ndarray, target: int, num_top: int, k: int) -> PromptLogprob:
    """One row by the definitions: float64 log-softmax over the whole vocabulary
    or over the tie-inclusive top-k, rank over the whole vocabulary."""
    logits = logits.astype(np.float64)
    kept = np.ones(len(logits), dtype=bool)
    if k > 0:
        kth = np.sort(logits)[::-1][min(k, len(logits)) - 1]
        kept = logits >= kth
    log_norm = np.log(np.sum(np.exp(logits[kept] - logits.max()))) + logits.max()
    logprobs = np.where(kept, logits - log_norm, -np.inf)
    rank = 1 + int(np.sum(logits > logits[target]))
    order = sorted(range(len(logits)), key=lambda t: (-logits[t], t))[:num_top]
    return PromptLogprob(target, float(logprobs[target]), rank, tuple((t, float(logprobs[t])) for t in order))


def reference_step(seqs, hidden, weight, partial, top_k_of=None):
    """Per request: None / [] / the full list, from the SeqMeta fields alone."""
    logits_all = hidden.double().numpy() @ weight.double().numpy().T  # [rows, vocab], exact
    handed_over, out_offset = [], 0
    for seq in seqs:
        n_top = seq.params.num_prompt_logprobs
        if seq.is_prompt and n_top >= 0:
            last = seq.seqlen_k == seq.prompt_len
            if seq.seqlen_k == seq.seqlen_q:
                partial[seq.request_id] = []
            k = 0 if top_k_of is None else top_k_of[seq.request_id]
            for j in range(seq.seqlen_q - (1 if last else 0)):
                target = seq.prompt_tokens[seq.seqlen_k - seq.seqlen_q + j + 1]
                partial[seq.request_id].append(reference_row(logits_all[out_offset + j], target, n_top, k))
            handed_over.append(partial.pop(seq.request_id) if last else [])
        else:
            handed_over.append(None)
        out_offset += seq.seqlen_q
    return handed_over


def assert_same(got, want):
    assert (got is None) == (want is None)
    if want is None:
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token == w.token and g.rank == w.rank
        assert math.isclose(g.logprob, w.logprob, abs_tol=1e-5) or g.logprob == w.logprob == -math.inf
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-5)


PROMPTS = {  # request -> (prompt length, chunk sizes, prompt_logprobs)
    "a": (20, (7, 7, 6), 3),
    "b": (9, (3, 3, 3), False),
    "c": (1, (1,), True),
    "d": (12, (5, 4, 3), True),
    "e": (6, (2, 2, 2), VOCAB + 10),  # more alternatives than the vocabulary has
}
# Batch order per step: requests interleave and change places; "f" is decoding.
STEPS = [["a", "b", "d", "f"], ["b", "c", "a", "e", "f"], ["f", "d", "a", "e"], ["b", "d", "e"]]


def chunked_prefill_steps(rng: np.random.Generator) -> list[list[SeqMeta]]:
    tokens = {r: [int(t) for t in rng.integers(0, VOCAB, length)] for r, (length, _, _) in PROMPTS.items()}
    done = dict.fromkeys(PROMPTS, 0)
    chunk_no = dict.fromkeys(PROMPTS, 0)
    steps = []
    for order in STEPS:
        seqs = []
        for r in order:
            if r == "f":
                params = SamplingParams(prompt_logprobs=2)
                seqs.append(SeqMeta("f", False, 1, 9, 4, [1, 2, 3, 4], 5, params))
                continue
            length, chunks, wanted = PROMPTS[r]
            q = chunks[chunk_no[r]]
            chunk_no[r] += 1
            done[r] += q
            seqs.append(SeqMeta(r, True, q, done[r], length, tokens[r], 0, SamplingParams(prompt_logprobs=wanted)))
        steps.append(seqs)
    assert all(chunk_no[r] == len(PROMPTS[r][1]) for r in PROMPTS)
    return steps


def integer_tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(rng.integers(-2, 3, shape).astype(np.float32)).to(dtype)


@pytest.mark.parametrize("chunk_rows", [1, 7, DEFAULT_CHUNK_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k_space", [False, True])
def test_matches_full_log_softmax_across_chunked_prefills(chunk_rows, dtype, top_k_space):
    rng = np.random.default_rng(chunk_rows)
    weight = integer_tensor(rng, (VOCAB, HIDDEN), dtype)
    top_k_of = {"a": 5, "b": 3, "c": 1, "d": 0, "e": VOCAB + 1, "f": 2} if top_k_space else None
    accumulator = PromptLogprobAccumulator()
    partial: dict = {}
    handed_over = {}
    for seqs in chunked_prefill_steps(rng):
        inputs = prepare_sampler_inputs(seqs)
        hidden = integer_tensor(rng, (inputs.num_output_rows, HIDDEN), dtype)
        top_k = None if top_k_of is None else np.array([top_k_of[s.request_id] for s in seqs])
        results = compute_prompt_logprobs(
            hidden, weight, inputs, top_k=top_k, chunk_rows=chunk_rows, batch_invariant=chunk_rows == 7
        )
        got = accumulator.add(inputs, results)
        want = reference_step(seqs, hidden, weight, partial, top_k_of)
        for seq, g, w in zip(seqs, got, want):
            assert_same(g, w)
            if g:
                handed_over[seq.request_id] = g
    assert accumulator.pending == ()
    # Over all chunks a prompt of length L yields L - 1 values, each once.
    assert {r: len(v) for r, v in handed_over.items()} == {"a": 19, "d": 11, "e": 5}
    if top_k_space:  # some targets must fall outside their top-k, or the mode is untested
        assert any(p.logprob == -math.inf for p in handed_over["a"])


def test_none_versus_empty():
    rng = np.random.default_rng(0)
    weight = integer_tensor(rng, (VOCAB, HIDDEN), torch.float32)
    accumulator = PromptLogprobAccumulator()
    seen = []
    for seqs in chunked_prefill_steps(rng):
        inputs = prepare_sampler_inputs(seqs)
        hidden = integer_tensor(rng, (inputs.num_output_rows, HIDDEN), torch.float32)
        got = accumulator.add(inputs, compute_prompt_logprobs(hidden, weight, inputs))
        seen.append({s.request_id: (None if g is None else len(g)) for s, g in zip(seqs, got)})
    assert seen == [
        {"a": 0, "b": None, "d": 0, "f": None},  # first chunks: asked, nothing yet
        {"b": None, "c": 0, "a": 0, "e": 0, "f": None},  # c: a one-token prompt is complete and empty
        {"f": None, "d": 0, "a": 19, "e": 0},
        {"b": None, "d": 11, "e": 5},
    ]


def test_no_prompt_rows_at_all():
    seqs = [SeqMeta("x", True, 4, 4, 4, [1, 2, 3, 4]), SeqMeta("y", False, 1, 6, 4, [1, 2, 3, 4], 2)]
    inputs = prepare_sampler_inputs(seqs)
    results = compute_prompt_logprobs(torch.zeros(5, HIDDEN), torch.zeros(VOCAB, HIDDEN), inputs)
    assert len(results.targets) == 0
    assert PromptLogprobAccumulator().add(inputs, results) == [None, None]


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 30),
    num_rows=st.integers(0, 25),
    chunk_rows=st.integers(1, 9),
    top_k_space=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_row_logprobs_match_reference(vocab, num_rows, chunk_rows, top_k_space, seed):
    """Identity weight, so each hidden row is its logits row: small-integer
    logits with many ties, per-row top-N and per-row k."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 4, (num_rows + 3, vocab)).astype(np.float32)
    rows = rng.integers(0, num_rows + 3, num_rows).astype(np.int32)
    targets = rng.integers(0, vocab, num_rows).astype(np.int32)
    num_top = rng.integers(0, vocab + 3, num_rows).astype(np.int32)
    row_top_k = rng.integers(0, vocab + 2, num_rows) if top_k_space else None
    got = prompt_row_logprobs(
        torch.from_numpy(logits), torch.eye(vocab), rows, targets, num_top, row_top_k=row_top_k, chunk_rows=chunk_rows
    )
    for r in range(num_rows):
        k = 0 if row_top_k is None else int(row_top_k[r])
        assert_same(got.entries(r, r + 1), [reference_row(logits[rows[r]], int(targets[r]), int(num_top[r]), k)])


def test_top_n_ties_go_to_the_smaller_id_and_rank_counts_strictly_larger():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    got = prompt_row_logprobs(logits, torch.eye(7), np.array([0]), np.array([4]), np.array([4])).entries(0, 1)[0]
    assert got.rank == 3  # two tokens (ids 1 and 3) have a larger logit; ids 2 and 5 tie with it
    assert [t for t, _ in got.top] == [1, 3, 2, 4]


def test_peak_logits_never_exceed_chunk_rows(monkeypatch):
    shapes = []
    real_get_logits = prompt_logprobs_module.get_logits

    def recording_get_logits(hidden, weight, **kw):
        shapes.append(tuple(hidden.shape))
        return real_get_logits(hidden, weight, **kw)

    monkeypatch.setattr(prompt_logprobs_module, "get_logits", recording_get_logits)
    seqs = [SeqMeta("long", True, 30, 30, 30, list(range(30)), params=SamplingParams(prompt_logprobs=True))]
    inputs = prepare_sampler_inputs(seqs)
    compute_prompt_logprobs(torch.randn(30, HIDDEN), torch.randn(VOCAB, HIDDEN), inputs, chunk_rows=8)
    assert [rows for rows, _ in shapes] == [8, 8, 8, 5]


def test_skipped_chunk_raises_and_leaves_state_alone():
    rng = np.random.default_rng(1)
    weight = integer_tensor(rng, (VOCAB, HIDDEN), torch.float32)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 9)]
    params = SamplingParams(prompt_logprobs=True)
    accumulator = PromptLogprobAccumulator()

    def run(seqs):
        inputs = prepare_sampler_inputs(seqs)
        hidden = integer_tensor(rng, (inputs.num_output_rows, HIDDEN), torch.float32)
        return accumulator.add(inputs, compute_prompt_logprobs(hidden, weight, inputs))

    run([SeqMeta("p", True, 3, 3, 9, tokens, params=params)])
    other = SeqMeta("q", True, 2, 2, 9, tokens, params=params)
    with pytest.raises(ValueError, match="request 'p'.*starts at position 6 but 3"):
        run([other, SeqMeta("p", True, 3, 9, 9, tokens, params=params)])
    assert accumulator.pending == ("p",)
    assert run([SeqMeta("p", True, 3, 6, 9, tokens, params=params)]) == [[]]
    accumulator.discard("p")
    assert accumulator.pending == ()


def test_bad_inputs_name_the_request_and_value():
    params = SamplingParams(prompt_logprobs=True)
    seqs = [
        SeqMeta("ok", True, 2, 2, 2, [1, 2], params=params),
        SeqMeta("big", True, 2, 2, 2, [1, VOCAB + 4], params=params),
    ]
    inputs = prepare_sampler_inputs(seqs)
    hidden, weight = torch.zeros(4, HIDDEN), torch.zeros(VOCAB, HIDDEN)
    with pytest.raises(ValueError, match=f"request 'big': prompt token {VOCAB + 4} is outside the vocabulary"):
        compute_prompt_logprobs(hidden, weight, inputs)
    inputs = prepare_sampler_inputs(seqs[:1])
    with pytest.raises(ValueError, match="top_k: shape"):
        compute_prompt_logprobs(hidden[:2], weight, inputs, top_k=np.array([1, 2]))
    with pytest.raises(ValueError, match="request 'ok': top_k=-1"):
        compute_prompt_logprobs(hidden[:2], weight, inputs, top_k=np.array([-1]))
    with pytest.raises(ValueError, match="chunk_rows=0"):
        compute_prompt_logprobs(hidden[:2], weight, inputs, chunk_rows=0)


def test_chunk_at_position_zero_restarts_a_preempted_prompt():
    rng = np.random.default_rng(2)
    weight = integer_tensor(rng, (VOCAB, HIDDEN), torch.float32)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 5)]
    params = SamplingParams(prompt_logprobs=True)
    accumulator = PromptLogprobAccumulator()
    partial: dict = {}
    chunks = [
        SeqMeta("p", True, 3, 3, 5, tokens, params=params),  # preempted after this chunk
        SeqMeta("p", True, 2, 2, 5, tokens, params=params),  # recomputed from position 0
        SeqMeta("p", True, 3, 5, 5, tokens, params=params),
    ]
    for seq in chunks:
        inputs = prepare_sampler_inputs([seq])
        hidden = integer_tensor(rng, (inputs.num_output_rows, HIDDEN), torch.float32)
        got = accumulator.add(inputs, compute_prompt_logprobs(hidden, weight, inputs))
        want = reference_step([seq], hidden, weight, partial)
        assert_same(got[0], want[0])
    assert len(got[0]) == 4


def test_a_prompt_token_scores_exactly_as_a_sampled_one():
    """Prompt logprobs use the sampler's raw-logprob code: the logprob, rank and
    top-N of a prompt token equal, bit for bit, what the sampler reports when it
    emits that token (forced) from the same logits row. V = 3000 spans three
    normaliser blocks; the identity head makes each hidden row its logits row."""
    rows, vocab, num_top = 24, 3000, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    targets = torch.randint(0, vocab, (rows,), generator=gen).numpy()
    got = prompt_row_logprobs(logits, torch.eye(vocab), np.arange(rows), targets, np.full(rows, num_top))
    params = RowParams.from_numpy(
        temperatures=np.ones(rows, np.float32), top_ks=np.zeros(rows, np.int32), top_ps=np.ones(rows, np.float32),
        min_ps=np.zeros(rows, np.float32), seeds=np.arange(rows, dtype=np.uint64), sample_positions=np.zeros(rows, np.int64),
        row_to_req=np.arange(rows), local_step=np.zeros(rows, np.int64), forced_tokens=targets,
    )
    out = sample(logits, params, SamplerConfig(candidate_cap=64, max_logprobs=num_top))
    assert out.tokens.tolist() == targets.tolist()
    assert np.array_equal(got.logprobs, out.logprob.numpy())
    assert np.array_equal(got.ranks, out.rank.numpy())
    assert np.array_equal(got.top_ids, out.top_ids.numpy())
    assert np.array_equal(got.top_logprobs, out.top_logprobs.numpy())
