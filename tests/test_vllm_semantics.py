"""Where `SamplingParams` uses vLLM's names it has vLLM's semantics (issue 26):
the four cases where the engine once differed from vLLM V1's `Sampler`, each
the issue's minimal case, through the public path (a `PersistentBatch` step
on an engine whose LM head is the identity, so the hidden row is the logits
row), through the independent reference the other tests check the engine
against (`tests.controls_reference`, the bad-words plain loop of
test_token_constraints, the numpy sampler reference as test_replay builds its
rows) and, for the kept set, through every path that applies the filters.

The side-by-side run against vLLM itself is tests/test_vllm_side_by_side.py
(in the peer venv).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.step.batch import PersistentBatch
from engine.sampling.exact import kept_sets, sample_reference
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sampler import SamplerConfig, sample
from engine.sampling.verify import target_probs
from tests import numpy_sampler_reference as ref
from tests.controls_reference import controlled_row
from tests.test_replay import EOS as REPLAY_EOS
from tests.test_replay import reference_rows
from tests.test_token_constraints import banned_by_loop


def emitted(steps: list[list[float]], prompt: list[int], params: SamplingParams, **config: object
            ) -> list[int] | str:
    """The token a request emits at each step, on an engine whose logits row at step i
    is `steps[i]` (a prefill step first, then decode steps); the error of a failed step."""
    vocab = len(steps[0])
    options = dict(max_num_reqs=1, max_control_slots=1, device="cpu", use_graphs=False, eos_token_id=None,
                   sampler=SamplerConfig(candidate_cap=4, max_logprobs=2))
    options.update(config)
    engine = StepEngine(torch.eye(vocab), EngineConfig(**options))
    batch = PersistentBatch(engine)
    batch.add("r", prompt, params)
    tokens = []
    for logits in steps:
        q, k = (len(prompt), len(prompt)) if not tokens else (1, len(prompt) + len(tokens))
        step = batch.prepare(["r"], [q], [k])
        out = engine.run(torch.tensor([logits] * q, dtype=torch.float32), step.inputs, step.arrays)
        batch.record(step, out)
        if out.errors[0] is not None:
            return out.errors[0]
        tokens += out.tokens[0]
    return tokens


def test_logit_bias_is_added_before_the_repetition_penalty():
    # vLLM: 2.0 + 1 = 3.0, then / 2 = 1.5 < 1.6. Penalty first would give 2.0 / 2 + 1 = 2.0.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0})
    assert emitted([[2.0, 1.6, -5.0, -5.0]], [0], params) == [1]


def test_the_controls_reference_adds_the_bias_before_the_repetition_penalty():
    row = controlled_row(np.array([2.0, 1.6, -5.0, -5.0], np.float32), [0], [], repetition_penalty=2.0,
                         logit_bias={0: 1.0})
    assert row[0] == np.float32(1.5) and row[1] == np.float32(1.6) and int(np.argmax(row)) == 1


def test_bad_words_match_their_prefix_on_the_output_only():
    # The prompt ends with 7, the word's prefix: vLLM still allows 9 (no output yet).
    logits = [-5.0] * 10
    logits[8], logits[9] = 1.0, 2.0
    params = SamplingParams(temperature=0.0, bad_words=((7, 9),))
    assert emitted([logits], [5, 7], params) == [9]
    # Once the output ends with 7, 9 is banned.
    seven = [-5.0] * 7 + [3.0, -5.0, -5.0]
    assert emitted([seven, logits], [5, 7], params) == [7, 8]


def test_the_bad_words_reference_reads_the_output_only():
    # test_token_constraints builds the plain loop's context from the output and the drafts, never the prompt.
    assert banned_by_loop([], [(7, 9)]) == set()
    assert banned_by_loop([7], [(7, 9)]) == {9}


def test_min_tokens_holds_eos_back_even_with_ignore_eos():
    eos = 0
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert emitted([[2.0, 1.0, -5.0, -5.0]], [3], params, eos_token_id=eos) == [1]
    # Stop ids too; after min_tokens, EOS is an ordinary token (ignore_eos: it does not stop).
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=(1,))
    assert emitted([[2.0, 1.5, 1.0, -5.0]] * 3, [3], params, eos_token_id=eos) == [2, 2, eos]


def test_allowed_tokens_and_the_bitmask_meet_and_a_row_they_empty_fails_as_the_bitmasks():
    # The allowed set and the bad words are two masks over one row, whichever order.
    logits = [3.0, 2.0, 1.0, 0.5, 0.0, -1.0]
    params = SamplingParams(temperature=0.0, allowed_token_ids=(1, 2, 4), bad_words=((1,),))
    assert emitted([logits], [5], params) == [2]
    # Nothing left between them: the request fails as the bitmask's (the allowed set alone leaves tokens).
    params = SamplingParams(temperature=0.0, allowed_token_ids=(1, 2), bad_words=((1,), (2,)))
    assert "no token allowed by the token bitmask" in emitted([logits], [5], params)


def test_the_replay_reference_holds_eos_back_even_with_ignore_eos():
    # test_replay's numpy rows for a one-token prefill: EOS 2.0, token 1 1.0, min_tokens=2, ignore_eos.
    vocab = 8
    logits = np.full((1, vocab), -5.0, np.float32)
    logits[0, REPLAY_EOS], logits[0, 1] = 2.0, 1.0
    weight = np.eye(vocab, dtype=np.float32)
    for ignore_eos in (True, False):
        params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=ignore_eos)
        seq = SeqMeta("r", True, 1, 1, 1, [3], params=params)
        [(emits, [row])] = reference_rows(weight, logits, [seq])
        assert emits and row.token == 1


# Probabilities [0.5, 0.28, 0.12, 0.1], top_p=0.8, min_p=0.21: min-p first drops 0.1
# (< 0.21 * 0.5), top-p then needs 0.8 of the remaining 0.9: {0, 1}. Top-p first kept {0, 1, 2}.
MIN_P_CASE = dict(probs=[0.5, 0.28, 0.12, 0.1], top_p=0.8, min_p=0.21, kept=[0, 1])


def _min_p_case_params(rows: int = 1) -> RowParams:
    return RowParams.from_numpy(
        temperatures=np.ones(rows, np.float32), top_ks=np.zeros(rows, np.int32),
        top_ps=np.full(rows, MIN_P_CASE["top_p"], np.float32), min_ps=np.full(rows, MIN_P_CASE["min_p"], np.float32),
        seeds=np.arange(rows, dtype=np.uint64), sample_positions=np.zeros(rows, np.int64),
        row_to_req=np.arange(rows), local_step=np.zeros(rows, np.int64))


def _listed_with_mass(out) -> list[int]:
    """The processed top-N's tokens of finite logprob: the kept set (the ids past it are listed at -inf)."""
    return [t for t, lp in zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()) if lp > -math.inf]


def _min_p_case_logits() -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in MIN_P_CASE["probs"]]], dtype=torch.float32)


@pytest.mark.parametrize("path", ["sampler", "variants", "reference", "kept_sets", "verify", "numpy"])
def test_min_p_applies_before_top_p(path):
    logits, params = _min_p_case_logits(), _min_p_case_params()
    cfg = SamplerConfig(candidate_cap=4, max_logprobs=4, logprobs_mode="processed")
    if path == "sampler":
        kept = _listed_with_mass(sample(logits, params, cfg))
    elif path == "variants":  # the weights-only pass (no kept mask): the draws land only on the kept set
        many = _min_p_case_params(4000)
        out = sample(logits.expand(4000, 4), many, SamplerConfig(candidate_cap=4, max_logprobs=0, top_k="none"),
                     compute_logprobs=False)
        kept = sorted(set(out.tokens.tolist()))
    elif path == "reference":
        kept = _listed_with_mass(sample_reference(logits, params, cfg))
    elif path == "kept_sets":
        kept = torch.nonzero(kept_sets(logits, params)[0]).flatten().tolist()
    elif path == "verify":
        kept = torch.nonzero(target_probs(logits, params)[0] > 0).flatten().tolist()
    else:
        spec = ref.RowSpec(temperature=1.0, top_p=MIN_P_CASE["top_p"], min_p=MIN_P_CASE["min_p"])
        kept = np.flatnonzero(ref.sample_row(logits[0].numpy(), spec, mode="processed").kept).tolist()
    assert kept == MIN_P_CASE["kept"]
