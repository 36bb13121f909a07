"""The token bitmask stage (engine/sampling/token_bitmask.py) and its place in
the step: unpacking against a bit-by-bit loop, the sampler's draws against the
same sampler on logits where a plain loop pushed the disallowed tokens out of
reach, raw logprobs untouched, dead rows failing alone, and through a
`StepEngine` (bad words on a `PersistentBatch`): replay equals eager, a masked
request is the same alone and in a crowd, a dead end fails only its request."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, StepEngine
from engine.sampling.exact import sample_reference
from engine.sampling.row_params import RowParams
from engine.sampling.sampler import RowError, SamplerConfig, sample
from engine.sampling.token_bitmask import unpack_token_bitmask
from engine.step.batch import PersistentBatch


def allowed_by_loop(words: np.ndarray, vocab: int) -> np.ndarray:
    """[rows, V] bool, one bit at a time: token t is bit t % 32 of word t // 32."""
    out = np.zeros((words.shape[0], vocab), dtype=bool)
    for r in range(words.shape[0]):
        for t in range(vocab):
            out[r, t] = (int(words[r, t // 32]) >> (t % 32)) & 1 == 1
    return out


def random_words(rng: np.random.Generator, rows: int, vocab: int, density: float) -> np.ndarray:
    allowed = rng.random((rows, vocab)) < density
    words = np.zeros((rows, -(-vocab // 32)), dtype=np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 130), st.integers(0, 2**32 - 1))
def test_unpacking_matches_a_bit_by_bit_loop(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    got = unpack_token_bitmask(torch.from_numpy(words), vocab).numpy()
    np.testing.assert_array_equal(got, allowed_by_loop(words, vocab))


def random_params(rng: np.random.Generator, rows: int) -> RowParams:
    return RowParams.from_numpy(
        temperatures=rng.choice([0.0, 0.7, 1.0], rows).astype(np.float32),
        top_ks=rng.choice([0, 3, 40], rows).astype(np.int32),
        top_ps=rng.choice([1.0, 0.8], rows).astype(np.float32),
        min_ps=rng.choice([0.0, 0.1], rows).astype(np.float32),
        seeds=rng.integers(0, 2**63, rows, dtype=np.uint64),
        sample_positions=rng.integers(0, 1000, rows),
        row_to_req=np.arange(rows),
        local_step=np.zeros(rows, np.int64),
    )


CFG = SamplerConfig(candidate_cap=16, max_logprobs=4)


def sampled(logits, params, words):
    return sample(logits, params, CFG, token_bitmask=words)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.02, 0.2, 0.9]))
def test_masked_draws_equal_the_sampler_on_logits_with_disallowed_tokens_out_of_reach(seed, density):
    """The reference: the same sampler, no bitmask, on logits a plain loop set to
    -1e30 where the mask disallows (their weight exp(-1e30 - M) is exactly 0,
    and they never win a race or an argmax). Raw logprobs are those of the
    unmasked logits."""
    rng = np.random.default_rng(seed)
    rows, vocab = 12, 100  # > candidate_cap: sparse masks leave the candidates short
    logits = torch.from_numpy(rng.normal(0, 3, (rows, vocab)).astype(np.float32))
    words = random_words(rng, rows, vocab, density)
    words[0] = -1  # a row that restricts nothing
    allowed = allowed_by_loop(words, vocab)
    allowed[np.flatnonzero(~allowed.any(1))] = True  # dead rows are tested below; give them every token
    words = np.stack([random_words(rng, 1, vocab, 1.0)[0] if a.all() else w for a, w in zip(allowed, words)])
    params = random_params(rng, rows)
    out = sampled(logits, params, torch.from_numpy(words))
    pushed = logits.clone()
    for r in range(rows):
        for t in range(vocab):
            if not allowed[r, t]:
                pushed[r, t] = -1e30
    ref = sample_reference(pushed, params, CFG, num_top=4)
    tokens = out.tokens.numpy()
    assert allowed[np.arange(rows), tokens].all()
    np.testing.assert_array_equal(tokens, ref.tokens.numpy())
    assert (out.error == 0).all()
    raw = torch.log_softmax(logits.double(), -1)
    np.testing.assert_allclose(out.logprob.numpy(), raw[np.arange(rows), tokens].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.rank.numpy(), (logits > logits[np.arange(rows), tokens][:, None]).sum(1) + 1)
    np.testing.assert_array_equal(out.top_ids.numpy(), torch.topk(logits, 4).indices.numpy())
    # The exact path alone (every row) decides the same.
    np.testing.assert_array_equal(sample_reference(logits, params, CFG, 4, token_bitmask=torch.from_numpy(words)).tokens, tokens)


def test_a_row_with_nothing_allowed_fails_alone_and_bystanders_are_bit_identical():
    rng = np.random.default_rng(3)
    rows, vocab = 6, 100
    logits = torch.from_numpy(rng.normal(0, 3, (rows, vocab)).astype(np.float32))
    params = random_params(rng, rows)
    words = random_words(rng, rows, vocab, 0.3)
    dead = words.copy()
    dead[2] = 0
    a = sampled(logits, params, torch.from_numpy(words))
    b = sampled(logits, params, torch.from_numpy(dead))
    assert b.error.tolist()[2] == RowError.NO_TOKEN_ALLOWED and b.tokens[2] == 0
    others = [0, 1, 3, 4, 5]
    for name in ("tokens", "logprob", "rank", "top_ids", "top_logprobs", "error"):
        assert torch.equal(getattr(a, name)[others], getattr(b, name)[others]), name
    assert (a.error == 0).all()


# -- through the step engine: bad words on a persistent batch -------------------------------

V, H, EOS = 64, 8, 1


def make_engine(**config) -> StepEngine:
    base = dict(max_num_reqs=4, device="cpu", use_graphs=False, eos_token_id=EOS, max_stop_ids=4)
    base.update(config)
    e = StepEngine(torch.randn(V, H, generator=torch.Generator().manual_seed(0)), EngineConfig(**base))
    if e.config.use_graphs:
        e.capture()
    return e


def decode_run(e: StepEngine, requests: dict, steps: int, hidden_seed: int = 0) -> dict:
    """Prefill then decode each request for `steps` steps, one token a step; the hidden
    rows come from (request, position), so a request's rows do not depend on its batch."""
    batch = PersistentBatch(e, capacity=len(requests))
    out_tokens = {rid: [] for rid in requests}
    errors = {rid: None for rid in requests}
    for rid, (prompt, params) in requests.items():
        batch.add(rid, prompt, params)

    def hidden_for(rid, pos):
        g = torch.Generator().manual_seed(hash((rid, pos, hidden_seed)) % 2**31)
        return torch.randn(H, generator=g)

    for step in range(steps + 1):
        live = [rid for rid in requests if errors[rid] is None]
        if not live:
            break
        q, k, rows = [], [], []
        for rid in live:
            prompt = requests[rid][0]
            done = len(out_tokens[rid])
            q.append(len(prompt) if step == 0 else 1)
            k.append(len(prompt) + done)
            rows += [hidden_for(rid, len(prompt) + done - q[-1] + j) for j in range(q[-1])]
        prepared = batch.prepare(live, q, k)
        out = e.run(torch.stack(rows), prepared.inputs, prepared.arrays)
        batch.record(prepared, out)
        for i, rid in enumerate(live):
            if out.errors[i] is not None:
                errors[rid] = out.errors[i]
            logprobs = out.logprobs[i] or [None] * len(out.tokens[i])
            out_tokens[rid] += [(t, None if lp is None else (lp.logprob, lp.rank)) for t, lp in zip(out.tokens[i], logprobs)]
    return {rid: (out_tokens[rid], errors[rid]) for rid in requests}


BANNED = SamplingParams(temperature=0.9, seed=5, logprobs=2,
                        bad_words=tuple((t,) for t in range(0, V, 2)) + ((3, 5), (7, 9, 11)))


def test_bad_words_hold_and_a_masked_request_is_the_same_alone_in_a_crowd_and_replayed():
    alone = decode_run(make_engine(), {"m": ([3, 4], BANNED)}, 12)
    crowd_requests = {"x": ([9, 9, 9], SamplingParams(temperature=0.0)), "m": ([3, 4], BANNED),
                      "y": ([2], SamplingParams(temperature=1.0, seed=1, bad_words=((5, 7),)))}
    crowd = decode_run(make_engine(), crowd_requests, 12)
    replayed = decode_run(make_engine(use_graphs=True), crowd_requests, 12)
    assert alone["m"] == crowd["m"]
    assert crowd == replayed
    tokens = [t for t, _ in alone["m"][0]]  # a word's prefix is matched on the output only
    assert all(t % 2 for t in tokens)  # every even token is a one-token bad word
    for a, b in zip(tokens, tokens[1:]):
        assert (a, b) != (3, 5)
    for a, b, c in zip(tokens, tokens[1:], tokens[2:]):
        assert (a, b, c) != (7, 9, 11)


@pytest.mark.filterwarnings("ignore:a step with 3 requests exceeds the largest graph bucket")
def test_a_step_above_the_largest_bucket_splits_the_bitmask_with_it():
    requests = {"x": ([9, 9, 9], SamplingParams(temperature=0.0, bad_words=((9, 9),))), "m": ([3, 4], BANNED),
                "y": ([2], SamplingParams(temperature=1.0, seed=1, bad_words=((5, 7),)))}
    assert decode_run(make_engine(max_num_reqs=1), requests, 8) == decode_run(make_engine(), requests, 8)


def test_a_dead_end_fails_only_its_request():
    everything = SamplingParams(bad_words=tuple((t,) for t in range(V)))
    base = {"x": ([9, 9], SamplingParams(temperature=0.0, logprobs=1)), "y": ([2], SamplingParams(seed=3, logprobs=1))}
    without = decode_run(make_engine(), base, 6)
    with_dead = decode_run(make_engine(), {**base, "d": ([4], everything)}, 6)
    assert with_dead["d"][0] == [] and "no token allowed" in with_dead["d"][1]
    assert with_dead["x"] == without["x"] and with_dead["y"] == without["y"]


def test_an_engine_without_bitmask_graphs_refuses_a_masked_step():
    e = make_engine(token_bitmask=False)
    batch = PersistentBatch(e)
    batch.add("a", [3], BANNED)
    prepared = batch.prepare(["a"], [1], [1])
    with pytest.raises(ValueError, match="token_bitmask"):
        e.run(torch.zeros(1, H), prepared.inputs, prepared.arrays)


def run_with_drafts(e: StepEngine, prompt: list[int], params: SamplingParams, steps: int, propose) -> list[int]:
    """One request decoded with `propose(emitted) -> drafts` each step (the hidden rows
    depend on the position only, as in `decode_run`)."""
    batch = PersistentBatch(e)
    batch.add("m", prompt, params)

    def hidden_at(pos):
        return torch.randn(H, generator=torch.Generator().manual_seed(hash(("m", pos, 0)) % 2**31))

    emitted: list[int] = []
    prepared = batch.prepare(["m"], [len(prompt)], [len(prompt)])
    out = e.run(torch.stack([hidden_at(p) for p in range(len(prompt))]), prepared.inputs, prepared.arrays)
    batch.record(prepared, out)
    emitted += out.tokens[0]
    while len(emitted) < steps:
        drafts = propose(emitted)
        q, k = 1 + len(drafts), len(prompt) + len(emitted) + len(drafts)
        prepared = batch.prepare(["m"], [q], [k], draft_tokens=[drafts])
        start = len(prompt) + len(emitted) - 1
        out = e.run(torch.stack([hidden_at(start + j) for j in range(q)]), prepared.inputs, prepared.arrays)
        batch.record(prepared, out)
        assert out.errors[0] is None
        emitted += out.tokens[0]
    return emitted[:steps]


def test_strict_drafts_with_bad_words_give_the_tokens_of_no_drafts():
    plain = run_with_drafts(make_engine(max_draft_tokens=2), [3, 4], BANNED, 14, lambda done: [])
    rng = np.random.default_rng(0)

    def propose(done):  # right continuations, wrong ones and banned ones
        right = plain[len(done) : len(done) + 2]
        return [int(t) if rng.random() < 0.7 else int(rng.integers(0, V)) for t in right]

    assert run_with_drafts(make_engine(max_draft_tokens=2), [3, 4], BANNED, 14, propose) == plain


def test_rejection_mode_never_accepts_a_banned_draft():
    e = make_engine(max_draft_tokens=2, verify_mode="rejection")
    rng = np.random.default_rng(1)
    emitted = run_with_drafts(e, [3, 4], BANNED, 40, lambda done: [int(t) for t in rng.integers(0, V, 2)])
    assert all(t % 2 for t in emitted)


def test_wide_top_p_rows_see_the_mask():
    """A wide top-p keeps most of the allowed tokens: the draw over that kept
    set, inside the graph, still never picks a masked token."""
    e = make_engine(sampler=SamplerConfig(candidate_cap=16, max_logprobs=2), sampler_variants=False)
    params = SamplingParams(temperature=2.0, top_p=0.99, seed=4, bad_words=tuple((t,) for t in range(0, V, 2)))
    emitted = run_with_drafts(e, [3, 4], params, 30, lambda done: [])
    assert len(set(emitted)) > 5
    assert all(t % 2 for t in emitted)
