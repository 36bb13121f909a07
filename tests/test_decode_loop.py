"""The decode loop end to end on the tiny built-in model (issue 6 item 7):
graphs on/off, alone vs in a crowd, speculation on/off and chunked prefill
all give identical completions; bad requests are rejected at submission."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.decode_loop import DecodeLoop, LoopConfig, generate, propose_ngram_drafts
from engine.models.llama import LlamaConfig, LlamaModel, random_weights
from engine.models.protocol import ForwardBatch

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


def _run(prompts, params, *, drafts=0, graphs=True, max_num_reqs=8, token_budget=64, arrivals=None, num_slots=8,
         **loop_options):
    loop = DecodeLoop(
        tiny_model(num_slots),
        LoopConfig(max_num_reqs=max_num_reqs, token_budget=token_budget, max_draft_tokens=drafts, **loop_options),
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


def shared_prefix_prompts(n: int, seed: int = 3):
    """Chat-like prompts: one of two 'system prompts' (20 and 30 tokens, sharing their
    first 12), then a distinct user part; params mix greedy, sampled, logprobs and one
    prompt-logprobs request (which computes its whole prompt and never takes a prefix)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, CONFIG.vocab_size, 20).tolist()]
    systems.append(systems[0][:12] + rng.integers(3, CONFIG.vocab_size, 18).tolist())
    prompts, params = [], []
    for i in range(n):
        prompts.append(systems[i % 2] + rng.integers(3, CONFIG.vocab_size, int(rng.integers(1, 9))).tolist())
        params.append(SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=8, logprobs=1,
                                     prompt_logprobs=i == 2))
    return prompts, params


def test_prefix_sharing_changes_no_completion_and_skips_the_shared_prefill():
    prompts, params = shared_prefix_prompts(10)
    computed, off = _run(prompts, params, prefix_sharing=False)
    shared, on = _run(prompts, params, min_shared_prefix=16)
    assert shared == computed
    assert off.stats.shared_prefix_tokens == 0
    total = sum(map(len, prompts))
    assert off.stats.prefill_tokens == total
    assert on.stats.prefill_tokens + on.stats.shared_prefix_tokens == total
    # Requests 0 and 1 compute their system prompts; request 2 wants prompt logprobs and
    # computes everything; every other one copies its 20- or 30-token system prompt.
    assert on.stats.shared_prefix_tokens == sum(20 if i % 2 == 0 else 30 for i in range(3, len(prompts)))
    assert computed[2][2] is not None and len(computed[2][2]) == len(prompts[2]) - 1


def test_prefix_sharing_alone_and_in_a_staggered_crowd_agree_with_a_short_lived_donor():
    prompts, params = shared_prefix_prompts(12, seed=4)
    params[0] = SamplingParams(temperature=0.0, max_tokens=1)  # the first donor finishes at its first token
    arrivals = [(i * 3) % 5 for i in range(12)]
    crowd, loop = _run(prompts, params, arrivals=arrivals, token_budget=24, min_shared_prefix=8)
    assert loop.stats.shared_prefix_tokens > 0
    for i in (1, 5, 11):
        alone, _ = _run([prompts[i]], [params[i]], max_num_reqs=1, token_budget=16, num_slots=1)
        assert alone[0] == crowd[i]


def test_a_prefix_shorter_than_the_minimum_is_computed():
    prompts, params = shared_prefix_prompts(6)
    _, loop = _run(prompts, params, min_shared_prefix=31)  # longer than either system prompt
    assert loop.stats.shared_prefix_tokens == 0
    assert loop.stats.prefill_tokens == sum(map(len, prompts))


def test_copy_prefix_equals_prefilling_and_checks_its_slots():
    model = tiny_model()
    prompt = list(range(3, 40))
    src, dst, other = model.allocate_slot(), model.allocate_slot(), model.allocate_slot()
    for slot in (src, other):
        batch = ForwardBatch.of([slot], [len(prompt)], [len(prompt)])
        model.forward(torch.tensor(prompt), batch.positions(), batch)
    model.copy_prefix(src, dst, 25)
    for cache in (*model.k_cache, *model.v_cache):
        assert torch.equal(cache[dst, :25], cache[other, :25])  # bit-identical in batch-invariant mode
    with pytest.raises(ValueError, match="dst_slot=7 is not an allocated"):
        model.copy_prefix(src, 7, 5)
    with pytest.raises(ValueError, match="length=9999"):
        model.copy_prefix(src, dst, 9999)
    with pytest.raises(ValueError, match="both"):
        model.copy_prefix(src, src, 5)


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


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(max_num_reqs=0), "max_num_reqs=0"),
        (dict(min_shared_prefix=0), "min_shared_prefix=0"),
        (dict(prefix_sharing="yes"), "prefix_sharing='yes'"),
        (dict(max_num_reqs=8, token_budget=8, max_draft_tokens=1), "token_budget=8"),
    ],
)
def test_loop_config_errors_name_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        LoopConfig(**options)


def _multi_turn(sharing: bool, num_slots: int = 4):
    """Turn 1 runs to completion; turn 2 (the whole conversation plus a new message) arrives
    after it finished, next to unrelated requests that keep the two slots busy and evict."""
    weights = random_weights(CONFIG, seed=0)
    weights.embed = weights.embed * 0.05  # flat logits: every logprob moves with any change to a hidden state
    model = LlamaModel(CONFIG, weights, num_slots=num_slots, batch_invariant=True)
    loop = DecodeLoop(model, LoopConfig(max_num_reqs=2, token_budget=64, prefix_sharing=sharing),
                      engine_config=EngineConfig(device="cpu"))
    first = np.random.default_rng(5).integers(3, CONFIG.vocab_size, 30).tolist()
    loop.submit("turn1", first, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while "turn1" not in loop.finished:
        loop.step()
    second = first + loop.finished["turn1"].tokens + [5, 6, 7]
    loop.submit("turn2", second, SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=1),
                arrival_step=loop.stats.steps)
    for i in range(4):
        loop.submit(f"other{i}", [200 + i] * 20, SamplingParams(temperature=0.0, max_tokens=4),
                    arrival_step=loop.stats.steps + i)
    done = loop.run()
    return {rid: (c.tokens, c.logprobs) for rid, c in done.items()}, loop


def test_a_follow_up_turn_reuses_the_finished_conversation_cache():
    shared, loop = _multi_turn(True)
    computed, off = _multi_turn(False)
    assert shared == computed
    assert off.stats.shared_prefix_tokens == 0
    # turn 2 copies turn 1's prompt and 11 of its 12 tokens (the last one was never fed back)
    assert loop.stats.shared_prefix_tokens == 30 + 11
    assert not loop.retained and len(loop.model._free_slots) == loop.model.num_slots  # run() gave them back


def test_retained_caches_give_their_slots_up_when_the_model_runs_out():
    shared, loop = _multi_turn(True, num_slots=2)  # turn 1's cache is evicted by the others
    computed, _ = _multi_turn(False, num_slots=2)
    assert shared == computed
    assert len(loop.model._free_slots) == 2
