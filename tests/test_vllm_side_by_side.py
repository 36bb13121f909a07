"""Side by side with vLLM V1's `Sampler` (issue 26): where `SamplingParams` uses
vLLM's names, the engine has vLLM's semantics.

Random batches of requests, each with a prompt, an output history and random
controls (temperature, top-k, top-p, min-p, repetition / presence / frequency
penalties, logit bias, allowed tokens, bad words, min_tokens with stop ids and
EOS, ignore_eos), one logits row each. Ours: one step of a `StepEngine`
whose LM head is the identity (the hidden row is the logits row), through a
`PersistentBatch` seeded with the history (the penalty counts, the number
generated, the bad words' output), with processed logprobs. vLLM's: its
`Sampler` over the same logits with the `SamplingMetadata` its persistent
input batch would build from vLLM's own `SamplingParams` (and its built-in
logits processors, fed a `BatchUpdate`). Greedy rows must emit the same
token, and every row's processed top-5 must agree within 1e-5 (the same ids,
up to the order of equal values; where we list fewer kept tokens than five,
vLLM's entries there are -inf).

Needs vLLM: runs in the peer venv (`make peer-venv`), skipped elsewhere:

    PYTHONPATH=$PWD .venv-peer/bin/python -m pytest tests/test_vllm_side_by_side.py

`ENGINE_LONG_TESTS=1` adds a run over 300 random cases that prints how many
rows agree.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, StepEngine
from engine.step.batch import PersistentBatch
from engine.sampling.sampler import SamplerConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not importable here (make peer-venv; run under .venv-peer)")

EOS = 1
MAX_BATCH = 4
NUM_TOP = 5
LOGPROB_ATOL = 1e-5


@dataclass
class Request:
    prompt: list[int]
    output: list[int]  # the tokens generated before this step
    params: SamplingParams  # ours; vLLM's is built from the same fields
    hot: np.ndarray  # a few token ids the prompt, the output, the words and the bias share


def random_request(rng: np.random.Generator, vocab: int) -> Request:
    # A few "hot" tokens make the controls meet: the prompt and the output repeat them,
    # the bad words and the bias name them, and the logits rank them high.
    hot = rng.choice(vocab, 6, replace=False)
    prompt = rng.choice(np.concatenate([hot, rng.integers(0, vocab, 4)]), int(rng.integers(1, 9))).tolist()
    output = rng.choice(hot, int(rng.choice([0, 0, 1, 2, 4, 6]))).tolist()  # short ones: words meet the prompt's end
    greedy = rng.random() < 0.35
    words = None
    if rng.random() < 0.5:
        words = tuple(tuple(int(t) for t in rng.choice(hot, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 4))))
    allowed = None
    if rng.random() < 0.25:
        allowed = tuple(int(t) for t in rng.choice(vocab, int(rng.integers(2, vocab // 2)), replace=False))
    bias = None
    if rng.random() < 0.4:
        named = rng.choice(np.concatenate([hot, rng.integers(0, vocab, 6)]), int(rng.integers(1, 6)))
        bias = {int(t): float(rng.choice([-3.0, -1.0, 0.5, 1.0, 2.5])) for t in named}
    stops = tuple(int(t) for t in rng.choice(np.arange(2, vocab), int(rng.integers(0, 3)), replace=False))
    params = SamplingParams(
        temperature=0.0 if greedy else float(rng.choice([0.6, 1.0, 1.4])),
        top_k=int(rng.choice([0, 0, 3, 12])),
        top_p=float(rng.choice([1.0, 1.0, 0.9, 0.6])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
        seed=int(rng.integers(0, 2**31)),
        min_tokens=int(rng.choice([0, 0, len(output) + 1, len(output) + 3])),
        ignore_eos=bool(rng.random() < 0.3),
        stop_token_ids=stops,
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3, 0.8, 2.0])),
        presence_penalty=float(rng.choice([0.0, 0.0, 0.5, -0.3])),
        frequency_penalty=float(rng.choice([0.0, 0.0, 0.4, -0.2])),
        logit_bias=bias,
        allowed_token_ids=allowed,
        bad_words=words,
        logprobs=NUM_TOP,
    )
    return Request(prompt, output, params, hot)


def random_case(seed: int) -> tuple[list[Request], np.ndarray]:
    """A batch of requests and their logits rows [B, V] float32: the hot tokens and
    EOS raised, so the controls on them decide the greedy token and the top-5."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([32, 64, 100]))
    requests = [random_request(rng, vocab) for _ in range(int(rng.integers(1, MAX_BATCH + 1)))]
    logits = rng.standard_normal((len(requests), vocab)) * rng.choice([1.0, 2.0, 3.0])
    for row, r in zip(logits, requests):
        row[r.hot] += rng.uniform(1.0, 3.0)
        row[EOS] += rng.uniform(0.0, 3.0)
    return requests, logits.astype(np.float32)


# -- ours ------------------------------------------------------------------------------------


@functools.cache
def engine_for(vocab: int) -> StepEngine:
    """An engine whose logits are its hidden rows (an identity LM head), shared by the cases."""
    return StepEngine(torch.eye(vocab), EngineConfig(
        max_num_reqs=MAX_BATCH, max_control_slots=MAX_BATCH, device="cpu", use_graphs=False, eos_token_id=EOS,
        batch_invariant=False, sampler=SamplerConfig(candidate_cap=vocab, max_logprobs=NUM_TOP, logprobs_mode="processed")))


def ours(requests: list[Request], logits: np.ndarray) -> tuple[list[int | None], list[tuple[tuple[int, float], ...]]]:
    """Each request's token and processed top-5, from one engine step (None, (): a request
    whose controls leave no token, which fails alone)."""
    batch_size, vocab = logits.shape
    engine = engine_for(vocab)
    batch = PersistentBatch(engine)
    ids = list(range(batch_size))
    for i, r in zip(ids, requests):
        row = batch.add(i, r.prompt, r.params)
        if not r.output:
            continue
        # The history, as if the engine had emitted it: counts, num_generated, the bad words' output.
        slot = int(batch.table.control_slot[row])
        if slot:
            engine.controls.counts[slot].index_add_(0, torch.tensor(r.output), torch.ones(len(r.output), dtype=torch.int32))
        batch.table.record_emitted(np.array([row]), np.array([len(r.output)]))
        if row in batch.constraints.of:
            batch.constraints.of[row].advance(r.output)
    q = [len(r.prompt) if not r.output else 1 for r in requests]
    k = [len(r.prompt) + len(r.output) for r in requests]
    step = batch.prepare(ids, q, k)
    hidden = torch.from_numpy(np.repeat(logits, q, axis=0))
    out = engine.run(hidden, step.inputs, step.arrays)
    for i in ids:
        batch.remove(i)  # the engine serves the next case: its control slots go back
    return ([t[0] if t else None for t in out.tokens], [lp[0].top if lp else () for lp in out.logprobs])


# -- vLLM's ------------------------------------------------------------------------------------


def theirs(requests: list[Request], logits: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Each request's token and processed top-5 (ids [B, 5], logprobs [B, 5]) from vLLM's
    `Sampler`, with the `SamplingMetadata` vLLM's persistent input batch builds."""
    import vllm
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    batch_size, vocab = logits.shape
    params = []
    for r in requests:
        p = r.params
        vp = vllm.SamplingParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
            min_tokens=p.min_tokens, ignore_eos=p.ignore_eos, stop_token_ids=list(p.stop_token_ids),
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias) if p.logit_bias else None,
            allowed_token_ids=list(p.allowed_token_ids) if p.allowed_token_ids else None, logprobs=NUM_TOP)
        vp.update_from_generation_config({}, eos_token_id=EOS)  # what vLLM's input processor does
        params.append(vp)
    # As vLLM's persistent input batch: greedy requests (temperature < 1e-5) at temperature 0;
    # top-k off as V; tensors only where some request uses the control.
    greedy = [vp.temperature < 1e-5 for vp in params]
    temperature = torch.tensor([0.0 if g else vp.temperature for g, vp in zip(greedy, params)], dtype=torch.float32)
    top_k = torch.tensor([vp.top_k if 0 < vp.top_k < vocab else vocab for vp in params], dtype=torch.int32)
    top_p = torch.tensor([vp.top_p for vp in params], dtype=torch.float32)
    no_penalties = all(vp.repetition_penalty == 1.0 and vp.presence_penalty == 0.0 and vp.frequency_penalty == 0.0
                       for vp in params)
    longest = max(len(r.prompt) for r in requests)
    prompt_ids = torch.full((batch_size, longest), vocab, dtype=torch.int64)
    for i, r in enumerate(requests):
        prompt_ids[i, : len(r.prompt)] = torch.tensor(r.prompt)
    allowed = None
    if any(vp.allowed_token_ids for vp in params):
        allowed = torch.zeros(batch_size, vocab, dtype=torch.bool)
        for i, vp in enumerate(params):
            if vp.allowed_token_ids:
                allowed[i] = True
                allowed[i, vp.allowed_token_ids] = False
    config = type("Config", (), {"scheduler_config": type("Scheduler", (), {"max_num_seqs": batch_size})()})()
    processors = [MinTokensLogitsProcessor(config, torch.device("cpu"), False),
                  LogitBiasLogitsProcessor(config, torch.device("cpu"), False),
                  MinPLogitsProcessor(config, torch.device("cpu"), False)]
    added = [(i, vp, r.prompt, r.output) for i, (vp, r) in enumerate(zip(params, requests))]
    for processor in processors:
        processor.update_state(BatchUpdate(batch_size=batch_size, removed=[], added=added, moved=[]))
    metadata = SamplingMetadata(
        temperature=None if all(greedy) else temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=top_p if bool((top_p < 1).any()) else None,
        top_k=top_k if bool((top_k < vocab).any()) else None,
        generators={i: torch.Generator().manual_seed(vp.seed) for i, vp in enumerate(params) if not greedy[i]},
        max_num_logprobs=NUM_TOP,
        no_penalties=no_penalties,
        prompt_token_ids=None if no_penalties else prompt_ids,
        frequency_penalties=torch.tensor([vp.frequency_penalty for vp in params], dtype=torch.float32),
        presence_penalties=torch.tensor([vp.presence_penalty for vp in params], dtype=torch.float32),
        repetition_penalties=torch.tensor([vp.repetition_penalty for vp in params], dtype=torch.float32),
        output_token_ids=[list(r.output) for r in requests],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={i: [list(w) for w in r.params.bad_words] for i, r in enumerate(requests)
                             if r.params.bad_words},
        logitsprocs=LogitsProcessors(processors),
    )
    out = Sampler(logprobs_mode="processed_logprobs")(torch.from_numpy(logits.copy()), metadata)
    lp = out.logprobs_tensors
    # Column 0 is the sampled token; the top-N follow.
    return out.sampled_token_ids[:, 0].tolist(), lp.logprob_token_ids[:, 1:].numpy(), lp.logprobs[:, 1:].numpy()


# -- comparing -----------------------------------------------------------------------------------


def top_agrees(our_top: tuple[tuple[int, float], ...], their_ids: np.ndarray, their_lps: np.ndarray) -> bool:
    """Our top-5 (id, logprob) against vLLM's: the logprobs within LOGPROB_ATOL, -inf where
    we list no kept token (past the kept set we list other ids at -inf, or -1), and the
    same kept ids up to the order of equal values."""
    for j, (token, value) in enumerate(our_top):
        theirs_value = float(their_lps[j])
        if token < 0 or value == -math.inf:
            if theirs_value != -math.inf:
                return False
            continue
        if not abs(theirs_value - value) <= LOGPROB_ATOL:
            return False
    ours_by_value = sorted((round(v, 4), t) for t, v in our_top if t >= 0 and v > -math.inf)
    theirs_by_value = sorted((round(float(v), 4), int(t)) for t, v in zip(their_ids, their_lps) if v > -math.inf)
    return ours_by_value == theirs_by_value or {t for _, t in ours_by_value} == {t for _, t in theirs_by_value}


def compare(seed: int) -> tuple[int, int, int, int, list[str]]:
    """(greedy rows, greedy rows agreeing, rows, rows whose top-5 agrees, what differs)."""
    requests, logits = random_case(seed)
    our_tokens, our_tops = ours(requests, logits)
    their_tokens, their_ids, their_lps = theirs(requests, logits)
    greedy = agree_greedy = agree_top = 0
    differs = []
    for i, r in enumerate(requests):
        if our_tokens[i] is None:
            continue  # nothing left to sample: we fail the request, vLLM samples from a row of -inf
        if r.params.temperature == 0.0:
            greedy += 1
            if our_tokens[i] == their_tokens[i]:
                agree_greedy += 1
            else:
                differs.append(f"case {seed} request {i}: greedy token {our_tokens[i]} != vLLM's {their_tokens[i]}")
        if top_agrees(our_tops[i], their_ids[i], their_lps[i]):
            agree_top += 1
        else:
            differs.append(f"case {seed} request {i}: top-5 {our_tops[i]} != vLLM's "
                           f"{list(zip(their_ids[i].tolist(), their_lps[i].tolist()))} ({r.params})")
    return greedy, agree_greedy, len(requests), agree_top, differs


@pytest.mark.parametrize("seed", range(40))
def test_greedy_tokens_and_processed_top5_match_vllms_sampler(seed):
    _, _, _, _, differs = compare(seed)
    assert not differs, "\n".join(differs)


@pytest.mark.skipif(not os.environ.get("ENGINE_LONG_TESTS"), reason="long: set ENGINE_LONG_TESTS=1")
def test_300_random_cases_agree(capsys):
    totals = np.zeros(4, np.int64)
    differs = []
    for seed in range(300):
        *counts, d = compare(1000 + seed)
        totals += counts
        differs += d
    greedy, agree_greedy, rows, agree_top = totals.tolist()
    with capsys.disabled():
        print(f"\n300 cases: greedy tokens {agree_greedy}/{greedy} rows agree, processed top-5 {agree_top}/{rows} rows agree")
        for line in differs[:20]:
            print(line)
    assert not differs
