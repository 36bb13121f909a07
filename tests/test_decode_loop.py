"""The decode loop end to end on the tiny built-in model (issue 6 item 7):
graphs on/off, alone vs in a crowd, speculation on/off and chunked prefill
all give identical completions; bad requests are rejected at submission; the
engine config the loop runs. Hostile submissions, aborts and failed steps
(issue 11) are in tests/test_decode_loop_faults.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.generate import generate
from engine.loop.drafter import propose_ngram_drafts
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, random_weights
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


def run_loop(prompts, params, *, drafts=0, graphs=True, max_num_reqs=8, token_budget=64, arrivals=None, num_slots=8,
         **loop_options):
    loop = DecodeLoop(
        tiny_model(num_slots),
        LoopConfig(seed_base=0, max_num_reqs=max_num_reqs, token_budget=token_budget, max_draft_tokens=drafts, **loop_options),
        engine_config=EngineConfig(device="cpu", use_graphs=graphs),
    )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p, arrival_step=0 if arrivals is None else arrivals[i])
    done = loop.run()
    return [(c.tokens, c.logprobs, c.prompt_logprobs, c.seed, c.finish_reason) for _, c in sorted(done.items())], loop


def test_graphs_on_and_off_and_speculation_on_and_off_agree():
    prompts, params = prompts_and_params(6)
    base, _ = run_loop(prompts, params)
    no_graphs, _ = run_loop(prompts, params, graphs=False)
    spec, loop = run_loop(prompts, params, drafts=3, token_budget=64)
    assert no_graphs == base
    assert spec == base
    assert loop.stats.drafts_proposed > 0  # the drafter really proposed something
    assert all(len(tokens) == 10 or reason == "stop" for tokens, *_, reason in base)


def test_a_request_is_the_same_alone_and_in_a_staggered_crowd_of_32():
    prompts, params = prompts_and_params(32, seed=1)
    crowd, loop = run_loop(prompts, params, max_num_reqs=16, token_budget=96, num_slots=16,
                       arrivals=[(i * 5) % 11 for i in range(32)])
    assert max(loop.engine.stats.bucket_histogram) > 1  # batches really mixed
    for i in (0, 7, 31):
        alone, _ = run_loop([prompts[i]], [params[i]], max_num_reqs=1, token_budget=16, num_slots=1)
        assert alone[0] == crowd[i]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(chunk):
    prompt = list(range(5, 5 + 23))
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=6, prompt_logprobs=2, logprobs=1)]
    one_shot, _ = run_loop([prompt], params, max_num_reqs=1, token_budget=64)
    chunked, loop = run_loop([prompt], params, max_num_reqs=1, token_budget=chunk)
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
    computed, off = run_loop(prompts, params, prefix_sharing=False)
    shared, on = run_loop(prompts, params, min_shared_prefix=16)
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
    crowd, loop = run_loop(prompts, params, arrivals=arrivals, token_budget=24, min_shared_prefix=8)
    assert loop.stats.shared_prefix_tokens > 0
    for i in (1, 5, 11):
        alone, _ = run_loop([prompts[i]], [params[i]], max_num_reqs=1, token_budget=16, num_slots=1)
        assert alone[0] == crowd[i]


def test_a_prefix_shorter_than_the_minimum_is_computed():
    prompts, params = shared_prefix_prompts(6)
    _, loop = run_loop(prompts, params, min_shared_prefix=31)  # longer than either system prompt
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
    reference, _ = run_loop(prompts, params)
    loop = DecodeLoop(tiny_model(), LoopConfig(seed_base=0, max_num_reqs=4, token_budget=32), engine_config=EngineConfig(device="cpu"))
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
    reference, _ = run_loop(prompts, params, max_num_reqs=8, num_slots=8)
    constrained, loop = run_loop(prompts, params, max_num_reqs=8, num_slots=2)
    assert constrained == reference


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    history = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert propose_ngram_drafts(history, 2, 3) == [7, 8]  # latest earlier "1 2 3" is followed by 7 8
    assert propose_ngram_drafts(np.array([4, 5, 6]), 2, 3) == []
    assert propose_ngram_drafts(np.array([5, 1, 5]), 3, 3) == [1, 5]  # falls back to a 1-gram


def test_generate_returns_completions_in_prompt_order():
    prompts, params = prompts_and_params(3)
    out = generate(tiny_model(), prompts, params, config=LoopConfig(seed_base=0, max_num_reqs=4, token_budget=32),
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
    loop = DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=2, token_budget=64, prefix_sharing=sharing),
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
    assert not loop.retained and len(loop.model.kv.slots.free) == loop.model.num_slots  # run() gave them back


def test_retained_caches_give_their_slots_up_when_the_model_runs_out():
    shared, loop = _multi_turn(True, num_slots=2)  # turn 1's cache is evicted by the others
    computed, _ = _multi_turn(False, num_slots=2)
    assert shared == computed
    assert len(loop.model.kv.slots.free) == 2


# -- the engine config the loop runs (issue 13) -------------------------------------------


def test_engine_fields_left_at_their_default_are_filled_in_from_the_loop_and_the_model():
    model = tiny_model()
    loop = DecodeLoop(model, LoopConfig(seed_base=5, max_num_reqs=4, token_budget=40, max_draft_tokens=2),
                      engine_config=EngineConfig(device="cpu", use_graphs=False, seed_base=5), capture=False)
    config = loop.engine.config
    assert (config.max_num_reqs, config.max_draft_tokens, config.max_source_rows) == (4, 2, 40)
    assert config.eos_token_id == model.eos_token_id and config.draft_pool_slots == 1 and config.buckets is None
    assert (config.device, config.use_graphs, config.seed_base) == ("cpu", False, 5)  # the caller's own


def test_engine_fields_the_loop_can_honour_are_kept():
    model = tiny_model()
    given = EngineConfig(device="cpu", max_num_reqs=8, max_draft_tokens=3, max_source_rows=100, buckets=(2, 8),
                         eos_token_id=model.eos_token_id, draft_pool_slots=1, max_control_slots=5)
    loop = DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=4, token_budget=40, max_draft_tokens=2), engine_config=given,
                      capture=False)
    assert loop.engine.config == given
    prompts, params = prompts_and_params(3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    assert [c.tokens for _, c in sorted(loop.run().items())] == [c[0] for c in run_loop(prompts, params)[0]]


@pytest.mark.parametrize("field, value, needs", [
    ("max_num_reqs", 2, r">= LoopConfig.max_num_reqs=4"),
    ("max_draft_tokens", 1, r">= LoopConfig.max_draft_tokens=2"),
    ("max_source_rows", 39, r">= 40, the model-output rows of the loop's largest step"),
    ("eos_token_id", 7, r"the model's eos_token_id=\d+"),
    ("draft_pool_slots", 9, r"1 or None: the loop keeps no draft-info pool"),
    ("compaction_keep_tokens", 4, r"None: the loop's model produces a row for every query token"),
    ("max_control_slots", 2, r">= LoopConfig.max_num_reqs=4 \(a control slot for every running request\)"),
    # The seed base is the loop's (fresh seeds, or LoopConfig(seed_base=...)): one place to set it.
    ("seed_base", 3, r"the seed base from LoopConfig\(seed_base=...\) \(now 0;"),
])
def test_an_engine_field_the_loop_cannot_honour_is_refused_naming_it(field, value, needs):
    with pytest.raises(ValueError, match=rf"EngineConfig.{field}={value}: DecodeLoop needs {needs}"):
        DecodeLoop(tiny_model(), LoopConfig(seed_base=0, max_num_reqs=4, token_budget=40, max_draft_tokens=2),
                   engine_config=EngineConfig(device="cpu", **{field: value}), capture=False)


def test_the_loop_allocates_no_draft_info_slot_and_writes_no_pool():
    prompts, params = prompts_and_params(6)
    loop = DecodeLoop(tiny_model(), LoopConfig(seed_base=0, max_num_reqs=4, token_budget=32, max_draft_tokens=3),
                      engine_config=EngineConfig(device="cpu"))
    assert loop.engine.config.pool_slots == 1 and loop.batch.draft_slots is None
    pool = loop.engine.buffers
    pool.pool_tokens.fill_(11)  # sentinels: any write into the pool shows
    pool.pool_logprobs.fill_(-2.0)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    write_slots = []
    prepare = loop.batch.prepare_rows

    def prepare_and_watch(*args, **kwargs):
        step = prepare(*args, **kwargs)
        write_slots.extend(step.inputs.mtp_info_write_slots.tolist())
        return step

    loop.batch.prepare_rows = prepare_and_watch
    done = loop.run()
    assert loop.stats.drafts_proposed > 0 and len(write_slots) > len(prompts)
    assert set(write_slots) == {0}
    assert (pool.pool_tokens == 11).all() and (pool.pool_logprobs == -2.0).all()
    assert [c.tokens for _, c in sorted(done.items())] == [c[0] for c in run_loop(prompts, params)[0]]
