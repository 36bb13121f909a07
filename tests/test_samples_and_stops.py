"""n > 1 samples, stop strings and the tokenizer in the decode loop (issue 14), on a tiny
random model over the byte tokenizer (ids 0-255 are bytes: ASCII is one token a
character, other bytes make partial characters the text holds back).

References are plain: a splitmix64 generator written out, the whole-text stop-string
cut of tests/test_stop_strings.py applied to the same request's output without stop
strings, and the same requests submitted one by one with n = 1."""
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
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, random_weights
from engine.models.tokenizer import ByteChatMLTokenizer
from tests.test_decode_loop_faults import Boom, assert_no_trace, holds_nothing, loop_state
from tests.test_stop_strings import reference as stop_reference

CONFIG = LlamaConfig.tiny()
TOKENIZER = ByteChatMLTokenizer()  # its ids 0-255 are bytes: the tiny model's whole vocabulary


@functools.cache
def soft_weights():
    """Tied weights scaled down (printable ASCII less), so that sampling at temperature 1
    spreads over many tokens; the plain random model repeats one token whatever the seed."""
    weights = random_weights(CONFIG, 0)
    scale = torch.full((CONFIG.vocab_size, 1), 0.03)
    scale[32:127] = 0.1
    return dataclasses.replace(weights, embed=weights.embed * scale)


def soft_model(num_slots: int = 8) -> LlamaModel:
    return LlamaModel(CONFIG, soft_weights(), num_slots=num_slots, batch_invariant=True)


def make_loop(model=None, tokenizer=TOKENIZER, **options) -> DecodeLoop:
    config = dict(max_num_reqs=4, token_budget=32)
    config.update(options)
    return DecodeLoop(model or soft_model(), LoopConfig(seed_base=0, **config), engine_config=EngineConfig(device="cpu"),
                      tokenizer=tokenizer)


def outputs(done: dict) -> dict:
    return {rid: (c.tokens, c.logprobs, c.seed, c.finish_reason) for rid, c in done.items()}


PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # b"Hello, world"


# -- n > 1 ---------------------------------------------------------------------------------

def splitmix64(state: int, count: int) -> list[int]:
    """The first `count` outputs of splitmix64 (Steele, Lea and Flood, 2014) from `state`."""
    mask, out = 2**64 - 1, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_n_samples_are_keyed_by_request_and_index_and_generate_lists_them():
    params = [SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=3), SamplingParams(temperature=0.0, max_tokens=4)]
    loop = make_loop()
    loop.submit("a", PROMPT, params[0])
    loop.submit("b", PROMPT[:5], params[1])
    done = loop.run()
    assert sorted(done, key=repr) == sorted([("a", 0), ("a", 1), ("a", 2), "b"], key=repr)
    assert [done[("a", j)].request_id for j in range(3)] == [("a", 0), ("a", 1), ("a", 2)]
    listed = generate(soft_model(), [PROMPT, PROMPT[:5]], params, config=LoopConfig(seed_base=0, max_num_reqs=4, token_budget=32),
                      engine_config=EngineConfig(device="cpu"))
    assert isinstance(listed[0], list) and len(listed[0]) == 3 and not isinstance(listed[1], list)
    assert [c.tokens for c in listed[0]] == [done[("a", j)].tokens for j in range(3)]
    assert listed[1].tokens == done["b"].tokens and listed[1].request_id == 1


@pytest.mark.parametrize("seed", [5, 2**64 - 1, None])
def test_siblings_have_distinct_seeds_differ_and_each_reproduces_alone(seed):
    n = 4
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, n=n, logprobs=1)
    loop = make_loop()
    loop.submit("r", PROMPT, params)
    done = loop.run()
    samples = [done[("r", j)] for j in range(n)]
    seeds = [c.seed for c in samples]
    if seed is not None:
        assert seeds == [seed, *splitmix64(seed, n - 1)]  # j = 0 keeps the request's seed
    assert len(set(seeds)) == n
    assert len({tuple(c.tokens) for c in samples}) == n  # no duplicate samples
    for j, c in enumerate(samples):
        alone = make_loop()
        alone.submit("again", PROMPT, dataclasses.replace(params, n=1, seed=c.seed))
        again = alone.run()["again"]
        assert (again.tokens, again.logprobs, again.seed) == (c.tokens, c.logprobs, c.seed), j
    # n = 1 with the same seed is sample 0
    if seed is not None:
        one = make_loop()
        one.submit("one", PROMPT, dataclasses.replace(params, n=1))
        assert one.run()["one"].tokens == samples[0].tokens


class CountingModel:
    """The model, counting the prompt positions each forward computes."""

    def __init__(self, model: LlamaModel, prompt_len: int):
        self.model, self.prompt_len, self.prompt_positions = model, prompt_len, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, token_ids, positions, batch, out=None):
        self.prompt_positions += int((positions < self.prompt_len).sum())
        return self.model.forward(token_ids, positions, batch, out=out)


@pytest.mark.parametrize("prompt_len", [5, 20])  # below and above LoopConfig.min_shared_prefix
def test_siblings_prefill_the_prompt_once_and_copy_it(prompt_len):
    prompt = (PROMPT * 2)[:prompt_len]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=5, n=4)
    shared = CountingModel(soft_model(), prompt_len)
    loop = make_loop(shared)
    loop.submit("r", prompt, params)
    done = loop.run()
    # Sample 0 computes the prompt; the others copy all of it but its last token, whose row
    # gives each its first token.
    assert shared.prompt_positions == prompt_len + 3
    assert loop.stats.prefill_tokens == prompt_len + 3
    assert loop.stats.shared_prefix_tokens == 3 * (prompt_len - 1)
    computed = CountingModel(soft_model(), prompt_len)
    apart = make_loop(computed, prefix_sharing=False)
    apart.submit("r", prompt, params)
    assert outputs(apart.run()) == outputs(done)
    assert computed.prompt_positions == 4 * prompt_len


def test_abort_of_a_request_with_n_aborts_every_live_sample():
    loop = make_loop(max_num_reqs=2)
    loop.submit("r", PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=20, n=3))
    loop.submit("short", PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=1, n=2))
    loop.step()
    loop.step()
    one = loop.abort(("r", 1))
    assert one.request_id == ("r", 1) and one.finish_reason == "abort"
    aborted = loop.abort("r")
    assert [c.request_id for c in aborted] == [("r", 0), ("r", 1), ("r", 2)]
    assert all(c.finish_reason == "abort" for c in aborted)
    with pytest.raises(ValueError, match=r"request 'r': all 3 samples already finished"):
        loop.abort("r")
    loop.run()
    with pytest.raises(ValueError, match="request 'short': all 2 samples already finished"):
        loop.abort("short")  # both finished by length
    holds_nothing(loop)


def test_a_sample_id_already_taken_is_refused_and_changes_nothing():
    loop = make_loop()
    loop.submit(("a", 1), PROMPT)
    before = loop_state(loop)
    with pytest.raises(ValueError, match=r"request 'a': params.n=2: the id \('a', 1\) of one of its samples"):
        loop.submit("a", PROMPT, SamplingParams(n=2))
    assert loop_state(loop) == before and "a" not in loop.families


# -- the tokenizer: text, refusals without one ------------------------------------------------

def test_text_is_the_decoded_output_with_a_tokenizer_and_none_without():
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10) for s in range(3)]
    with_text = generate(soft_model(), [PROMPT] * 3, params, engine_config=EngineConfig(device="cpu"),
                         tokenizer=TOKENIZER)
    without = generate(soft_model(), [PROMPT] * 3, params, engine_config=EngineConfig(device="cpu"))
    assert [c.text for c in with_text] == [TOKENIZER.decode(c.tokens) for c in with_text]
    assert [c.tokens for c in with_text] == [c.tokens for c in without] and all(c.text is None for c in without)


@pytest.mark.parametrize("field, value", [
    ("stop", ("\n",)),
    ("json_schema", '{"type": "object"}'),
    ("regex", "[a-z]+"),
    ("grammar", 'root ::= "yes" | "no"'),
])
def test_without_a_tokenizer_stop_strings_and_structured_output_are_refused(field, value):
    loop = make_loop(tokenizer=None)
    loop.submit("fine", PROMPT)
    before = loop_state(loop)
    with pytest.raises(ValueError, match=rf"request 'x': params.{field}=.*need.* a tokenizer"):
        loop.submit("x", PROMPT, SamplingParams(n=2, **{field: value}))
    assert loop_state(loop) == before and "x" not in loop.families


# -- stop strings in the loop ----------------------------------------------------------------

def stop_workload(seed: int):
    """Prompts and params: greedy ones (which fall into repeats: drafts get accepted) and
    sampled ones (bytes of every kind, partial characters included)."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(6):
        motif = rng.integers(32, 127, int(rng.integers(2, 5))).tolist()
        prompts.append((motif * 4)[: int(rng.integers(3, 14))])
        params.append(SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=100 + i, max_tokens=24, logprobs=1))
    return prompts, params


def run_all(prompts, params, **options) -> tuple[dict, DecodeLoop, list]:
    loop = make_loop(**options)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    events = []
    done = loop.run(on_step=events.extend)
    return done, loop, events


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("drafts", [0, 3])
def test_stop_strings_cut_the_output_as_the_whole_text_reference_does(include, drafts):
    prompts, params = stop_workload(seed=drafts + include)
    free, _, _ = run_all(prompts, params)
    rng = np.random.default_rng(7)
    stops = []
    for i in range(len(prompts)):
        text = TOKENIZER.decode(free[i].tokens)
        start = int(rng.integers(1, len(text) - 4))  # spans 2-4 tokens, starting past the first
        stops.append((text[start : start + int(rng.integers(2, 5))], "never-said"))
    stopped_params = [dataclasses.replace(p, stop=s, include_stop_str_in_output=include) for p, s in zip(params, stops)]
    done, loop, events = run_all(prompts, stopped_params, max_draft_tokens=drafts)
    if drafts:
        assert loop.stats.drafts_accepted > 0
    for i in range(len(prompts)):
        text, tokens, stop = stop_reference(TOKENIZER.decode, free[i].tokens, list(stops[i]), include)
        c = done[i]
        assert (c.text, c.tokens, c.stop_reason) == (text, tokens, stop), i
        assert c.finish_reason == ("stop" if stop is not None else free[i].finish_reason)
        assert c.logprobs == free[i].logprobs[: len(tokens)]
        streamed: list[int] = []
        for e in events:
            if e.request_id == i:
                del streamed[len(streamed) - e.retracted :]
                streamed += e.new_tokens
        assert streamed == c.tokens
    assert loop.stats.tokens_generated == sum(len(c.tokens) for c in done.values())
    holds_nothing(loop)


def test_a_stop_token_id_is_the_stop_reason_and_eos_gives_none():
    loop = make_loop()
    free = make_loop()
    free.submit(0, PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=12))
    tokens = free.run()[0].tokens
    loop.submit(0, PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=12, stop_token_ids=(tokens[4],)))
    c = loop.run()[0]
    assert (c.finish_reason, c.stop_reason, c.tokens) == ("stop", tokens[4], tokens[: tokens.index(tokens[4]) + 1])


def test_every_step_that_raises_after_its_stop_strings_leaves_no_trace():
    """Each step fails once, in the bookkeeping after its stop strings were applied (the
    batch's record of the step), and runs again: the cut tokens and logprobs (some from
    earlier steps), the texts, the stop reasons all go back, and the run ends as a clean
    one does. Drafts on; one request has n = 2."""
    prompts, params = stop_workload(seed=11)
    free, _, _ = run_all(prompts, params)
    stops = [TOKENIZER.decode(free[i].tokens)[5:8] for i in range(len(prompts))]
    params = [dataclasses.replace(p, stop=(s,)) for p, s in zip(params, stops)]
    params[0] = dataclasses.replace(params[0], n=2)
    clean, clean_loop, _ = run_all(prompts, params, max_draft_tokens=3)
    loop = make_loop(max_draft_tokens=3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    record, failed, cut = loop.batch.record, [], []

    def faulty_record(*args, **kwargs):
        record(*args, **kwargs)
        if not failed or failed[-1] != loop.stats.steps:  # the first try of each step
            failed.append(loop.stats.steps)
            cut.extend(r.request_id for r in loop.running if isinstance(r.completion.stop_reason, str))
            raise Boom("after the step's stop strings")

    loop.batch.record = faulty_record
    while loop.has_work():
        before = text_state(loop)
        try:
            loop.step()
        except Boom:
            assert_no_trace(before, text_state(loop))
    assert len(set(cut)) >= 3  # steps that cut a request on a stop string were undone
    assert {rid: (*o, c.text, c.stop_reason) for (rid, o), c in zip(outputs(loop.finished).items(), loop.finished.values())} \
        == {rid: (*o, c.text, c.stop_reason) for (rid, o), c in zip(outputs(clean).items(), clean.values())}
    assert loop.stats.tokens_generated == clean_loop.stats.tokens_generated


def text_state(loop: DecodeLoop) -> dict:
    """`loop_state` plus what stop strings change: texts, stop reasons, logprob counts."""
    requests = [r for _, r in loop.waiting] + loop.running
    return dict(loop_state(loop),
                texts={r.request_id: (r.completion.text, r.completion.stop_reason, r.text.state(),
                                      list(r.completion.tokens), len(r.completion.logprobs)) for r in requests},
                done={rid: (c.text, c.stop_reason) for rid, c in loop.finished.items()})


def test_a_stop_string_in_the_held_back_text_is_found_when_the_output_ends():
    """The last token is the first byte of a character: its text is held back, and the
    stop string ending in it is found only when the output ends (max_tokens)."""
    free = make_loop()
    free.submit(0, PROMPT, SamplingParams(temperature=1.0, seed=4, max_tokens=40))
    tokens = free.run()[0].tokens
    m = next(m for m in range(2, len(tokens)) if 0xC2 <= tokens[m] <= 0xF4 and tokens[m - 1] < 0x80)
    text = TOKENIZER.decode(tokens[: m + 1])
    assert text.endswith("\ufffd")
    stop = text[-2:]
    loop = make_loop()
    loop.submit(0, PROMPT, SamplingParams(temperature=1.0, seed=4, max_tokens=m + 1, stop=stop))
    c = loop.run()[0]
    assert (c.text, c.tokens, c.stop_reason) == stop_reference(TOKENIZER.decode, tokens[: m + 1], [stop], False)
    assert c.stop_reason == stop and c.finish_reason == "stop"
