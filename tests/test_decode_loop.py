"""The decode loop end to end on the tiny built-in model (issue 6 item 7):
graphs on/off, alone vs in a crowd, speculation on/off and chunked prefill
all give identical completions; bad requests are rejected at submission."""
from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, SamplingParams
from engine.decode_loop import DecodeLoop, LoopConfig, generate, propose_ngram_drafts
from engine.models.llama import LlamaConfig, LlamaModel

CONFIG = LlamaConfig.tiny()


def tiny_model(num_slots: int = 8) -> LlamaModel:
    # Batch-invariant forward: row blocks and per-request attention in a
    # fixed order, so a request's hidden states ignore its batch neighbours.
    return LlamaModel.random(CONFIG, seed=0, num_slots=num_slots, batch_invariant=True)


def prompts_and_params(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        # Repetitive prompts give the n-gram drafter something to find.
        motif = rng.integers(3, CONFIG.vocab_size, int(rng.integers(2, 5))).tolist()
        prompts.append((motif * 4)[: int(rng.integers(3, 14))])
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=10))
        else:
            params.append(SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=i, max_tokens=10,
                                         logprobs=2, prompt_logprobs=i % 2 == 0, min_tokens=2))
    return prompts, params


def _run(prompts, params, *, drafts=0, graphs=True, max_num_reqs=8, token_budget=64, arrivals=None, num_slots=8):
    loop = DecodeLoop(
        tiny_model(num_slots),
        LoopConfig(max_num_reqs=max_num_reqs, token_budget=token_budget, max_draft_tokens=drafts),
        engine_config=EngineConfig(device="cpu", use_graphs=graphs),
    )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p, arrival_step=0 if arrivals is None else arrivals[i])
    done = loop.run()
    return [(c.tokens, c.logprobs, c.prompt_logprobs, c.seed, c.finish_reason) for _, c in sorted(done.items())], loop


def test_graphs_on_and_off_and_speculation_on_and_off_agree():
    prompts, params = prompts_and_params(6)
    base, _ = _run(prompts, params)
    no_graphs, _ = _run(prompts, params, graphs=False)
    spec, loop = _run(prompts, params, drafts=3, token_budget=64)
    assert no_graphs == base
    assert spec == base
    assert loop.stats.drafts_proposed > 0  # the drafter really proposed something
    assert all(len(tokens) == 10 or reason == "stop" for tokens, *_, reason in base)


def test_a_request_is_the_same_alone_and_in_a_staggered_crowd_of_32():
    prompts, params = prompts_and_params(32, seed=1)
    crowd, loop = _run(prompts, params, max_num_reqs=16, token_budget=96, num_slots=16,
                       arrivals=[(i * 5) % 11 for i in range(32)])
    assert max(loop.engine.stats.bucket_histogram) > 1  # batches really mixed
    for i in (0, 7, 31):
        alone, _ = _run([prompts[i]], [params[i]], max_num_reqs=1, token_budget=16, num_slots=1)
        assert alone[0] == crowd[i]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(chunk):
    prompt = list(range(5, 5 + 23))
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=6, prompt_logprobs=2, logprobs=1)]
    one_shot, _ = _run([prompt], params, max_num_reqs=1, token_budget=64)
    chunked, loop = _run([prompt], params, max_num_reqs=1, token_budget=chunk)
    assert chunked == one_shot
    assert len(chunked[0][2]) == len(prompt) - 1


def test_bad_requests_are_rejected_at_submission_without_disturbing_running_ones():
    prompts, params = prompts_and_params(3)
    reference, _ = _run(prompts, params)
    loop = DecodeLoop(tiny_model(), LoopConfig(max_num_reqs=4, token_budget=32), engine_config=EngineConfig(device="cpu"))
    for i in range(3):
        loop.submit(i, prompts[i], params[i])
    loop.step()
    loop.step()
    bad = [
        (lambda: loop.submit("empty", [], SamplingParams()), "request 'empty': prompt is empty"),
        (lambda: loop.submit("long", [1] * CONFIG.max_position, SamplingParams()), "request 'long': prompt"),
        (lambda: loop.submit("oov", [1, CONFIG.vocab_size], SamplingParams()), r"request 'oov': prompt_tokens\[1\]"),
        (lambda: loop.submit(0, [1, 2], SamplingParams()), "request 0: request_id was already submitted"),
        (lambda: loop.submit("lp", [1, 2], SamplingParams(logprobs=500)), "request 'lp': params.logprobs=500"),
        (lambda: loop.submit("st", [1, 2], SamplingParams(stop_token_ids=tuple(range(3, 12)))),
         "request 'st': params.stop_token_ids: 10 stop ids"),
        (lambda: loop.submit("sv", [1, 2], SamplingParams(stop_token_ids=(CONFIG.vocab_size,))),
         "request 'sv': params.stop_token_ids"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="top_p=2"):
        SamplingParams(top_p=2)
    done = loop.run()
    assert [(c.tokens, c.logprobs, c.prompt_logprobs, c.seed, c.finish_reason) for _, c in sorted(done.items())] == reference


def test_requests_wait_for_kv_cache_slots():
    """More running room than KV-cache slots: the extra requests wait for a
    slot instead of failing the step, and complete identically."""
    prompts, params = prompts_and_params(5)
    reference, _ = _run(prompts, params, max_num_reqs=8, num_slots=8)
    constrained, loop = _run(prompts, params, max_num_reqs=8, num_slots=2)
    assert constrained == reference


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    history = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert propose_ngram_drafts(history, 2, 3) == [7, 8]  # latest earlier "1 2 3" is followed by 7 8
    assert propose_ngram_drafts(np.array([4, 5, 6]), 2, 3) == []
    assert propose_ngram_drafts(np.array([5, 1, 5]), 3, 3) == [1, 5]  # falls back to a 1-gram


def test_generate_returns_completions_in_prompt_order():
    prompts, params = prompts_and_params(3)
    out = generate(tiny_model(), prompts, params, config=LoopConfig(max_num_reqs=4, token_budget=32),
                   engine_config=EngineConfig(device="cpu"))
    assert [c.request_id for c in out] == [0, 1, 2]
    assert all(c.seed is not None for c in out)
