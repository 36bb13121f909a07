"""Speculative decoding inside the captured step (issue 5): the draft-info
pool (docs/contract.md §1.3) and rejection-mode verification through StepEngine; replay
equals eager for mixed draft lengths at every bucket in both modes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.host.draft_slots import DraftSlots

VOCAB, HIDDEN, K = 96, 16, 3


def _weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)) * 2


def _engine(**kwargs) -> StepEngine:
    config = dict(max_num_reqs=8, max_draft_tokens=K, device="cpu", draft_pool_slots=10)
    config.update(kwargs)
    engine = StepEngine(_weight(), EngineConfig(**config))
    if config.get("use_graphs", True):
        engine.capture()
    return engine


def _decode(rid, drafts, *, read=0, write=1, gen=5, params=None):
    return SeqMeta(rid, False, 1 + drafts, 10 + gen + drafts, 10, num_generated=gen,
                   params=params or SamplingParams(temperature=0.9, seed=hash(rid) % 1000),
                   mtp_read_slot=read, mtp_write_slot=write)


def test_pool_slot_zero_is_padding_and_never_written():
    engine = _engine()
    pool_t, pool_lp = engine.buffers.pool_tokens, engine.buffers.pool_logprobs
    assert pool_t[:K].tolist() == [VOCAB - 1] * K
    assert pool_lp[0].item() == 0.0 and torch.isinf(pool_lp[1:K]).all()
    # A non-last prefill chunk (write slot forced to 0) and a padding-heavy
    # bucket both propose drafts; slot 0 must stay as it was.
    seqs = [SeqMeta("p", True, 3, 3, 9, params=SamplingParams(temperature=0.0), mtp_write_slot=2),
            _decode("d", 0, write=3)]
    engine.step(torch.randn(4, HIDDEN), seqs, next_drafts=[[5, 6, 7], [8, 9]])
    assert pool_t[:K].tolist() == [VOCAB - 1] * K
    assert pool_lp[0].item() == 0.0
    assert pool_t[3 * K : 3 * K + 3].tolist() == [8, 9, -1]  # the decode's slot got its proposal
    assert pool_t[2 * K : 2 * K + 3].tolist() == [-1, -1, -1]  # the non-last chunk wrote nothing


def test_drafts_read_from_the_pool_equal_drafts_passed_in():
    hidden = torch.randn(1 + K, HIDDEN, generator=torch.Generator().manual_seed(3))
    greedy = SamplingParams(temperature=0.0)
    proposal = torch.argmax(hidden @ _weight().T, dim=-1)[:K].tolist()  # drafts a greedy row accepts
    explicit, pooled = _engine(), _engine()
    pooled.step(torch.randn(1, HIDDEN), [_decode("a", 0, write=4, params=greedy)], next_drafts=[proposal])
    via_pool = pooled.step(hidden, [_decode("a", K, read=4, write=4, gen=6, params=greedy)])
    direct = explicit.step(hidden, [_decode("a", K, read=0, write=4, gen=6, params=greedy)], [proposal])
    assert direct.num_accepted == [K]
    assert via_pool.tokens == direct.tokens and via_pool.num_accepted == direct.num_accepted


def test_take_once_new_and_preempted_requests_read_padding():
    """A request reading slot 0 (new, preempted, just out of prefill, or whose
    slot was already consumed) verifies padding drafts: its output equals plain
    decoding of the same rows (strict mode)."""
    slots = DraftSlots(10)
    write = slots.allocate()
    slots.mark_written(np.array([write]))
    first = slots.take_read_slots(np.array([write]), np.array([True]))
    again = slots.take_read_slots(np.array([write]), np.array([True]))
    assert first.tolist() == [write] and again.tolist() == [0]  # take-once
    engine, plain = _engine(), _engine(max_draft_tokens=0)
    hidden = torch.randn(1 + K, HIDDEN)
    out = engine.step(hidden, [_decode("n", K, read=0, write=write)])
    single = plain.step(hidden[:1], [SeqMeta("n", False, 1, 10 + 5, 10, num_generated=5,
                                             params=SamplingParams(temperature=0.9, seed=hash("n") % 1000))])
    assert out.tokens[0][0] == single.tokens[0][0]
    if out.num_accepted[0] == 0:
        assert out.tokens[0] == single.tokens[0]


def _mixed_batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    seqs, drafts, qs = [], [], []
    for i in range(n):
        k = int(rng.integers(0, K + 1))
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 20])),
                                seed=int(rng.integers(1 << 40)))
        seqs.append(_decode(f"m{i}", k, write=1 + i % 9, gen=int(rng.integers(1, 30)), params=params))
        drafts.append(rng.integers(0, VOCAB, k).tolist())
        qs.append(torch.log_softmax(torch.randn(k, VOCAB, generator=torch.Generator().manual_seed(seed + i)), -1)
                  if k and rng.random() < 0.5 else None)
    hidden = torch.randn(sum(s.seqlen_q for s in seqs), HIDDEN, generator=torch.Generator().manual_seed(seed))
    return seqs, drafts, qs, hidden


@pytest.mark.parametrize("mode, top_k_space", [("strict", False), ("rejection", False), ("strict", True), ("rejection", True)])
def test_replay_equals_eager_with_mixed_draft_lengths_at_every_bucket(mode, top_k_space):
    options = dict(verify_mode=mode, top_k_space_verify=top_k_space)
    replayed, eager = _engine(**options), _engine(**options, use_graphs=False)
    for n in (1, 2, 3, 4, 5, 7, 8, 9):
        seqs, drafts, qs, hidden = _mixed_batch(n, seed=40 + n)
        q_arg = qs if mode == "rejection" else None
        a = replayed.step(hidden, seqs, drafts, q_arg)
        b = eager.step(hidden, seqs, drafts, q_arg)
        assert (a.tokens, a.num_accepted, a.logprobs) == (b.tokens, b.num_accepted, b.logprobs)
        for s, toks, acc in zip(seqs, a.tokens, a.num_accepted):
            assert len(toks) == acc + 1 and acc <= s.seqlen_q - 1


def test_rejection_mode_accepts_drafts_the_target_agrees_with():
    """A draft equal to a greedy row's argmax has p(d) = 1: always accepted;
    a draft with p(d) = 0 (outside top_k = 1) is always rejected."""
    engine = _engine(verify_mode="rejection")
    hidden = torch.randn(1 + K, HIDDEN)
    greedy = SamplingParams(temperature=0.0)
    plain = engine.step(hidden, [_decode("g", K, params=greedy)], [[0, 0, 0]])
    argmaxes = torch.argmax(hidden @ _weight().T, dim=-1).tolist()
    assert plain.tokens[0][0] == argmaxes[0]
    right = engine.step(hidden, [_decode("g", K, params=greedy)], [argmaxes[:K]])
    assert right.num_accepted == [K] and right.tokens[0] == argmaxes
    wrong = [(t + 1) % VOCAB for t in argmaxes[:K]]
    rejected = engine.step(hidden, [_decode("g", K, params=greedy)], [wrong])
    assert rejected.num_accepted == [0] and rejected.tokens[0] == argmaxes[:1]


def test_top_k_space_mode_applies_to_prompt_logprobs():
    """docs/contract.md §2.1: in top-k-space mode a prompt-logprob target outside the
    request's top-k reads -inf; inside, it is renormalised over the top-k."""
    hidden = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(9))
    prompt = list(range(6))
    params = SamplingParams(top_k=1, prompt_logprobs=True)
    seq = SeqMeta("p", True, 6, 6, 6, prompt_tokens=prompt, params=params)
    plain = _engine().step(hidden, [seq]).prompt_logprobs[0]
    spaced = _engine(top_k_space_verify=True).step(hidden, [seq]).prompt_logprobs[0]
    argmax = torch.argmax(hidden @ _weight().T, dim=-1).tolist()
    for j, (a, b) in enumerate(zip(plain, spaced)):
        assert a.token == b.token == prompt[j + 1]
        if argmax[j] == prompt[j + 1]:
            assert b.logprob == 0.0  # the only token of a top-1 space
        else:
            assert b.logprob == float("-inf") and a.logprob > float("-inf")
