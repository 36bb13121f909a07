"""The decode loop end to end on the tiny built-in model (issue 6 item 7):
graphs on/off, alone vs in a crowd, speculation on/off and chunked prefill
all give identical completions; bad requests are rejected at submission.
Issue 11: hostile submissions change nothing, abort frees what a request holds,
run() skips idle steps, a step that raises anywhere is undone, and a failed row
finishes only its own request."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.generate import generate
from engine.loop.drafter import propose_ngram_drafts
from engine.loop.requests import StepEvent
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


def _run(prompts, params, *, drafts=0, graphs=True, max_num_reqs=8, token_budget=64, arrivals=None, num_slots=8,
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


# -- hostile submissions, abort, idle clocks, atomic steps, failed rows (issue 11) -------


def loop_state(loop: DecodeLoop) -> dict:
    """Everything a step, a submission or an abort may change, as plain values."""
    def request(r):
        c = r.completion
        return (r.request_id, r.prefilled, r.kv_slot, r.table_row, list(c.tokens),
                None if c.logprobs is None else len(c.logprobs), c.prompt_logprobs, c.seed, c.finish_reason, c.error)

    return dict(
        waiting=[(arrival, request(r)) for arrival, r in loop.waiting],
        running=[request(r) for r in loop.running],
        finished={rid: (c.finish_reason, list(c.tokens)) for rid, c in loop.finished.items()},
        known=set(loop._known),
        retained=[(slot, held.tolist()) for slot, held in loop.retained.items()],
        free_kv_slots=list(loop.model.kv.slots.free),
        table=(dict(loop.batch.table.row_of), loop.batch.table.cols["num_generated"].tolist(), list(loop.batch.table._free)),
        stop_ids=loop.batch.table.stop_ids.tolist(),
        stats=counters(loop.stats),
        engine=(loop.engine.stats.steps, loop.engine.stats.replays, dict(loop.engine.stats.bucket_histogram),
                {rid: len(v) for rid, v in loop.batch.prompt_logprobs.snapshot().items()}),
    )


def assert_no_trace(before: dict, after: dict) -> None:
    """A failed step left the loop as it found it, except that a retained cache whose slot
    it handed to a new request may keep only a prefix of what it held (see `_unadmit`)."""
    assert [slot for slot, _ in after["retained"]] == [slot for slot, _ in before["retained"]]
    for (_, held_after), (_, held_before) in zip(after["retained"], before["retained"]):
        assert held_after == held_before[: len(held_after)]
    assert {k: v for k, v in after.items() if k != "retained"} == {k: v for k, v in before.items() if k != "retained"}


def counters(stats) -> dict:
    """A stats dataclass without its timings."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if not k.endswith("seconds")}


def holds_nothing(loop: DecodeLoop) -> None:
    assert len(loop.batch) == 0 and not loop.running and not loop.retained
    assert sorted(loop.model.kv.slots.free) == list(range(loop.model.num_slots))
    assert loop.batch.prompt_logprobs.pending == ()
    assert (loop.batch.table.stop_ids == -1).all()


def completions(done: dict) -> list:
    return [(rid, c.tokens, c.logprobs, c.prompt_logprobs, c.seed, c.finish_reason) for rid, c in sorted(done.items())]


def _loop(num_slots: int = 8, model=None, **options) -> DecodeLoop:
    config = dict(max_num_reqs=4, token_budget=32)
    config.update(options)
    return DecodeLoop(model or tiny_model(num_slots), LoopConfig(seed_base=0, **config), engine_config=EngineConfig(device="cpu"))


def _reject_all(loop, cases) -> None:
    for args, kwargs, match in cases:
        before = loop_state(loop)
        with pytest.raises(ValueError, match=match):
            loop.submit(*args, **kwargs)
        assert loop_state(loop) == before, (args, kwargs)


V = CONFIG.vocab_size


def test_submit_refuses_malformed_ids_prompts_and_arrivals_and_changes_nothing():
    loop = _loop()
    loop.submit("ok", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    loop.step()  # a running request and a table row exist while the bad submissions come in
    g = SamplingParams()
    _reject_all(loop, [
        ((None, [1, 2], g), {}, "request_id=None: must not be None"),
        (([1, 2], [1, 2], g), {}, r"request_id=\[1, 2\]: must be hashable"),
        ((("a", [1]), [1, 2], g), {}, r"request_id=\('a', \[1\]\): must be hashable"),
        (("ok", [1, 2], g), {}, "request 'ok': request_id was already submitted"),
        (("nest", [[1, 2], [3, 4]], g), {}, r"request 'nest': prompt_tokens\[0\]=\[1, 2\]: must be an int token id"),
        (("float", [5.7, 6.2], g), {}, r"request 'float': prompt_tokens\[0\]=5.7: must be an int token id"),
        (("str", "123", g), {}, r"request 'str': prompt_tokens='123': text, not token ids; encode it first \(tokenizer.encode\(text\)\)"),
        (("bytes", b"12", g), {}, "request 'bytes': prompt_tokens=b'12': must be a sequence of int token ids, not a bytes"),
        (("bool", [True, False], g), {}, r"request 'bool': prompt_tokens\[0\]=True: must be an int token id, not a bool"),
        (("npbool", np.array([1, 0], dtype=bool), g), {}, "request 'npbool': prompt_tokens: a numpy array of bool"),
        (("npfloat", np.array([1.0, 2.0]), g), {}, "request 'npfloat': prompt_tokens: a numpy array of float64"),
        (("np2d", np.ones((2, 2), dtype=np.int64), g), {}, r"request 'np2d': prompt_tokens: shape \(2, 2\)"),
        (("tfloat", torch.tensor([1.0, 2.0]), g), {}, "request 'tfloat': prompt_tokens: a tensor of torch.float32"),
        (("gen", (t for t in [1, 2]), g), {}, "request 'gen': prompt_tokens=<generator"),
        (("set", {1, 2}, g), {}, r"request 'set': prompt_tokens=\{1, 2\}: must be a sequence"),
        (("huge", [3, 2**63], g), {}, r"request 'huge': prompt_tokens\[1\]=9223372036854775808: outside \[0, 256\)"),
        (("uhuge", np.array([3, 2**63], dtype=np.uint64), g), {}, r"request 'uhuge': prompt_tokens\[1\]=9223372036854775808"),
        (("neg", [3, -1], g), {}, r"request 'neg': prompt_tokens\[1\]=-1: outside \[0, 256\)"),
        (("empty", np.zeros(0, dtype=np.int64), g), {}, "request 'empty': prompt is empty"),
        (("params", [1, 2], {"temperature": 0}), {}, "request 'params': params must be SamplingParams, got dict"),
        (("emptyparams", [1, 2], {}), {}, "request 'emptyparams': params must be SamplingParams, got dict"),
        (("none", [1, 2], g), dict(arrival_step=None), "request 'none': arrival_step=None: must be an int >= 0"),
        (("neg", [1, 2], g), dict(arrival_step=-1), "request 'neg': arrival_step=-1: must be an int >= 0"),
        (("true", [1, 2], g), dict(arrival_step=True), "request 'true': arrival_step=True: must be an int >= 0"),
        (("half", [1, 2], g), dict(arrival_step=1.5), "request 'half': arrival_step=1.5: must be an int >= 0"),
    ])
    # What is well formed still goes in: numpy ints (also inside a list), tuples, ranges, tensors.
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    loop.submit("np", np.array([5, 6, 7], dtype=np.int32), greedy, arrival_step=np.int64(1))
    loop.submit("tuple", (np.int64(5), 6, np.uint8(7)), greedy)
    loop.submit("range", range(5, 8), greedy)
    loop.submit("tensor", torch.tensor([5, 6, 7]), greedy)
    done = loop.run()
    assert len({tuple(done[rid].tokens) for rid in ("ok", "np", "tuple", "range", "tensor")}) == 1
    holds_nothing(loop)


def test_a_stop_set_that_covers_the_vocabulary_under_min_tokens_is_refused_at_submit():
    config = LlamaConfig.tiny(vocab_size=32)
    model = LlamaModel.random(config, seed=0, num_slots=2, batch_invariant=True)
    loop = DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=2, token_budget=8),
                      engine_config=EngineConfig(device="cpu", max_stop_ids=32))
    others = tuple(t for t in range(32) if t != config.eos_token_id)  # with EOS: every id
    _reject_all(loop, [
        (("all", [2, 3], SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=others)), {},
         r"request 'all': params.stop_token_ids=\(0, 2, .*, 31\) with EOS cover the whole vocabulary \(32 ids\) while min_tokens=1"),
        # min_tokens holds EOS back even with ignore_eos (as vLLM): no id is left either.
        (("eos", [2, 3], SamplingParams(min_tokens=2, max_tokens=4, ignore_eos=True, stop_token_ids=others)), {},
         r"request 'eos': params.stop_token_ids=.* with EOS cover the whole vocabulary \(32 ids\) while min_tokens=2"),
    ])
    # Without min_tokens something can be sampled.
    loop.submit("free", [2, 3], SamplingParams(max_tokens=4, stop_token_ids=others))
    done = loop.run()
    assert len(done["free"].tokens) == 1 and done["free"].finish_reason == "stop"  # every token stops it


def test_abort_queued_and_running_requests_frees_what_they_hold_and_bystanders_run_on():
    prompts, params = prompts_and_params(5, seed=2)
    prompts[1] = list(range(3, 33))  # a long prompt with prompt logprobs: aborted between its chunks
    params[1] = SamplingParams(temperature=0.7, seed=1, max_tokens=10, prompt_logprobs=1)
    reference, _ = _run(prompts, params, drafts=2, token_budget=12, max_num_reqs=4)
    loop = _loop(max_num_reqs=4, token_budget=12, max_draft_tokens=2)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p, arrival_step=40 if i == 4 else 0)
    loop.step()
    assert loop.batch.prompt_logprobs.pending == (1,)  # request 1 is between prompt chunks
    loop.step()
    loop.step()
    free_kv = len(loop.model.kv.slots.free)
    aborted = {1: loop.abort(1), 4: loop.abort(4)}  # running mid-prefill; queued
    assert loop.batch.prompt_logprobs.pending == ()
    assert len(loop.model.kv.slots.free) == free_kv + 1 and len(loop.batch) == 3
    loop.step()
    loop.step()
    aborted[2] = loop.abort(2)  # running mid-decode
    for rid in (1, 2, 4, "nobody"):
        with pytest.raises(ValueError, match=rf"request {rid!r}: (already finished|unknown request_id)"):
            loop.abort(rid)
    with pytest.raises(ValueError, match="request_id=None"):
        loop.abort(None)
    done = loop.run()
    holds_nothing(loop)
    for rid, c in aborted.items():
        assert done[rid] is c and c.finish_reason == "abort" and c.error is None
        assert c.tokens == reference[rid][0][: len(c.tokens)]
    assert aborted[1].tokens == [] and aborted[4].tokens == [] and aborted[2].tokens
    for rid in (0, 3):
        assert completions(done)[rid][1:] == reference[rid]


def test_aborting_the_request_others_wait_on_for_a_shared_prefix_does_not_wedge_them():
    prompts, params = shared_prefix_prompts(4)
    prompts[0] = prompts[2][:24] + [9, 9]  # the donor holds both system prompts' first 12 tokens, and all of 2's
    params[2] = dataclasses.replace(params[2], prompt_logprobs=False)  # (prompt logprobs never share)
    reference, _ = _run(prompts, params, token_budget=32, min_shared_prefix=8)
    loop = _loop(token_budget=32, min_shared_prefix=8)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    loop.step()
    donor, *waiters = loop.running
    assert donor.prefilled == len(prompts[0]) and [r.prefilled for r in waiters] == [0, 0, 0]  # they wait for it
    loop.abort(0)
    done = loop.run()
    holds_nothing(loop)
    assert [c[1:] for c in completions(done)[1:]] == reference[1:]


def test_run_jumps_over_idle_steps_to_the_next_arrival():
    prompts, params = prompts_and_params(2)
    reference, _ = _run(prompts, params)
    loop = _loop()
    loop.submit(0, prompts[0], params[0], arrival_step=10**9)
    loop.submit(1, prompts[1], params[1], arrival_step=10**9 + 3)
    calls = []
    step = loop.step

    def counted():
        calls.append(loop.stats.steps)
        assert len(calls) < 1000, "run() steps through the idle steps one by one"
        return step()

    loop.step = counted
    done = loop.run()
    assert [c[1:] for c in completions(done)] == reference
    assert calls[0] == 10**9 and loop.stats.steps == 10**9 + len(calls)  # the clock counts the skipped steps


class Boom(Exception):
    pass


class FaultyModel:
    """The tiny model with faults on cue: `fail("before" | "after", exc)` makes the next
    forward raise before it starts or after it wrote the cache and the output rows;
    `poison` holds KV slots whose rows the next forwards fill with NaN."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.fault: tuple[str, BaseException] | None = None
        self.poison: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def fail(self, where: str, exc: BaseException) -> None:
        self.fault = (where, exc)

    def _fire(self, where: str) -> None:
        if self.fault is not None and self.fault[0] == where:
            exc, self.fault = self.fault[1], None
            raise exc

    def forward(self, token_ids, positions, batch, out=None):
        self._fire("before")
        hidden = self.model.forward(token_ids, positions, batch, out=out)
        offsets = batch.token_offsets
        for i, slot in enumerate(batch.slots.tolist()):
            if slot in self.poison:
                hidden[offsets[i] : offsets[i + 1]] = float("nan")
        self._fire("after")
        return hidden


class _AskedIds:
    """Stop ids whose every membership test goes through `wrap` (a fault injector)."""

    def __init__(self, ids: tuple[int, ...], wrap) -> None:
        self.ids, self.contains = ids, wrap(ids.__contains__)

    def __contains__(self, token: int) -> bool:
        return self.contains(token)


def atomic_workload():
    """Chunked prefill with prompt logprobs (request 0: 30 tokens at a 12-token budget, so
    its early chunks are not last ones), drafts, shared prefixes, staggered arrivals, and
    fewer KV slots than requests."""
    prompts, params = shared_prefix_prompts(6, seed=5)
    prompts[0] = list(range(3, 33))
    params[0] = SamplingParams(temperature=0.8, seed=7, max_tokens=6, prompt_logprobs=2, logprobs=1)
    params[1] = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2)
    return prompts, params, [0, 0, 1, 3, 4, 9]


def _atomic_loop(model=None) -> DecodeLoop:
    return _loop(num_slots=4, model=model, max_num_reqs=3, token_budget=12, max_draft_tokens=2, min_shared_prefix=8)


def _submit(loop, prompts, params, arrivals) -> None:
    for i, (prompt, p, arrival) in enumerate(zip(prompts, params, arrivals)):
        loop.submit(i, prompt, p, arrival_step=arrival)


FAULTS = ["forward before", "forward after", "interrupt after forward", "engine before", "engine after",
          "stop check", "commit"]


@functools.cache
def atomic_reference() -> tuple[list, dict, int]:
    """The uninterrupted run: completions, loop counters, engine steps."""
    clean = _atomic_loop()
    _submit(clean, *atomic_workload())
    return completions(clean.run()), counters(clean.stats), clean.engine.stats.steps


@pytest.mark.parametrize("fault", FAULTS)
def test_a_step_that_raises_leaves_no_trace_and_the_run_ends_as_if_it_never_happened(fault):
    prompts, params, arrivals = atomic_workload()
    model = FaultyModel(tiny_model(4))
    loop = _atomic_loop(model)
    _submit(loop, prompts, params, arrivals)
    exc = KeyboardInterrupt() if fault.startswith("interrupt") else Boom(fault)
    armed = []

    def one_shot(target):
        def wrapped(*args, **kwargs):
            if armed and armed[0] == "before":
                armed.clear()
                raise exc
            result = target(*args, **kwargs)
            if armed and armed[0] == "after":
                armed.clear()
                raise exc
            return result
        return wrapped

    if fault.startswith("engine"):
        loop.engine.run = one_shot(loop.engine.run)
    elif fault == "stop check":  # the model's stop ids, asked after each emitted token
        model.stop_token_ids = _AskedIds(model.model.stop_token_ids, one_shot)
    elif fault == "commit":
        loop.batch.record = one_shot(loop.batch.record)

    def arm() -> bool:
        """Arm the fault unless it is still armed (a step without tokens never reaches the stop check)."""
        if model.fault is not None or armed:
            return False
        if "forward" in fault:
            model.fail("before" if "before" in fault else "after", exc)
        else:
            armed[:] = ["before" if fault.endswith("before") else "after"]
        return True

    # Clock steps 1 and 2 admit requests, 9 and 13 admit them into retained caches' slots.
    targets, failures, arms = [1, 2, 4, 9, 13], 0, 0
    while loop.has_work() and loop.stats.steps < 40:
        if targets and loop.stats.steps == targets[0]:
            arms += arm()
            targets.pop(0)
        before = loop_state(loop)
        try:
            loop.step()
        except (Boom, KeyboardInterrupt):
            failures += 1
            assert_no_trace(before, loop_state(loop))
    assert failures == arms >= 4
    done = loop.run()
    assert (completions(done), counters(loop.stats), loop.engine.stats.steps) == atomic_reference()
    holds_nothing(loop)


def test_a_failed_row_finishes_its_request_with_an_error_and_frees_what_it_held():
    prompts, params = prompts_and_params(4, seed=3)
    reference, _ = _run(prompts, params, drafts=2, token_budget=32, max_num_reqs=4)
    loop = _loop(max_num_reqs=4, max_draft_tokens=2)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    run = loop.engine.run

    def fails_request_2_at_step_3(hidden, inputs, arrays, **kwargs):
        out = run(hidden, inputs, arrays, **kwargs)
        if loop.stats.steps == 3:
            i = out.request_ids.index(2)
            out.errors[i] = "request 2: non-finite logits"
            out.tokens[i] = []
            out.logprobs[i] = [] if out.logprobs[i] is not None else None
        return out

    loop.engine.run = fails_request_2_at_step_3
    events = [loop.step() for _ in range(4)]
    assert [e for e in events[3] if e.request_id == 2] == [StepEvent(2, [], True)]
    failed = loop.finished[2]
    assert failed.finish_reason == "error" and failed.error == "request 2: non-finite logits"
    assert failed.tokens == reference[2][0][: len(failed.tokens)] and len(failed.tokens) >= 2
    assert len(loop.batch) == 3 and len(loop.model.kv.slots.free) == 5
    done = loop.run()
    holds_nothing(loop)
    assert [completions(done)[i][1:] for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]



def test_a_retained_cache_that_a_failed_step_wrote_over_keeps_only_what_it_still_holds():
    """A failed step hands a retained cache's slot to a new request, whose forward writes
    its own prompt there before the step raises. Rolled back, the cache must not claim
    positions it lost: a later request sharing its prefix would copy the wrong keys."""
    rng = np.random.default_rng(8)
    donor_prompt = rng.integers(3, V, 24).tolist()
    later = donor_prompt + [7, 8]
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logprobs=1)
    weights = random_weights(CONFIG, seed=0)
    weights.embed = weights.embed * 0.05  # flat logits: every logprob moves with any change to a hidden state
    alone = _loop(model=LlamaModel(CONFIG, weights, num_slots=1, batch_invariant=True), max_num_reqs=1,
                  min_shared_prefix=8)
    alone.submit("later", later, sampled)
    reference = completions(alone.run())

    model = FaultyModel(LlamaModel(CONFIG, weights, num_slots=2, batch_invariant=True))
    loop = _loop(model=model, max_num_reqs=2, min_shared_prefix=8)
    loop.submit("donor", donor_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    loop.submit("long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    loop.step()
    donor_slot, = loop.retained  # the donor finished; "long" holds the other slot
    loop.submit("new", [(donor_prompt[0] + 1) % V, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))
    model.fail("after", Boom("after the new request's prompt was written"))
    with pytest.raises(Boom):
        loop.step()  # "new" took the donor's slot, wrote position 0 on, then the step failed
    assert list(loop.retained) == [donor_slot] and len(loop.retained[donor_slot]) == 0
    loop.abort("new")
    loop.abort("long")  # a free slot: "later" is admitted there and may copy from the donor
    loop.submit("later", later, sampled)
    done = loop.run()
    assert completions({"later": done["later"]}) == reference
    assert loop.stats.shared_prefix_tokens == 0  # the donor lost its first positions: nothing to share


def test_a_nan_hidden_row_fails_only_its_request():
    prompts, params = prompts_and_params(4, seed=4)
    reference, _ = _run(prompts, params, token_budget=32, max_num_reqs=4)
    model = FaultyModel(tiny_model())
    loop = _loop(model=model, max_num_reqs=4)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    loop.step()
    loop.step()
    model.poison = {next(r.kv_slot for r in loop.running if r.request_id == 1)}
    loop.step()
    model.poison = set()
    assert loop.finished[1].finish_reason == "error" and "request 1" in loop.finished[1].error
    done = loop.run()
    holds_nothing(loop)
    assert [completions(done)[i][1:] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert done[1].tokens == reference[1][0][: len(done[1].tokens)]


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
    assert [c.tokens for _, c in sorted(loop.run().items())] == [c[0] for c in _run(prompts, params)[0]]


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
    assert [c.tokens for _, c in sorted(done.items())] == [c[0] for c in _run(prompts, params)[0]]
