"""Sampling controls (issue 14): penalties, logit bias and allowed tokens inside the step.

Checked against tests/controls_reference.py (a per-request loop) and the numpy
sampler reference over random histories with drafts; strict drafts equal
one-token decoding; replay equals eager; a request is the same alone and in a
crowd; slots reset when reused; rollback takes the counts back; refusals name
the request, the field and the value.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, StepEngine
from engine.sampling.sampler import SamplerConfig
from engine.host.params import SeqMeta
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.step.batch import PersistentBatch
from tests.controls_reference import controlled_row
from tests.numpy_sampler_reference import RowSpec, sample_row
from tests.test_decode_loop import CONFIG, prompts_and_params, tiny_model

VOCAB, HIDDEN = 269, 16  # not a multiple of 32: the last bitmask word is partial
MAX_REQS, MAX_DRAFTS = 4, 2


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _engine(**options) -> StepEngine:
    config = dict(max_num_reqs=MAX_REQS, max_draft_tokens=MAX_DRAFTS, max_control_slots=MAX_REQS, device="cpu",
                  use_graphs=False, eos_token_id=None, max_logit_bias=8, max_allowed_token_ids=64,
                  # Few candidates: sampled rows often go to the exact path, whose draws the counts must follow.
                  sampler=SamplerConfig(candidate_cap=8, max_logprobs=2), sampler_variants=False)
    config.update(options)
    return StepEngine(_weight(), EngineConfig(**config))


ENGINE = _engine()


def _controls(params: SamplingParams) -> dict:
    return dict(repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty, logit_bias=params.logit_bias,
                allowed_token_ids=params.allowed_token_ids)


@st.composite
def requests(draw):
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        uses = draw(st.booleans()) or i == 0
        bias = draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5, width=32), max_size=8)) if uses else None
        allowed = draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40, unique=True)))
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.8, 1.0])),
            top_k=draw(st.sampled_from([0, 0, 5])),
            top_p=draw(st.sampled_from([1.0, 0.9])),
            seed=i + 11,
            repetition_penalty=draw(st.sampled_from([1.0, 0.6, 1.3, 2.0])) if uses else 1.0,
            frequency_penalty=draw(st.sampled_from([0.0, 0.7, -1.5])) if uses else 0.0,
            presence_penalty=draw(st.sampled_from([0.0, 1.1, -0.4])) if uses else 0.0,
            logit_bias=bias or None,
            allowed_token_ids=tuple(allowed) if uses and allowed else None,
            logprobs=1,
        )
        out.append((prompt, params))
    steps = draw(st.lists(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=MAX_DRAFTS), min_size=n, max_size=n),
                          min_size=1, max_size=3))
    return out, steps, draw(st.integers(0, 2**31))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
# An accepted draft equal to the token before it: its logprob is its own row's.
@example(([([0], SamplingParams(temperature=0.0, seed=11, logprobs=1)),
           ([0], SamplingParams(temperature=0.0, seed=12, logprobs=1, allowed_token_ids=(0,))),
           ([0], SamplingParams(temperature=0.0, seed=13, logprobs=1))], [[[], [0], []]], 0))
def test_every_row_matches_the_per_request_reference_over_random_histories(case):
    """Each sample row's controlled logits equal the reference's bit for bit
    (row j counting its request's drafts 0..j-1); the emitted tokens equal the
    numpy sampler's draws on them; raw logprobs stay those of the unprocessed
    logits; the counts equal the tokens emitted so far."""
    reqs, steps, seed = case
    rng = np.random.default_rng(seed)
    engine, batch = ENGINE, PersistentBatch(ENGINE)
    ids = list(range(len(reqs)))
    outputs = {i: [] for i in ids}
    try:
        for i, (prompt, params) in enumerate(reqs):
            batch.add(i, prompt, params)
        schedule = [None] + steps
        for drafts in schedule:
            q = [len(reqs[i][0]) if drafts is None else 1 + len(drafts[i]) for i in ids]
            k = [len(reqs[i][0]) if drafts is None else len(reqs[i][0]) + len(outputs[i]) + len(drafts[i]) for i in ids]
            hidden = torch.from_numpy(rng.standard_normal((sum(q), HIDDEN)).astype(np.float32))
            step = batch.prepare(ids, q, k, draft_tokens=None if drafts is None else drafts)
            out = engine.run(hidden, step.inputs, step.arrays)
            batch.record(step, out)
            controlled = engine.buffers.logits.numpy()
            # A step where no request holds a slot runs the plain graphs: its logits are unprocessed.
            unprocessed = controlled if step.arrays.control_slots is None else engine.controls.unprocessed.numpy()
            for i in ids:
                prompt, params = reqs[i]
                row_drafts = [] if drafts is None else drafts[i]
                lo = int(step.inputs.sample_offsets[i])
                tokens, decided, rejected = [], True, False
                for j in range(1 + len(row_drafts)):
                    # Every row, also past a rejected draft: row j counts drafts 0..j-1.
                    want = controlled_row(unprocessed[lo + j], prompt, outputs[i] + row_drafts[:j], **_controls(params))
                    np.testing.assert_array_equal(controlled[lo + j], want, err_msg=f"request {i} row {j}")
                    if rejected:
                        continue
                    spec = RowSpec(params.temperature, params.top_k, params.top_p, seed=params.seed,
                                   position=len(prompt) + len(outputs[i]) + j)
                    result = sample_row(want, spec)
                    decided &= result.decided
                    tokens.append(result.token)
                    rejected = j < len(row_drafts) and result.token != row_drafts[j]
                assert out.errors[i] is None
                if decided:
                    assert out.tokens[i] == tokens, f"request {i}"
                for j, lp in enumerate(out.logprobs[i]):  # emitted token j is row j's (not the first equal token's)
                    row = unprocessed[lo + j].astype(np.float64)
                    lse = row.max() + math.log(np.exp(row - row.max()).sum())
                    assert lp.logprob == pytest.approx(row[lp.token] - lse, abs=1e-5)
                outputs[i] += out.tokens[i]
                slot = int(batch.table.control_slot[batch.table.row(i)])
                if slot:
                    counts = np.bincount(np.asarray(outputs[i], np.int64), minlength=VOCAB)
                    np.testing.assert_array_equal(engine.controls.counts[slot].numpy(), counts)
    finally:
        for i in ids:
            if i in batch:
                batch.remove(i)
    assert engine.controls.free_slots == MAX_REQS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_planted_drafts_are_counted_so_strict_verification_emits_one_token_decoding(temperature):
    """Every position gets the same hidden state, so only the penalties tell
    the rows apart: a row that did not count the drafts before it would draw
    what the first row drew."""
    h = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=temperature, seed=3, presence_penalty=2.0, frequency_penalty=2.0,
                            repetition_penalty=2.0)
    engine = _engine()
    batch = PersistentBatch(engine)
    batch.add("one", [1, 2, 3], params)
    batch.add("spec", [1, 2, 3], params)
    step = batch.prepare(["one", "spec"], [3, 3], [3, 3])
    out = engine.run(h.expand(6, -1), step.inputs, step.arrays)
    batch.record(step, out)
    assert out.tokens[0] == out.tokens[1]
    single = []
    for k in range(4, 4 + 2 * (1 + MAX_DRAFTS)):  # one token at a time
        step = batch.prepare(["one"], [1], [k])
        out = engine.run(h, step.inputs, step.arrays)
        batch.record(step, out)
        single += out.tokens[0]
    assert len(set(single[:MAX_DRAFTS + 1])) > 1  # the penalties change the draws
    for i in range(2):  # the same tokens, MAX_DRAFTS + 1 per step with the right drafts
        lo = i * (MAX_DRAFTS + 1)
        drafts = [single[lo : lo + MAX_DRAFTS]]
        step = batch.prepare(["spec"], [1 + MAX_DRAFTS], [3 + lo + 1 + MAX_DRAFTS], draft_tokens=drafts)
        out = engine.run(h.expand(1 + MAX_DRAFTS, -1), step.inputs, step.arrays)
        batch.record(step, out)
        assert out.tokens[0] == single[lo : lo + MAX_DRAFTS + 1] and out.num_accepted == [MAX_DRAFTS]
    slots = [int(batch.table.control_slot[batch.table.row(r)]) for r in ("one", "spec")]
    torch.testing.assert_close(engine.controls.counts[slots[0]], engine.controls.counts[slots[1]], rtol=0, atol=0)


# -- decoding with the loop --------------------------------------------------------------


def _controlled_params(n: int) -> list[SamplingParams]:
    prompts, params = prompts_and_params(n, seed=3)
    vocab = CONFIG.vocab_size
    out = []
    for i, p in enumerate(params):
        extra = [dict(repetition_penalty=1.4, frequency_penalty=0.3),
                 dict(presence_penalty=0.8, logit_bias={5: 3.0, 9: -2.0}),
                 dict(allowed_token_ids=tuple(range(3, vocab, 2)), repetition_penalty=0.8),
                 {}][i % 4]
        out.append(SamplingParams(**{**{f: getattr(p, f) for f in ("temperature", "top_k", "top_p", "seed",
                                                                      "max_tokens", "min_tokens", "logprobs")},
                                     **extra}))
    return prompts, out


def _loop_run(prompts, params, *, drafts: int, graphs: bool = False, max_num_reqs: int = 4):
    loop = DecodeLoop(tiny_model(8), LoopConfig(seed_base=0, max_num_reqs=max_num_reqs, token_budget=64, max_draft_tokens=drafts),
                      engine_config=EngineConfig(device="cpu", use_graphs=graphs), capture=graphs)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    done = loop.run()
    return [(c.tokens, c.finish_reason, [lp.logprob for lp in c.logprobs or []]) for _, c in sorted(done.items())], loop


def test_strict_drafts_with_controls_emit_what_one_token_decoding_emits():
    prompts, params = _controlled_params(6)
    plain, _ = _loop_run(prompts, params, drafts=0)
    drafted, loop = _loop_run(prompts, params, drafts=2)
    assert drafted == plain
    assert loop.stats.drafts_accepted > 0  # the drafts did something
    assert loop.engine.controls.free_slots == loop.engine.config.max_control_slots


def test_replay_equals_eager_and_alone_equals_crowd():
    prompts, params = _controlled_params(6)
    eager, _ = _loop_run(prompts, params, drafts=1)
    replayed, _ = _loop_run(prompts, params, drafts=1, graphs=True)
    assert replayed == eager
    for i in (0, 2):
        alone, _ = _loop_run([prompts[i]], [params[i]], drafts=1, max_num_reqs=1)
        assert alone[0] == eager[i]


def test_controls_change_the_tokens_and_allowed_tokens_hold():
    prompts, params = _controlled_params(4)
    controlled, _ = _loop_run(prompts, params, drafts=0)
    plain, _ = _loop_run(prompts, [SamplingParams(**{f: getattr(p, f) for f in (
        "temperature", "top_k", "top_p", "seed", "max_tokens", "min_tokens", "logprobs")}) for p in params], drafts=0)
    assert controlled != plain
    allowed = set(params[2].allowed_token_ids)
    assert set(controlled[2][0]) <= allowed


# -- slots, rollback, refusals --------------------------------------------------------


def _step(batch: PersistentBatch, ids, seed: int = 0):
    table = batch.table
    q, k = [], []
    for rid in ids:
        row = table.row(rid)
        generated, prompt_len = int(table.cols["num_generated"][row]), int(table.cols["prompt_len"][row])
        q.append(prompt_len if generated == 0 else 1)
        k.append(prompt_len + generated)
    hidden = torch.from_numpy(np.random.default_rng(seed).standard_normal((sum(q), HIDDEN)).astype(np.float32))
    step = batch.prepare(ids, q, k)
    out = batch.engine.run(hidden, step.inputs, step.arrays)
    batch.record(step, out)
    return out


def test_counts_reset_when_a_slot_is_reused_and_rollback_takes_a_step_back():
    engine = _engine(max_control_slots=1)
    batch = PersistentBatch(engine)
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    batch.add("a", [1, 2], params)
    first = [_step(batch, ["a"], seed=s).tokens[0][0] for s in range(3)]
    slot = int(batch.table.control_slot[batch.table.row("a")])
    assert engine.controls.counts[slot].sum() == 3
    mark = engine.checkpoint()
    _step(batch, ["a"], seed=9)
    assert engine.controls.counts[slot].sum() == 4
    engine.rollback(mark)
    np.testing.assert_array_equal(engine.controls.counts[slot].numpy(), np.bincount(first, minlength=VOCAB))
    engine.rollback(mark)  # nothing ran since: nothing more to take back
    assert engine.controls.counts[slot].sum() == 3
    batch.remove("a")
    batch.add("b", [1, 2], params)  # the same slot, fresh counts: the same tokens as "a" had
    assert int(batch.table.control_slot[batch.table.row("b")]) == slot
    assert [_step(batch, ["b"], seed=s).tokens[0][0] for s in range(3)] == first


def test_a_plain_request_is_the_same_beside_controlled_ones():
    engine = _engine()
    batch = PersistentBatch(engine)
    batch.add("plain", [7, 8, 9], SamplingParams(temperature=0.7, seed=1, logprobs=2))
    alone = [_step(batch, ["plain"], seed=s) for s in range(3)]
    batch.remove("plain")
    batch.add("plain", [7, 8, 9], SamplingParams(temperature=0.7, seed=1, logprobs=2))
    batch.add("c", [1], SamplingParams(allowed_token_ids=(4, 5), repetition_penalty=2.0, logit_bias={4: 1.0}))
    crowd = []
    for s in range(3):
        # The plain request first: its hidden rows are the same as alone.
        crowd.append(_step(batch, ["plain", "c"], seed=s))
    assert [o.tokens[0] for o in crowd] == [o.tokens[0] for o in alone]
    assert [o.logprobs[0] for o in crowd] == [o.logprobs[0] for o in alone]
    assert all(o.tokens[1][0] in (4, 5) for o in crowd)


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(logit_bias={VOCAB: 1.0}), f"logit_bias: token {VOCAB} is outside the vocabulary"),
        (SamplingParams(allowed_token_ids=(1, VOCAB + 3)), f"allowed_token_ids: token {VOCAB + 3} is outside"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(9)}), "logit_bias has 9 entries, over EngineConfig.max_logit_bias=8"),
        (SamplingParams(allowed_token_ids=tuple(range(65))), "allowed_token_ids has 65 entries, over"),
    ],
)
def test_a_request_over_a_cap_or_outside_the_vocabulary_is_refused_before_anything_changes(params, match):
    batch = PersistentBatch(ENGINE)
    free = ENGINE.controls.free_slots
    with pytest.raises(ValueError, match=r"request 'x': " + match):
        batch.add("x", [1, 2], params)
    assert "x" not in batch and ENGINE.controls.free_slots == free
    batch.add("x", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'x': " + match):
        batch.update("x", params)
    assert int(batch.table.control_slot[batch.table.row("x")]) == 0
    batch.remove("x")


def test_an_engine_without_controls_refuses_them_naming_the_field():
    engine = _engine(max_control_slots=0)
    assert engine.controls is None
    batch = PersistentBatch(engine)
    with pytest.raises(ValueError, match=r"request 'r': repetition_penalty=1.5: .*max_control_slots=0"):
        batch.add("r", [1], SamplingParams(repetition_penalty=1.5))
    with pytest.raises(ValueError, match=r"request 's': logit_bias=\{3: 1.0\}"):
        engine.step(torch.zeros(1, HIDDEN), [SeqMeta("s", True, 1, 1, 1, prompt_tokens=[3],
                                                     params=SamplingParams(logit_bias={3: 1.0}))])


def test_seqmeta_path_needs_the_prompt_for_repetition_and_counts_its_tokens():
    engine = _engine()
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5)
    with pytest.raises(ValueError, match=r"request 'q': repetition_penalty=1.5: needs the prompt's tokens"):
        engine.step(torch.zeros(1, HIDDEN), [SeqMeta("q", True, 1, 1, 1, params=params)])
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = engine.step(hidden, [SeqMeta("q", True, 3, 3, 3, prompt_tokens=[1, 2, 3], params=params)])
    token = out.tokens[0][0]
    slot = int(engine.seq_front.table.control_slot[engine.seq_front.table.row("q")])
    assert engine.controls.counts[slot, token] == 1 and engine.controls.counts[slot].sum() == 1
    # Repetition over the prompt: the controlled logits of the prompt's tokens are penalised.
    raw, got = engine.controls.unprocessed[0], engine.buffers.logits[0]
    for t in (1, 2, 3):
        want = raw[t] / 1.5 if raw[t] > 0 else raw[t] * 1.5
        assert got[t] == want - (0.5 if t == token else 0.0) or t == token


def test_a_decode_loop_refuses_controls_it_cannot_honour_at_submission():
    loop = DecodeLoop(tiny_model(2), LoopConfig(seed_base=0, max_num_reqs=2, token_budget=16),
                      engine_config=EngineConfig(device="cpu", use_graphs=False), capture=False)
    assert loop.engine.config.max_control_slots == 2
    with pytest.raises(ValueError, match=f"request 'x': logit_bias: token {CONFIG.vocab_size} is outside"):
        loop.submit("x", [1, 2], SamplingParams(logit_bias={CONFIG.vocab_size: 1.0}))
    assert not loop.has_work()


def test_counts_follow_the_draws_of_wide_top_p_rows():
    """Top-p rows that keep most of the vocabulary are drawn inside the graph
    (no row is left to an eager pass), and the counts follow their draws."""
    engine = _engine()
    batch = PersistentBatch(engine)
    batch.add("a", [1, 2, 3], SamplingParams(temperature=1.0, top_p=0.9, seed=1, frequency_penalty=1.0))
    tokens = []
    for s in range(20):
        tokens += _step(batch, ["a"], seed=s).tokens[0]
    assert len(set(tokens)) > 5
    slot = int(batch.table.control_slot[batch.table.row("a")])
    np.testing.assert_array_equal(engine.controls.counts[slot].numpy(), np.bincount(tokens, minlength=VOCAB))


def test_allowed_tokens_that_are_all_suppressed_fail_only_their_request():
    """min_tokens suppresses EOS, the only allowed token: nothing is left, the
    request fails with that cause and its neighbour is untouched."""
    engine = _engine(eos_token_id=3)
    batch = PersistentBatch(engine)
    batch.add("stuck", [1, 2], SamplingParams(allowed_token_ids=(3,), min_tokens=2, temperature=0.5, seed=1))
    batch.add("fine", [1, 2], SamplingParams(temperature=0.5, seed=2))
    out = _step(batch, ["stuck", "fine"])
    assert out.errors[0] == "request 'stuck': no token left after the sampling controls (EOS/stop suppression)"
    assert out.tokens[0] == [] and out.errors[1] is None and out.tokens[1]
    slot = int(batch.table.control_slot[batch.table.row("stuck")])
    assert engine.controls.counts[slot].sum() == 0  # a failed request emits (and counts) nothing


@pytest.mark.parametrize("mode", ["rejection", "strict-top-k-space"])
def test_verification_sees_the_controlled_distribution(mode):
    """Rejection mode's target p and top-k-space verification read the controlled
    logits: a draft outside the allowed set is never accepted, every emitted
    token is allowed, and raw logprobs still rank it among the unprocessed logits."""
    options = dict(verify_mode="rejection") if mode == "rejection" else dict(top_k_space_verify=True)
    engine = _engine(**options)
    batch = PersistentBatch(engine)
    allowed = tuple(range(10, 20))
    params = SamplingParams(temperature=1.0, top_k=5, seed=4, allowed_token_ids=allowed, logprobs=1)
    batch.add("r", [1, 2], params)
    _step(batch, ["r"])
    rng = np.random.default_rng(0)
    for s in range(6):
        generated = int(batch.table.cols["num_generated"][batch.table.row("r")])
        drafts = [[int(rng.choice(allowed)), 300 % VOCAB]]  # the second is never allowed
        hidden = torch.from_numpy(rng.standard_normal((3, HIDDEN)).astype(np.float32))
        step = batch.prepare(["r"], [3], [2 + generated + 2], draft_tokens=drafts)
        out = engine.run(hidden, step.inputs, step.arrays)
        batch.record(step, out)
        assert out.num_accepted[0] <= 1 and set(out.tokens[0]) <= set(allowed)
        for j, lp in enumerate(out.logprobs[0]):
            row = engine.controls.unprocessed[j].double()
            assert lp.rank == 1 + int((row > row[lp.token]).sum())


@pytest.mark.parametrize("where", ["collect", "prompt logprobs"])
def test_a_step_that_raises_after_its_replay_leaves_the_counts_as_they_were(monkeypatch, where):
    import engine.step.step_engine as step_engine_module

    engine = _engine()
    batch = PersistentBatch(engine)
    batch.add("a", [1, 2], SamplingParams(temperature=0, frequency_penalty=1.0, prompt_logprobs=1))
    _step(batch, ["a"])
    slot = int(batch.table.control_slot[batch.table.row("a")])
    before = engine.controls.counts.clone()
    if where == "collect":
        original = step_engine_module.collect

        def failing(*args, **kwargs):
            original(*args, **kwargs)
            raise KeyboardInterrupt("after the output copy")

        monkeypatch.setattr(step_engine_module, "collect", failing)
    else:
        monkeypatch.setattr(engine.head, "prompt_logprobs", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        batch.add("b", [3, 4, 5], SamplingParams(presence_penalty=1.0, prompt_logprobs=1))
    with pytest.raises(KeyboardInterrupt):
        _step(batch, ["a", "b"] if where != "collect" else ["a"])
    assert torch.equal(engine.controls.counts, before) and engine.controls.counts[slot].sum() == 1


def test_processed_logprobs_report_the_controlled_distribution():
    """logprobs_mode="processed": the top alternatives are allowed tokens, their
    logprob is that of the controlled row; raw mode reports the unprocessed row."""
    allowed = (10, 11, 12, 13)
    params = SamplingParams(temperature=1.0, seed=2, allowed_token_ids=allowed, logit_bias={11: 4.0}, logprobs=2)
    for mode in ("processed", "raw"):
        engine = _engine(sampler=SamplerConfig(candidate_cap=8, max_logprobs=2, logprobs_mode=mode))
        batch = PersistentBatch(engine)
        batch.add("p", [1, 2], params)
        out = _step(batch, ["p"], seed=3)
        lp = out.logprobs[0][0]
        if mode == "processed":
            assert {t for t, _ in lp.top} <= set(allowed)
            controlled = engine.buffers.logits[0].double()
            want = controlled[lp.token] - torch.logsumexp(controlled, 0)
            assert lp.logprob == pytest.approx(float(want), abs=1e-5)
        else:
            raw = engine.controls.unprocessed[0].double()
            assert lp.logprob == pytest.approx(float(raw[lp.token] - torch.logsumexp(raw, 0)), abs=1e-5)
