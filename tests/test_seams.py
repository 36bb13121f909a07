"""Wrong data found on the seams between the engine's paths (issue 34), each pinned by a test.

The oracles are computed here from the hidden states and the weight in float64, with no
engine code: a token's raw logprob is the log-softmax of the unprocessed logits, its rank
1 + the number of tokens with a strictly larger logit.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.sampling.sampler import SamplerConfig
from engine.step.batch import PersistentBatch

VOCAB, HIDDEN = 64, 16


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _raw_oracle(hidden: torch.Tensor, weight: torch.Tensor, token: int) -> tuple[float, int]:
    logits = hidden.double() @ weight.double().T  # [V]
    logprob = float(torch.log_softmax(logits, -1)[token])
    return logprob, 1 + int((logits > logits[token]).sum())


def _rejection_engine(mode: str, kernels: str = "torch") -> StepEngine:
    """Logits of about unit scale, where token 7 (the banned draft) is the likeliest by far."""
    weight = _weight() * 0.25
    weight[7] = 0.0
    weight[7, 0] = 4.0
    return StepEngine(weight, EngineConfig(
        max_num_reqs=4, max_draft_tokens=1, verify_mode="rejection", device="cpu", kernels=kernels,
        sampler=SamplerConfig(max_logprobs=8, logprobs_mode=mode), max_control_slots=4))


def _residual_steps(engine: StepEngine, params: SamplingParams, banned: int, steps: int = 12):
    """Decode steps of one request whose draft is `banned` (a token its controls rule out,
    so p(draft) = 0, the draft is always rejected, and the emitted token is drawn from the
    residual): (hidden row of the emitted token, the emitted TokenLogprob) per step."""
    gen = torch.Generator().manual_seed(3)
    batch = PersistentBatch(engine)
    out = []
    for step in range(steps):
        rid = f"r{step}"
        batch.add(rid, [1, 2, 3, 4], params)
        prefill = batch.prepare([rid], [4], [4])
        batch.record(prefill, engine.run(torch.randn(4, HIDDEN, generator=gen), prefill.inputs, prefill.arrays))
        hidden = torch.randn(2, HIDDEN, generator=gen)
        hidden[:, 0] = 1.0
        decode = batch.prepare([rid], [2], [6], draft_tokens=[[banned]])
        result = engine.run(hidden, decode.inputs, decode.arrays)
        assert result.errors == [None] and result.num_accepted == [0]
        (emitted,) = result.logprobs[0]
        out.append((hidden[0], emitted))
        batch.remove(rid)
    return out


@pytest.mark.parametrize("control", ["bad_words", "allowed_token_ids"])
def test_a_residual_draw_reports_its_raw_logprob_and_rank(control):
    """Defect 1: with a bitmask (bad words) and no control slot, the masked graph rewrote the
    logits in place and the residual draw was rescored from the masked logits."""
    engine = _rejection_engine("raw")
    banned = 7
    params = SamplingParams(temperature=1.0, seed=11, logprobs=3, max_tokens=8,
                            **({"bad_words": [[banned]]} if control == "bad_words"
                               else {"allowed_token_ids": [t for t in range(VOCAB) if t != banned]}))
    for hidden, emitted in _residual_steps(engine, params, banned):
        logprob, rank = _raw_oracle(hidden, engine.weight, emitted.token)
        assert emitted.token != banned
        assert math.isclose(emitted.logprob, logprob, abs_tol=1e-4), (emitted, logprob)
        assert emitted.rank == rank, (emitted, rank)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_residual_draw_in_processed_mode_reports_its_processed_logprob(kernels):
    """Defect 3: in processed mode, the residual draw reported its raw logprob while the same
    token in its own top-N showed the processed one. A row's top-N (8 of 64 tokens, top_k 8,
    temperature 1.5) holds every kept token, so the emitted one is among them."""
    engine = _rejection_engine("processed", kernels)
    banned = 7
    params = SamplingParams(temperature=1.5, top_k=8, seed=5, logprobs=8, max_tokens=8, bad_words=[[banned]])
    # Three steps in Triton's interpreter (each a residual draw, about 8 s there), eight on torch.
    for _, emitted in _residual_steps(engine, params, banned, steps=8 if kernels == "torch" else 3):
        top = dict(emitted.top)
        assert emitted.token in top, emitted
        assert emitted.logprob == top[emitted.token], emitted
        assert emitted.rank == 1 + sum(lp > emitted.logprob for lp in top.values()), emitted


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_processed_top_n_holds_real_token_ids_when_few_tokens_are_kept(kernels):
    """Defect 2: with fewer kept tokens than N the torch head padded top-N with id -1 (and a
    text front failed decoding it); vLLM lists real tokens at -inf. Both heads: the kept
    tokens first, then the smallest other ids at -inf."""
    engine = StepEngine(_weight(), EngineConfig(max_num_reqs=2, device="cpu", kernels=kernels,
                                                sampler=SamplerConfig(max_logprobs=8, logprobs_mode="processed")))
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1))
    seq = SeqMeta(request_id="a", is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, num_generated=1,
                  params=SamplingParams(temperature=1.0, top_k=3, seed=1, logprobs=8))
    (emitted,) = engine.step(hidden, [seq]).logprobs[0]
    ids = [t for t, _ in emitted.top]
    values = [lp for _, lp in emitted.top]
    assert len(set(ids)) == 8 and all(0 <= t < VOCAB for t in ids), ids
    assert all(v > -math.inf for v in values[:3]) and all(v == -math.inf for v in values[3:]), values
    kept = set(ids[:3])
    assert ids[3:] == [t for t in range(VOCAB) if t not in kept][:5], ids


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_control_that_overflows_a_logit_fails_the_row_not_token_0(kernels):
    """Defect 4: repetition_penalty=1e-30 on a prompt token turns a finite logit into +inf;
    the row drew token 0 with no error and NaN processed logprobs. Now it fails with its
    RowError, and the request beside it is untouched."""
    weight = torch.zeros(VOCAB, HIDDEN)
    weight[5, 0] = 1.0
    weight[9, 0] = -1.0
    engine = StepEngine(weight, EngineConfig(max_num_reqs=2, device="cpu", kernels=kernels, max_control_slots=2,
                                             sampler=SamplerConfig(max_logprobs=2, logprobs_mode="processed")))
    hidden = torch.zeros(2, HIDDEN)
    hidden[:, 0] = 1e9  # token 5's logit is 1e9, token 9's -1e9
    bad = SamplingParams(temperature=1.0, seed=1, repetition_penalty=1e-30, logprobs=1)
    good = SamplingParams(temperature=1.0, seed=1, logprobs=1)
    seqs = [SeqMeta(request_id="bad", is_prompt=True, seqlen_q=4, seqlen_k=4, prompt_len=4,
                    prompt_tokens=[5, 9, 1, 2], params=bad),
            SeqMeta(request_id="good", is_prompt=True, seqlen_q=4, seqlen_k=4, prompt_len=4,
                    prompt_tokens=[5, 9, 1, 2], params=good)]
    out = engine.step(hidden.repeat_interleave(4, 0)[:8], seqs)
    assert out.tokens[0] == [] and out.errors[0] is not None and "bad" in out.errors[0], out
    assert out.tokens[1] == [5] and out.errors[1] is None, out
    assert not math.isnan(out.logprobs[1][0].logprob)


def test_two_batches_on_one_engine_keep_their_own_partial_prompt_logprobs():
    """Defect 5: two PersistentBatches on one StepEngine shared the prompt-logprob
    accumulator; adding "a" to the second dropped the first's partial values."""
    engine = StepEngine(_weight(), EngineConfig(max_num_reqs=2, device="cpu"))
    first, second = PersistentBatch(engine), PersistentBatch(engine)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=4)
    prompt = [1, 2, 3, 4, 5, 6]
    first.add("a", prompt, params)
    hidden = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    step = first.prepare(["a"], [3], [3])
    out = engine.run(hidden[:3], step.inputs, step.arrays)
    first.record(step, out)
    second.add("a", prompt, params)  # another batch's request of the same id
    step = first.prepare(["a"], [3], [6])
    out = engine.run(hidden[3:], step.inputs, step.arrays)
    assert out.errors == [None]
    assert len(out.prompt_logprobs[0]) == len(prompt) - 1
