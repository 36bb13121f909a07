"""The step engine never crashes and never corrupts (issue 11, engine side).

- A row whose hidden state or logits are not finite, or whose controls leave
  no token, fails only its own request (docs/contract.md §2): the request
  emits nothing and `StepOutput.errors` names it; every other request is
  bit-identical to the same batch without the poison.
- Bad input is a ValueError naming the request, the field and the value,
  raised before any state is touched (docs/contract.md §6).
- A step that raises leaves the engine as before: the next step gives what an
  uninterrupted run gives.

The oracle of the poisoned-batch property is the same engine on the clean
batch; which requests must fail is worked out here from the row layout of
docs/contract.md §1, with no engine code.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.step.lm_head as lm_head_module
import tests.test_parallel as parallel
from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.parallel import sharded_head, vocab_shards
from engine.sampling.exact import sample_exact, sample_reference
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError, SamplerConfig, sample

VOCAB, HIDDEN, MAX_REQS, MAX_DRAFTS = 300, 24, 8, 2
EOS = VOCAB - 1
NON_FINITE = (math.nan, math.inf, -math.inf)
OVERFLOW = 3e38  # a finite hidden value whose logits overflow to +-inf
POISONS = (*NON_FINITE, OVERFLOW)


def _weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def _config(**kw) -> EngineConfig:
    # candidate_cap 64 < top_k 100 / 250: such rows take the eager exact path.
    base = dict(max_num_reqs=MAX_REQS, max_draft_tokens=MAX_DRAFTS, draft_pool_slots=32, eos_token_id=EOS,
                device="cpu", sampler=SamplerConfig(candidate_cap=64, max_logprobs=5), sampler_variants=True)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def engines() -> dict[str, StepEngine]:
    w = _weight()
    built = {
        "strict": StepEngine(w, _config()),
        "eager": StepEngine(w, _config(use_graphs=False)),
        "rejection": StepEngine(w, _config(verify_mode="rejection")),
    }
    built["strict"].capture()
    built["rejection"].capture()
    return built


def _batch(rng: np.random.Generator, n: int, *, draft_logprobs: bool = False):
    """n requests: whole prompts and first chunks (prompt logprobs on and off),
    decodes verifying 0..2 drafts; greedy, plain, small and large top-k."""
    seqs, drafts, qs = [], [], []
    for i in range(n):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.8, 1.0])),
            top_k=int(rng.choice([0, 3, 100, 250])),
            top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.1])),
            seed=int(rng.integers(2**63)),
            logprobs=[None, 0, 3][int(rng.integers(3))],
            min_tokens=int(rng.choice([0, 2])),
            prompt_logprobs=[False, True, 2][int(rng.integers(3))],
        )
        prompt_len = int(rng.integers(1, 9))
        tokens = rng.integers(0, VOCAB, prompt_len)
        if rng.random() < 0.5:
            # A chunk that starts the prompt: whole (last chunk) or not.
            k = int(rng.integers(1, prompt_len + 1))
            seqs.append(SeqMeta(f"r{i}", True, k, k, prompt_len, prompt_tokens=tokens, params=params))
            drafts.append(None)
            qs.append(None)
        else:
            k = int(rng.integers(MAX_DRAFTS + 1))
            gen = int(rng.integers(1, 6))
            seqs.append(SeqMeta(f"r{i}", False, 1 + k, prompt_len + gen + k, prompt_len, prompt_tokens=tokens,
                                num_generated=gen, params=SamplingParams(**{**vars(params), "prompt_logprobs": False}),
                                mtp_write_slot=i + 1))
            drafts.append(rng.integers(0, VOCAB, k).tolist())
            q = torch.log_softmax(torch.as_tensor(rng.normal(size=(k, VOCAB)), dtype=torch.float32) * 3, -1)
            qs.append(q if draft_logprobs and k and rng.random() < 0.7 else None)
    hidden = torch.as_tensor(rng.normal(size=(sum(s.seqlen_q for s in seqs), HIDDEN)), dtype=torch.float32)
    return seqs, hidden, drafts, qs


def _rows_read(seqs: list[SeqMeta]) -> list[set[int]]:
    """Per request, the model-output rows the step reads (contract §1): a
    prompt chunk's last row and, with prompt logprobs, its prompt rows (one
    short on the last chunk); every row of a decode."""
    read, offset = [], 0
    for s in seqs:
        if s.is_prompt:
            rows = {offset + s.seqlen_q - 1}
            if s.params.prompt_logprobs not in (False, None):
                last = s.seqlen_k == s.prompt_len
                rows |= {offset + j for j in range(s.seqlen_q - (1 if last else 0))}
        else:
            rows = set(range(offset, offset + s.seqlen_q))
        read.append(rows)
        offset += s.seqlen_q
    return read


def _fields(out) -> tuple:
    return (out.tokens, out.logprobs, out.prompt_logprobs, out.seeds, out.num_accepted, out.errors)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, MAX_REQS + 2), mode=st.sampled_from(["strict", "rejection"]))
def test_a_poisoned_row_fails_only_its_own_request(engines, seed, n, mode):
    """NaN / +inf / -inf in random hidden rows (whole rows or one element),
    drafts, prompt logprobs, large top_k, above the largest bucket: the
    requests that read a poisoned row fail and emit nothing; every other
    request is bit-identical to the clean batch; replay equals eager."""
    rng = np.random.default_rng(seed)
    seqs, hidden, drafts, qs = _batch(rng, n, draft_logprobs=mode == "rejection")
    poisoned = hidden.clone()
    bad_rows = rng.choice(len(hidden), size=int(rng.integers(1, min(3, len(hidden)) + 1)), replace=False)
    for r in bad_rows:
        value = POISONS[int(rng.integers(len(POISONS)))]
        if rng.random() < 0.5:
            poisoned[r] = value
        else:
            poisoned[r, int(rng.integers(HIDDEN))] = value
    failing = {i for i, rows in enumerate(_rows_read(seqs)) if rows & set(bad_rows.tolist())}

    engine = engines[mode]
    extra = {"draft_logprobs": qs} if mode == "rejection" else {}
    before = engine.checkpoint()
    dirty = engine.step(poisoned, seqs, drafts, **extra)
    pending_dirty = set(engine.prompt_logprobs.pending)
    engine.rollback(before)
    clean = engine.step(hidden, seqs, drafts, **extra)
    pending_clean = set(engine.prompt_logprobs.pending)
    engine.rollback(before)

    for i, s in enumerate(seqs):
        if i in failing:
            assert dirty.errors[i] is not None and dirty.errors[i].startswith(f"request {s.request_id!r}: ")
            assert "\n" not in dirty.errors[i]
            assert dirty.tokens[i] == [] and dirty.num_accepted[i] == 0
            assert dirty.logprobs[i] == ([] if s.params.logprobs is not None else None)
            assert dirty.prompt_logprobs[i] is None
            assert s.request_id not in pending_dirty
        else:
            assert dirty.errors[i] is None and clean.errors[i] is None
            for got, want in zip(_fields(dirty), _fields(clean)):
                assert got[i] == want[i]
            assert (s.request_id in pending_dirty) == (s.request_id in pending_clean)
    if mode == "strict":
        eager = engines["eager"]
        before = eager.checkpoint()
        assert _fields(eager.step(poisoned, seqs, drafts)) == _fields(dirty)
        eager.rollback(before)


def _tiny_engine(vocab: int, **sampler) -> StepEngine:
    """Stop ids (EOS 0 plus 1..vocab-1) can cover the whole vocabulary."""
    w = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(1))
    return StepEngine(w, EngineConfig(max_num_reqs=4, eos_token_id=0, max_stop_ids=vocab, device="cpu",
                                      sampler=SamplerConfig(**sampler), sampler_variants=False))


@pytest.mark.parametrize("vocab, sampler", [(8, {"max_logprobs": 2}), (16, {"candidate_cap": 4, "max_logprobs": 2})],
                         ids=["no-tail", "exact-path"])
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (0.7, 3)])
def test_stop_ids_covering_the_vocabulary_under_min_tokens_fail_the_request(vocab, sampler, temperature, top_k):
    engine = _tiny_engine(vocab, **sampler)
    engine.capture()
    stops = tuple(range(1, vocab))
    covered = SamplingParams(temperature=temperature, top_k=top_k, seed=3, min_tokens=3, stop_token_ids=stops, logprobs=1)
    free = SamplingParams(temperature=temperature, top_k=top_k, seed=4, logprobs=1)
    seqs = [SeqMeta("bystander", False, 1, 6, 4, num_generated=2, params=free),
            SeqMeta("covered", False, 1, 6, 4, num_generated=2, params=covered)]
    hidden = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(2))
    out = engine.step(hidden, seqs)
    assert out.errors == [None, "request 'covered': no token left after the sampling controls (EOS/stop suppression)"]
    assert out.tokens[1] == [] and out.logprobs[1] == []
    alone = engine.step(hidden[:1], seqs[:1])
    assert out.tokens[0] == alone.tokens[0] and out.logprobs[0] == alone.logprobs[0]
    # Past min_tokens the same stop set suppresses nothing.
    later = SeqMeta("covered", False, 1, 8, 4, num_generated=4, params=covered)
    assert engine.step(hidden[1:], [later]).errors == [None]


def test_all_logits_infinite_with_top_k_fails_the_request(engines):
    engine = engines["strict"]
    seqs = [SeqMeta(f"r{i}", False, 1, 5, 4, num_generated=1, params=SamplingParams(top_k=t, seed=i, logprobs=2),
                    mtp_write_slot=i + 1) for i, t in enumerate((5, 250, 0))]
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    clean = engine.step(hidden, seqs)
    for value in POISONS:
        for bad in range(3):
            poisoned = hidden.clone()
            poisoned[bad] = value
            out = engine.step(poisoned, seqs)
            cause = "logits row not finite (NaN or inf)" if value == OVERFLOW else "hidden state not finite"
            assert out.errors[bad] == f"request 'r{bad}': {cause}"
            for i in set(range(3)) - {bad}:
                assert out.errors[i] is None
                assert out.tokens[i] == clean.tokens[i] and out.logprobs[i] == clean.logprobs[i]


def test_non_finite_prompt_logprob_row_fails_the_request_and_drops_its_partial_values(engines):
    engine = engines["strict"]
    tokens = np.arange(10, 22)
    p = SamplingParams(temperature=0, prompt_logprobs=2)
    first = [SeqMeta("a", True, 4, 4, 12, tokens, params=p), SeqMeta("b", True, 4, 4, 12, tokens, params=p)]
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(6))
    before = engine.checkpoint()
    clean = engine.step(hidden, first)
    engine.rollback(before)
    poisoned = hidden.clone()
    poisoned[1, 3] = math.nan  # row 1 of "a": the logprob of prompt token 2
    out = engine.step(poisoned, first)
    assert out.errors == ["request 'a': prompt logprobs not finite at prompt position 2", None]
    assert out.prompt_logprobs == [None, clean.prompt_logprobs[1]]
    assert engine.prompt_logprobs.pending == ("b",)
    engine.rollback(before)


def test_sampler_flags_non_finite_and_empty_rows_with_a_placeholder():
    """The sampler alone: failed rows get the placeholder (in the vocabulary,
    finite logprobs), are never sent to the exact path, and the exact path and
    the reference do not crash on them; the other rows are what they are alone."""
    vocab, rows = 300, 7
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3
    logits[1] = math.nan
    logits[2, 17] = math.inf
    logits[3] = -math.inf
    logits[4, 5] = -math.inf
    logits[5, :] = math.inf
    good = [0, 6]
    cfg = SamplerConfig(candidate_cap=32, max_logprobs=4)
    params = RowParams.from_numpy(
        temperatures=np.array([1.0, 0.0, 1.0, 0.7, 1.0, 0.0, 0.9], np.float32),
        top_ks=np.array([250, 0, 200, 5, 0, 0, 280], np.int32), top_ps=np.ones(rows, np.float32),
        min_ps=np.zeros(rows, np.float32), seeds=np.arange(rows, dtype=np.uint64),
        sample_positions=np.full(rows, 3, np.int64), row_to_req=np.arange(rows), local_step=np.zeros(rows, np.int64))
    out = sample(logits, params, cfg)
    assert out.error.tolist() == [0, 1, 1, 1, 1, 1, 0]
    failed = out.error != RowError.OK
    assert (out.tokens[failed] == PLACEHOLDER_TOKEN).all()
    assert (out.top_ids[failed] == -1).all() and (out.rank[failed] == 0).all()
    assert torch.isfinite(out.logprob).all() and torch.isfinite(out.top_logprobs).all()
    sample_exact(logits, params, cfg, torch.ones(rows, dtype=torch.bool), out)
    assert out.error.tolist() == [0, 1, 1, 1, 1, 1, 0]
    assert torch.isfinite(out.logprob).all() and (out.tokens[failed] == PLACEHOLDER_TOKEN).all()
    ref = sample_reference(logits, params, cfg, num_top=4)
    assert ref.error.tolist() == out.error.tolist()
    alone = sample_reference(logits[good], params.rows(good), cfg, num_top=4)
    assert torch.equal(ref.tokens[good], alone.tokens) and torch.equal(ref.logprob[good], alone.logprob)


# -- inputs ---------------------------------------------------------------------


def _state(engine: StepEngine) -> tuple:
    b = engine.buffers
    tensors = [b.staging, b.packed, b.source, b.pool_tokens, b.pool_logprobs, b.logits, *vars(b.out).values()]
    return ([t.clone() for t in tensors], copy.deepcopy(engine.stats), engine.prompt_logprobs.snapshot(),
            engine.replayer.counts())


def _assert_same_state(a: tuple, b: tuple) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1:] == b[1:]


DECODE = SeqMeta("d", False, 2, 7, 4, num_generated=2, params=SamplingParams(seed=1), mtp_write_slot=1)
GOOD = SeqMeta("g", False, 1, 6, 4, num_generated=2, params=SamplingParams(seed=2), mtp_write_slot=2)


@pytest.mark.parametrize("engine_name, call, match", [
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [1.5]]), r"request 'd': draft_tokens=\[1\.5\]"),
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, ["7"]]), r"request 'd': draft_tokens=\['7'\]"),
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [True]]), r"request 'd': draft_tokens=\[True\]"),
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], np.array([[0.0, 0.0], [2.5, 0.0]])),
     r"request 'd': draft_tokens.*float64"),
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN).to(torch.int64), [GOOD, DECODE]), r"hidden_states: dtype torch\.int64"),
    ("strict", lambda e: e.step(torch.ones(3, HIDDEN, dtype=torch.bool), [GOOD, DECODE]), r"hidden_states: dtype torch\.bool"),
    ("strict", lambda e: e.step(torch.randn(3, HIDDEN, dtype=torch.complex64), [GOOD, DECODE]),
     r"hidden_states: dtype torch\.complex64"),
    ("strict", lambda e: e.step(np.zeros((3, HIDDEN), np.float32), [GOOD, DECODE]), r"hidden_states: .*ndarray"),
    ("rejection", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [4]],
                                   [None, torch.full((1, VOCAB), math.nan)]), r"request 'd': draft_logprobs.*nan"),
    ("rejection", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [4]],
                                   [None, torch.zeros(1, VOCAB)]), r"request 'd': draft_logprobs\[0\].*sum to 300"),
    ("rejection", lambda e: e.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [4]],
                                   [None, torch.full((1, VOCAB), math.inf)]), r"request 'd': draft_logprobs.*inf"),
])
def test_bad_input_is_refused_before_any_state_is_touched(engines, engine_name, call, match):
    engine = engines[engine_name]
    engine.step(torch.randn(3, HIDDEN), [GOOD, DECODE], [None, [5]])  # leave something in every buffer
    before = _state(engine)
    with pytest.raises(ValueError, match=match):
        call(engine)
    _assert_same_state(before, _state(engine))


@pytest.mark.parametrize("build, match", [
    (lambda: SeqMeta("d", False, 1, 10, 4, num_generated=2), r"request 'd': seqlen_k=10: .*prompt_len \+ num_generated \+ drafts = 4 \+ 2 \+ 0 = 6"),
    (lambda: SeqMeta("d", False, 3, 8, 4, num_generated=3), r"request 'd': seqlen_k=8: .*= 9"),
    (lambda: SeqMeta("p", True, 2, 2, 2, [1, 2**63]), r"request 'p': prompt_tokens\[1\]=9223372036854775808"),
    (lambda: SeqMeta("p", True, 2, 2, 2, [1, 2.0]), r"request 'p': prompt_tokens\[1\]=2\.0"),
    (lambda: SamplingParams(stop_token_ids=5), r"stop_token_ids=5: "),
    (lambda: SamplingParams(stop_token_ids="12"), r"stop_token_ids='12': "),
    (lambda: StepEngine(torch.zeros(8, 4, dtype=torch.int64)), r"lm_head_weight: dtype torch\.int64"),
    (lambda: StepEngine(np.zeros((8, 4), np.float32)), r"lm_head_weight: .*ndarray"),
])
def test_inconsistent_or_unclear_inputs_are_value_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_an_empty_batch_returns_an_empty_output_and_bumps_no_stats(engines):
    engine = engines["strict"]
    before = _state(engine)
    out = engine.step(torch.randn(0, HIDDEN), [])
    assert (out.request_ids, out.tokens, out.logprobs, out.prompt_logprobs, out.seeds, out.num_accepted, out.errors) == (
        (), [], [], [], [], [], [])
    _assert_same_state(before, _state(engine))


def test_autograd_inputs_just_work_and_record_nothing():
    """Hidden states that require grad (an nn.Linear's output) and an
    nn.Parameter LM head: same results as detached ones, nothing recorded,
    static buffers never require grad, later steps still work."""
    w = _weight()
    plain = StepEngine(w.clone(), _config())
    grad = StepEngine(torch.nn.Parameter(w.clone()), _config())
    plain.capture()
    grad.capture()
    linear = torch.nn.Linear(HIDDEN, HIDDEN)
    tokens = np.arange(6)
    seqs = [SeqMeta("p", True, 6, 6, 6, tokens, params=SamplingParams(prompt_logprobs=1, logprobs=1, seed=3)), GOOD]
    hidden = linear(torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(8)))
    assert hidden.requires_grad
    for _ in range(2):
        got = grad.step(hidden, seqs)
        assert _fields(got) == _fields(plain.step(hidden.detach(), seqs))
    assert not any(t.requires_grad for t in grad.buffers.static_tensors().values())
    assert not grad.weight.requires_grad


# -- atomicity ------------------------------------------------------------------


PROMPT = np.arange(30, 42)  # 12 tokens in chunks of 4
WITH_LP = SamplingParams(temperature=0, prompt_logprobs=1)


def _chunk(start: int, request_id: str = "p") -> SeqMeta:
    return SeqMeta(request_id, True, 4, start + 4, 12, PROMPT, params=WITH_LP)


def _chunk_hidden(start: int) -> torch.Tensor:
    return torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(100 + start))


def _uninterrupted(engine_config: EngineConfig) -> list:
    engine = StepEngine(_weight(), engine_config)
    return [_fields(engine.step(_chunk_hidden(s), [_chunk(s), _chunk(s, "q")])) for s in (0, 4, 8)]


def test_a_skipped_prompt_chunk_is_refused_before_the_step_and_leaves_nothing_behind():
    config = _config(use_graphs=False)
    want = _uninterrupted(config)
    engine = StepEngine(_weight(), config)
    assert _fields(engine.step(_chunk_hidden(0), [_chunk(0), _chunk(0, "q")])) == want[0]
    before = _state(engine)
    with pytest.raises(ValueError, match=r"request 'p': prompt chunk starts at position 8 but 4 prompt logprobs"):
        engine.step(_chunk_hidden(8), [_chunk(8), _chunk(4, "q")])
    _assert_same_state(before, _state(engine))
    got = [_fields(engine.step(_chunk_hidden(s), [_chunk(s), _chunk(s, "q")])) for s in (4, 8)]
    assert got == want[1:]


def test_an_exception_inside_a_step_leaves_stats_and_partial_prompt_logprobs_as_before(monkeypatch):
    config = _config(use_graphs=False)
    want = _uninterrupted(config)
    engine = StepEngine(_weight(), config)
    engine.step(_chunk_hidden(0), [_chunk(0), _chunk(0, "q")])
    before = _state(engine)
    real = lm_head_module.compute_prompt_logprobs

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_head_module, "compute_prompt_logprobs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step(_chunk_hidden(4), [_chunk(4), _chunk(4, "q")])
    assert before[1:] == _state(engine)[1:]
    monkeypatch.setattr(lm_head_module, "compute_prompt_logprobs", real)
    got = [_fields(engine.step(_chunk_hidden(s), [_chunk(s), _chunk(s, "q")])) for s in (4, 8)]
    assert got == want[1:]


def test_rollback_undoes_a_step_that_returned():
    config = _config(use_graphs=False)
    want = _uninterrupted(config)
    engine = StepEngine(_weight(), config)
    engine.step(_chunk_hidden(0), [_chunk(0), _chunk(0, "q")])
    mark = engine.checkpoint()
    stats = copy.deepcopy(engine.stats)
    engine.step(_chunk_hidden(4), [_chunk(4), _chunk(4, "q")])  # the caller fails after this returned
    engine.rollback(mark)
    assert engine.stats == stats
    got = [_fields(engine.step(_chunk_hidden(s), [_chunk(s), _chunk(s, "q")])) for s in (4, 8)]
    assert got == want[1:]


# -- the sharded engine ---------------------------------------------------------


def _parallel_weight() -> torch.Tensor:
    return torch.randn(parallel.VOCAB, parallel.HIDDEN, generator=torch.Generator().manual_seed(0))


def _poisoned_sharded_worker(rank: int, world: int, cases: list) -> list:
    shard = vocab_shards(parallel.VOCAB, world).shard(_parallel_weight(), rank)
    engine = StepEngine(sharded_head(shard, parallel.VOCAB, parallel.CONFIG), parallel.CONFIG)
    engine.capture()
    return [_fields(engine.step(hidden, seqs, drafts)) for seqs, hidden, drafts in cases]


def test_the_sharded_engine_fails_the_same_requests(tmp_path):
    """2 gloo ranks: a poisoned batch gives the unsharded engine's tokens, logprobs
    and errors on every rank."""
    rng = np.random.default_rng(11)
    cases = []
    for seed, eligible in ((0, True), (1, True), (2, False)):
        seqs, hidden = parallel.random_batch(seed, eligible=eligible)
        first, second = rng.choice(len(hidden), size=2, replace=False)
        hidden[first, int(rng.integers(parallel.HIDDEN))] = NON_FINITE[int(rng.integers(3))]
        hidden[second] = OVERFLOW  # finite: only the logits show it
        drafts = [None if s.is_prompt else rng.integers(0, parallel.VOCAB, s.seqlen_q - 1).tolist() for s in seqs]
        cases.append((seqs, hidden, drafts))
    reference = StepEngine(_parallel_weight(), parallel.CONFIG)
    reference.capture()
    expected = [_fields(reference.step(hidden, seqs, drafts)) for seqs, hidden, drafts in cases]
    errors = [e for fields in expected for e in fields[-1]]
    assert any(e is not None for e in errors) and any(e is None for e in errors)
    for rank, outs in enumerate(parallel.run_ranks(2, _poisoned_sharded_worker, (cases,), tmp_path)):
        for got, want in zip(outs, expected):
            assert got == want, rank
